// Checkpoint and resume: a resumed run equals an uninterrupted one; a
// corrupted or incomplete checkpoint is refused before anything is loaded;
// retention keeps the newest complete checkpoints.
#include "trainer/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "absl/strings/match.h"
#include "himoe/v1/model.pb.h"
#include "common/file_util.h"
#include "common/optimizer_state_key.h"
#include "model/checkpoint_reader.h"
#include "router_service/routing/routing_config.h"
#include "tests/trainer/trainer_test_util.h"
#include "trainer/trainer.h"

namespace himoe::trainer {
namespace {

using model::CheckpointDirName;
using model::LatestCheckpoint;
using ::testing::HasSubstr;
using testing::CorpusText;
using testing::ExpertCluster;
using TempDir = testing::TempDir;

constexpr double kTol = 1e-6;

// One corpus for the whole binary, removed after the last test.
const std::string& CorpusPath() {
  static TempDir* const dir = new TempDir("himoe_checkpoint_corpus");
  static const std::string* path = [] {
    auto* file = new std::string(dir->Sub("corpus.txt"));
    test_util::WriteTextFile(*file, CorpusText());
    return file;
  }();
  return *path;
}

class CorpusCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    if (KindOf(CorpusPath()) == PathKind::kFile) (void)RemoveAll(Dirname(CorpusPath()));
  }
};
[[maybe_unused]] ::testing::Environment* const kCorpusCleanup =
    ::testing::AddGlobalTestEnvironment(new CorpusCleanup);

TrainerOptions SmallOptions(router::RoutingMethod method) {
  TrainerOptions o;
  o.model.n_layer = 2;
  o.model.n_head = 2;
  o.model.d_model = 32;
  o.model.d_ff = 48;
  o.model.dense_ff = 64;
  o.model.block_size = 16;
  o.model.routing.method = method;
  o.model.routing.num_experts = 4;
  o.model.routing.num_groups = 2;
  o.model.routing.top_k = 1;
  o.model.routing.tau = 0.1;
  // Large enough that the loss_free bias visibly moves in a few steps.
  o.model.routing.loss_free_rate = 0.05;
  o.model.seed = 3;
  o.data.paths = {CorpusPath()};
  o.data.format = "bytes";
  o.steps = 6;
  o.batch_size = 4;
  o.grad_accum = 2;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.eval_windows = 4;
  o.seed = 11;
  return o;
}

std::unique_ptr<Trainer> MakeTrainer(const TrainerOptions& o) {
  auto t = Trainer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

// The dense AdamW state, by position in the optimizer's param groups: every
// parameter's exp_avg, exp_avg_sq and step, and each group's learning rate.
// A parameter without state is recorded as such, so that state present on
// one side only is a mismatch of names.
std::map<std::string, at::Tensor> DenseOptimizerState(Trainer& t) {
  std::map<std::string, at::Tensor> out;
  torch::optim::AdamW& opt = t.optimizer();
  using Key = std::decay_t<decltype(opt.state())>::key_type;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& group = opt.param_groups()[g];
    const std::string name = "adamw.g" + std::to_string(g) + ".";
    out[name + "lr"] = at::tensor(
        static_cast<const torch::optim::AdamWOptions&>(group.options()).lr(), at::kDouble);
    for (size_t i = 0; i < group.params().size(); ++i) {
      const std::string p = name + std::to_string(i) + ".";
      auto it = opt.state().find(OptimizerStateKey<Key>(group.params()[i].unsafeGetTensorImpl()));
      if (it == opt.state().end()) {
        out[p + "no_state"] = at::zeros({0});
        continue;
      }
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      out[p + "exp_avg"] = st.exp_avg().detach().clone();
      out[p + "exp_avg_sq"] = st.exp_avg_sq().detach().clone();
      out[p + "step"] = at::tensor(static_cast<int64_t>(st.step()), at::kLong);
    }
  }
  return out;
}

// Everything a resumed run must reproduce: dense parameters and buffers and
// their AdamW state and learning rate, the routers' pending counts, every
// group's expert weights and optimizer state.
std::map<std::string, at::Tensor> FullState(Trainer& t) {
  std::map<std::string, at::Tensor> out = DenseOptimizerState(t);
  for (const auto& p : t.model().named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : t.model().named_buffers()) out[b.key()] = b.value().detach().clone();
  // The routers' own tensors (the registered buffers alias them), and the
  // pending loss_free counts, which are not registered.
  for (int m = 0; m < t.model().num_moe_layers(); ++m) {
    router::RouterLayer& r = t.model().router(m);
    const std::string p = "router" + std::to_string(m) + ".";
    out[p + "gate"] = r.gate_weight().detach().clone();
    out[p + "logit_ema"] = r.logit_ema().clone();
    out[p + "loss_free_bias"] = r.loss_free_bias().clone();
    out[p + "pending_counts"] = r.pending_counts().clone();
  }
  for (int g = 0; g < t.experts().num_groups(); ++g) {
    auto state = t.experts().GetState(g);
    EXPECT_TRUE(state.ok()) << state.status();
    if (!state.ok()) continue;
    for (const auto& [name, tensor] : *state) {
      out["experts_g" + std::to_string(g) + "." + name] = tensor.clone();
    }
  }
  return out;
}

// Max |a - b| over every tensor; expects the same names and shapes.
void ExpectStatesNear(const std::map<std::string, at::Tensor>& a,
                      const std::map<std::string, at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, ta] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    const at::Tensor& tb = it->second;
    ASSERT_EQ(ta.sizes(), tb.sizes()) << name;
    if (ta.numel() == 0) continue;
    const double diff =
        (ta.to(at::kDouble) - tb.to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, tol) << name;
  }
}

void ExpectStatesEqual(const std::map<std::string, at::Tensor>& a,
                       const std::map<std::string, at::Tensor>& b) {
  ExpectStatesNear(a, b, 0.0);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Entries(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> listed = ListDirectory(dir);
  EXPECT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> out = listed.ok() ? *listed : std::vector<std::string>{};
  std::sort(out.begin(), out.end());
  return out;
}

// ---- (a) Resume equality.

struct RunRecord {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;
};

RunRecord Uninterrupted(const TrainerOptions& o, int steps) {
  RunRecord run;
  auto t = MakeTrainer(o);
  if (t == nullptr) return run;
  for (int i = 0; i < steps; ++i) {
    auto r = t->Step();
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    run.losses.push_back(r->loss);
  }
  run.state = FullState(*t);
  return run;
}

// `split` steps, save, destroy, fresh trainer, load, the rest.
// `options_for_resume` may differ from `o` only in where the experts live.
RunRecord Resumed(const TrainerOptions& o, const TrainerOptions& options_for_resume, int split,
            int steps, const std::string& root) {
  RunRecord run;
  {
    auto t = MakeTrainer(o);
    if (t == nullptr) return run;
    for (int i = 0; i < split; ++i) {
      auto r = t->Step();
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return run;
      run.losses.push_back(r->loss);
    }
    const absl::Status saved = SaveCheckpoint(*t, root, /*keep_last=*/3);
    EXPECT_TRUE(saved.ok()) << saved;
  }
  auto t = MakeTrainer(options_for_resume);
  if (t == nullptr) return run;
  auto latest = LatestCheckpoint(root);
  EXPECT_TRUE(latest.ok()) << latest.status();
  if (!latest.ok()) return run;
  EXPECT_EQ(*latest, JoinPath(root, CheckpointDirName(split)));
  const absl::Status loaded = LoadCheckpoint(*t, *latest);
  EXPECT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(t->step(), split);
  for (int i = split; i < steps; ++i) {
    auto r = t->Step();
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    EXPECT_EQ(r->step, i + 1);
    run.losses.push_back(r->loss);
  }
  run.state = FullState(*t);
  return run;
}

void ExpectSameRun(const RunRecord& a, const RunRecord& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], kTol) << "step " << i + 1;
  }
  ExpectStatesNear(a.state, b.state, kTol);
}

// A routing set-up whose router state a resume must carry.
struct ResumeVariant {
  const char* name;
  router::RoutingMethod method;
  const char* preset;
  double target_expert_cv;
  double epsilon_ov = 0;  // dual ascent budgets (himoe)
  double epsilon_sys = 0;
};

class ResumeTest : public ::testing::TestWithParam<ResumeVariant> {};

TEST_P(ResumeTest, ResumedRunEqualsUninterruptedRun) {
  const ResumeVariant& v = GetParam();
  TrainerOptions o = SmallOptions(v.method);
  ASSERT_TRUE(router::ApplyPreset(v.preset, &o.model.routing).ok());
  o.model.routing.target_expert_cv = v.target_expert_cv;
  o.model.routing.epsilon_ov = v.epsilon_ov;
  o.model.routing.epsilon_sys = v.epsilon_sys;
  TempDir root;
  const RunRecord a = Uninterrupted(o, 6);
  const RunRecord b = Resumed(o, o, 3, 6, root.path());
  ASSERT_EQ(a.losses.size(), 6u);
  ExpectSameRun(a, b);
  // The state each variant adds moved, so the comparison above covers
  // restoring it.
  const auto moved = [&](const std::string& name, double from) {
    EXPECT_GT((a.state.at(name) - from).abs().max().item<double>(), 0.0) << name;
  };
  if (v.method == router::RoutingMethod::kLossFree) moved("router0.loss_free_bias", 0);
  if (v.method == router::RoutingMethod::kHiMoe) moved("router0.logit_ema", 0);
  if (v.target_expert_cv > 0) {
    moved("moe0_balance_upper", 0);
    moved("moe0_balance_lower", 0);
  }
  // Budgets under a near-uniform gate's C_ov (~0.75) and C_sys (~0.125): both
  // multipliers rise from 0.
  if (v.epsilon_ov > 0) moved("moe0_lambda_intra", 0);
  if (v.epsilon_sys > 0) moved("moe0_lambda_inter", 0);
  if (std::string(v.preset) == "reference" && router::IsGrouped(v.method)) {
    moved("moe0_router_scale", 1);
  }
  if (std::string(v.preset) == "reference" && v.method == router::RoutingMethod::kStMoe) {
    EXPECT_EQ(a.state.at("moe0_route_calls").item<int64_t>(), 6 * o.grad_accum);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, ResumeTest,
    ::testing::Values(ResumeVariant{"himoe", router::RoutingMethod::kHiMoe, "paper", 0},
                      ResumeVariant{"loss_free", router::RoutingMethod::kLossFree, "paper", 0},
                      ResumeVariant{"himoe_controller", router::RoutingMethod::kHiMoe, "paper",
                                    0.1},
                      ResumeVariant{"himoe_controller_dual", router::RoutingMethod::kHiMoe,
                                    "paper", 0.1, 0.5, 0.01},
                      ResumeVariant{"himoe_reference", router::RoutingMethod::kHiMoe,
                                    "reference", 0},
                      ResumeVariant{"st_moe_reference", router::RoutingMethod::kStMoe,
                                    "reference", 0}),
    [](const auto& info) { return std::string(info.param.name); });

// The loaded trainer must not just match at the end: the restored state
// equals the saved one right after LoadCheckpoint.
TEST(CheckpointTest, LoadRestoresExactlyWhatWasSaved) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  auto a = MakeTrainer(o);
  ASSERT_NE(a, nullptr);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(a->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*a, root.path(), 1).ok());
  auto b = MakeTrainer(o);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(LoadCheckpoint(*b, root.path() + "/" + CheckpointDirName(2)).ok());
  // The param groups' learning rate is not state: each step sets it from the
  // schedule (DenseAdamWStateAndScheduleSurviveResume checks it).
  auto without_lr = [](std::map<std::string, at::Tensor> state) {
    for (auto it = state.begin(); it != state.end();) {
      it = absl::EndsWith(it->first, ".lr") ? state.erase(it) : std::next(it);
    }
    return state;
  };
  ExpectStatesEqual(without_lr(FullState(*a)), without_lr(FullState(*b)));
  EXPECT_EQ(a->sampler().SerializeState(), b->sampler().SerializeState());
  EXPECT_EQ(b->step(), 2);
}

// Equal states make equal files: a run and its resumed copy (other tensor
// addresses) write byte-identical checkpoints, the dense AdamW state included,
// so runs can be compared by the files' sha256.
TEST(CheckpointTest, EqualStatesWriteIdenticalBytes) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir a_root, b_root;
  auto a = MakeTrainer(o);
  ASSERT_NE(a, nullptr);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(a->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*a, a_root.path(), 1).ok());
  auto b = MakeTrainer(o);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(LoadCheckpoint(*b, a_root.path() + "/" + CheckpointDirName(2)).ok());
  ASSERT_TRUE(a->Step().ok());
  ASSERT_TRUE(b->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*a, a_root.path(), 1).ok());
  ASSERT_TRUE(SaveCheckpoint(*b, b_root.path(), 1).ok());
  const std::string a_dir = a_root.Sub(CheckpointDirName(3));
  const std::string b_dir = b_root.Sub(CheckpointDirName(3));
  ASSERT_EQ(Entries(a_dir), Entries(b_dir));
  for (const std::string& name : Entries(a_dir)) {
    EXPECT_TRUE(ReadAll(JoinPath(a_dir, name)) == ReadAll(JoinPath(b_dir, name))) << name;
  }
  // The loaded moments are the saved ones, not just equal bytes by chance.
  ExpectStatesEqual(DenseOptimizerState(*a), DenseOptimizerState(*b));
}

// nanoGPT's get_lr, written out: linear warmup over `warmup` iterations to
// max_lr, then a half cosine from max_lr down to min_lr at `decay_steps`,
// min_lr after. `it` is the 0-based iteration (the step about to be taken).
double HandLearningRate(double max_lr, double min_lr, int64_t warmup, int64_t decay_steps,
                        int64_t it) {
  if (it < warmup) return max_lr * static_cast<double>(it + 1) / static_cast<double>(warmup + 1);
  if (it > decay_steps) return min_lr;
  const double ratio = static_cast<double>(it - warmup) / static_cast<double>(decay_steps - warmup);
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
  return min_lr + coeff * (max_lr - min_lr);
}

// Right after a load, every dense parameter has the saved AdamW moments and
// step (count and values), and each step after the resume runs at the hand
// schedule's learning rate, in the result and in every param group.
TEST(CheckpointTest, DenseAdamWStateAndScheduleSurviveResume) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  o.steps = 8;
  o.warmup_steps = 3;
  o.min_lr = 2e-4;
  TempDir root;
  std::map<std::string, at::Tensor> saved;
  const auto expect_lr = [&](Trainer& t, const StepResult& r) {
    const double want = HandLearningRate(o.lr, o.min_lr, o.warmup_steps, o.steps, r.step - 1);
    EXPECT_NEAR(r.lr, want, 1e-15) << "step " << r.step;
    for (auto& group : t.optimizer().param_groups()) {
      EXPECT_NEAR(static_cast<const torch::optim::AdamWOptions&>(group.options()).lr(), want,
                  1e-15)
          << "step " << r.step;
    }
  };
  {
    auto a = MakeTrainer(o);
    ASSERT_NE(a, nullptr);
    for (int i = 0; i < 4; ++i) {  // through the warmup and into the decay
      auto r = a->Step();
      ASSERT_TRUE(r.ok()) << r.status();
      expect_lr(*a, *r);
    }
    ASSERT_TRUE(SaveCheckpoint(*a, root.path(), 1).ok());
    saved = DenseOptimizerState(*a);
  }
  // Every dense parameter took 4 AdamW steps.
  size_t params = 0;
  for (const auto& [name, tensor] : saved) {
    EXPECT_EQ(name.find("no_state"), std::string::npos) << name;
    if (name.size() > 5 && name.substr(name.size() - 5) == ".step") {
      EXPECT_EQ(tensor.item<int64_t>(), 4) << name;
      ++params;
    }
  }
  auto b = MakeTrainer(o);
  ASSERT_NE(b, nullptr);
  size_t dense = 0;
  for (auto& group : b->optimizer().param_groups()) dense += group.params().size();
  EXPECT_EQ(params, dense);
  ASSERT_TRUE(LoadCheckpoint(*b, root.path() + "/" + CheckpointDirName(4)).ok());
  ExpectStatesEqual(DenseOptimizerState(*b), saved);
  for (int i = 4; i < 8; ++i) {
    auto r = b->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step, i + 1);
    expect_lr(*b, *r);
  }
}

TEST(CheckpointTest, DirectoryLayoutAndManifest) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  auto t = MakeTrainer(o);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  EXPECT_EQ(Entries(root.path()), std::vector<std::string>{"step_00000001"});
  const std::string dir = root.Sub("step_00000001");
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{"MANIFEST", "data.txt", "dense.pt", "experts_g0.pt",
                                      "experts_g1.pt", "meta.textproto", "optimizer.pt"}));
  const std::string manifest = ReadAll(JoinPath(dir, "MANIFEST"));
  std::istringstream lines(manifest);
  std::set<std::string> listed;
  for (std::string line; std::getline(lines, line);) {
    ASSERT_GT(line.size(), 66u) << line;
    EXPECT_EQ(line.substr(64, 2), "  ") << line;
    listed.insert(line.substr(66));
  }
  EXPECT_EQ(listed, (std::set<std::string>{"data.txt", "dense.pt", "experts_g0.pt",
                                           "experts_g1.pt", "meta.textproto", "optimizer.pt"}));
  // The MANIFEST is in sha256sum's format, and its digests are right.
  const std::string check =
      "cd '" + dir + "' && sha256sum --check --quiet --strict MANIFEST";
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
  // The meta data: a RunConfig in text format with every setting.
  v1::RunConfig meta;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(ReadAll(JoinPath(dir, "meta.textproto")),
                                                            &meta));
  EXPECT_EQ(meta.format(), "himoe-checkpoint-2");
  EXPECT_EQ(meta.step(), 1);
  EXPECT_EQ(meta.model().routing().method(), "himoe");
  EXPECT_EQ(meta.model().d_model(), 32);
  EXPECT_DOUBLE_EQ(meta.model().routing().loss_free_rate(), 0.05);
  EXPECT_DOUBLE_EQ(meta.model().routing().lambda_intra(), 0.1);
  EXPECT_EQ(meta.model().routing().inter_form(), "selected_weights");
  EXPECT_EQ(meta.training().batch_size(), 4);
  EXPECT_EQ(meta.training().grad_accum(), 2);
  auto fresh = MakeTrainer(o);
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(LoadCheckpoint(*fresh, dir).ok());
}

// Experts on expert-group services: the state is streamed out with GetState
// and pushed into brand-new services with SetState.
TEST(CheckpointTest, RemoteExpertsResumeIntoFreshServices) {
  const TrainerOptions local = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  RunRecord a, b;
  {
    ExpertCluster uninterrupted(local);
    a = Uninterrupted(uninterrupted.Remote(local), 6);
  }
  {
    // Save from services `before`, resume into untouched services `after`
    // (FullState is taken inside Resumed, while `after` is up).
    ExpertCluster before(local);
    ExpertCluster after(local);
    b = Resumed(before.Remote(local), after.Remote(local), 3, 6, root.path());
  }
  ASSERT_EQ(a.losses.size(), 6u);
  ExpectSameRun(a, b);
}

// ---- (b) Corruption.

TEST(CheckpointTest, FlippedByteIsDataLossAndNothingIsLoaded) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  {
    auto t = MakeTrainer(o);
    ASSERT_NE(t, nullptr);
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(t->Step().ok());
    ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  }
  auto latest = LatestCheckpoint(root.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  const std::string victim = JoinPath(*latest, "experts_g0.pt");
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    const std::streamoff pos = static_cast<std::streamoff>(*FileSize(victim) / 2);
    f.seekg(pos);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(pos);
    f.write(&c, 1);
    ASSERT_TRUE(f.good());
  }

  // A trainer in a different state (one step): the load must leave it as is.
  auto t = MakeTrainer(o);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Step().ok());
  const auto before = FullState(*t);
  const std::string sampler_before = t->sampler().SerializeState();

  const absl::Status s = LoadCheckpoint(*t, *latest);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("checkpoint " + *latest + ": experts_g0.pt fails its "
                                     "sha256 check (expected "));
  EXPECT_THAT(s.message(), HasSubstr(", got "));
  ExpectStatesEqual(before, FullState(*t));
  EXPECT_EQ(t->sampler().SerializeState(), sampler_before);
  EXPECT_EQ(t->step(), 1);
  // And it still trains.
  EXPECT_TRUE(t->Step().ok());
}

TEST(CheckpointTest, MissingManifestIsAnError) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  auto t = MakeTrainer(o);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  const std::string dir = root.Sub(CheckpointDirName(1));
  ASSERT_EQ(::unlink(JoinPath(dir, "MANIFEST").c_str()), 0);

  auto fresh = MakeTrainer(o);
  ASSERT_NE(fresh, nullptr);
  const auto before = FullState(*fresh);
  const absl::Status s = LoadCheckpoint(*fresh, dir);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("MANIFEST"));
  ExpectStatesEqual(before, FullState(*fresh));
  EXPECT_EQ(fresh->step(), 0);
  // Without its MANIFEST it is not a complete checkpoint.
  EXPECT_EQ(LatestCheckpoint(root.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, MissingListedFileIsDataLoss) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  auto t = MakeTrainer(o);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  const std::string dir = root.Sub(CheckpointDirName(0));
  ASSERT_EQ(::unlink(JoinPath(dir, "optimizer.pt").c_str()), 0);
  const absl::Status s = LoadCheckpoint(*t, dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("optimizer.pt"));
}

// Saves `saved`'s trainer after one step, then loads that checkpoint into a
// fresh `resumed` trainer; expects the trainer untouched when refused.
absl::Status ResumeWith(const TrainerOptions& saved, const TrainerOptions& resumed) {
  TempDir root;
  auto t = MakeTrainer(saved);
  if (t == nullptr) return absl::InternalError("no trainer");
  EXPECT_TRUE(t->Step().ok());
  EXPECT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  auto other = MakeTrainer(resumed);
  if (other == nullptr) return absl::InternalError("no trainer");
  const auto before = FullState(*other);
  const absl::Status s = LoadCheckpoint(*other, root.path() + "/" + CheckpointDirName(1));
  if (!s.ok()) {
    ExpectStatesEqual(before, FullState(*other));
    EXPECT_EQ(other->step(), 0);
  }
  return s;
}

TEST(CheckpointTest, OtherMethodIsRefused) {
  const absl::Status s = ResumeWith(SmallOptions(router::RoutingMethod::kHiMoe),
                                    SmallOptions(router::RoutingMethod::kLossFree));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("method"));
  EXPECT_THAT(s.message(),
              HasSubstr("model.routing.method: \"himoe\" in the checkpoint, \"loss_free\" in "
                        "this run"));
}

// --resume with another --preset: the paper's formulas in the checkpoint,
// the released code's in this run.
TEST(CheckpointTest, OtherPresetIsRefusedNamingTheFields) {
  const TrainerOptions paper = SmallOptions(router::RoutingMethod::kHiMoe);
  TrainerOptions reference = paper;
  ASSERT_TRUE(router::ApplyPreset("reference", &reference.model.routing).ok());
  const absl::Status s = ResumeWith(paper, reference);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("model.routing.renormalize: false in the checkpoint, true in this run"));
  EXPECT_THAT(s.message(), HasSubstr("model.routing.inter_form: \"selected_weights\" in the "
                                     "checkpoint, \"dense_group_mass\" in this run"));
  EXPECT_THAT(s.message(), HasSubstr("model.routing.capacity_factor: 0 in the checkpoint, 2 in "
                                     "this run"));
}

TEST(CheckpointTest, OtherLambdaIntraIsRefusedNamingTheField) {
  const TrainerOptions saved = SmallOptions(router::RoutingMethod::kHiMoe);
  TrainerOptions resumed = saved;
  resumed.model.routing.lambda_intra = 0.2;
  const absl::Status s = ResumeWith(saved, resumed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("model.routing.lambda_intra: 0.1 in the checkpoint, 0.2 in this run"));
  // The same settings resume.
  EXPECT_TRUE(ResumeWith(saved, saved).ok());
}

TEST(CheckpointTest, MissingDirectoryIsNotFound) {
  TempDir root;
  auto t = MakeTrainer(SmallOptions(router::RoutingMethod::kHiMoe));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(LoadCheckpoint(*t, root.path() + "/step_00000007").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(LatestCheckpoint(root.path()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LatestCheckpoint(root.path() + "/nope").status().code(),
            absl::StatusCode::kNotFound);
}

// ---- (c) Retention.

TEST(CheckpointTest, KeepLastKeepsTheNewestComplete) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TempDir root;
  auto t = MakeTrainer(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(t->Step().ok());
    ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  }
  EXPECT_EQ(Entries(root.path()), (std::vector<std::string>{"step_00000002", "step_00000003"}));

  // Leftovers of crashed saves: a newer directory without a MANIFEST, a
  // temporary. Neither counts as a checkpoint; the next save removes both.
  ASSERT_TRUE(CreateDirectories(root.Sub("step_00000099")).ok());
  test_util::WriteTextFile(root.Sub("step_00000004.tmp-1/MANIFEST"), "x");
  auto latest = LatestCheckpoint(root.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, root.Sub("step_00000003"));

  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  EXPECT_EQ(Entries(root.path()), (std::vector<std::string>{"step_00000003", "step_00000004"}));
  latest = LatestCheckpoint(root.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, root.Sub("step_00000004"));

  // Saving the same step again replaces it.
  ASSERT_TRUE(SaveCheckpoint(*t, root.path(), 2).ok());
  EXPECT_EQ(Entries(root.path()), (std::vector<std::string>{"step_00000003", "step_00000004"}));
  auto fresh = MakeTrainer(o);
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(LoadCheckpoint(*fresh, *latest).ok());
  EXPECT_EQ(fresh->step(), 4);
}

}  // namespace
}  // namespace himoe::trainer
