// The core guarantee: training with the experts on 4 expert-group services
// over real gRPC equals training with them in-process, step by step.
#include "expert_service/expert_client.h"
#include "trainer/trainer.h"

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/torch_runtime.h"
#include "model/model_config.h"
#include "tests/trainer/trainer_test_util.h"
#include "trainer/expert_backend.h"
#include "trainer/training_run.h"

namespace himoe::trainer {
namespace {

constexpr int kGroups = 4;

// The corpus of every test in this process, removed at exit.
const std::string& CorpusPath() {
  static const testing::TempDir dir("himoe_trainer_test_corpus");
  static const std::string path = testing::WriteCorpus(dir);
  return path;
}

TrainerOptions SmallOptions(router::RoutingMethod method) {
  TrainerOptions o;
  o.model.n_layer = 2;
  o.model.n_head = 2;
  o.model.d_model = 32;
  o.model.d_ff = 48;
  o.model.dense_ff = 64;
  o.model.block_size = 16;
  o.model.routing.method = method;
  o.model.routing.num_experts = 8;
  o.model.routing.num_groups = kGroups;
  o.model.routing.top_k = 1;
  o.model.routing.tau = 0.1;
  o.model.seed = 5;
  o.data.paths = {CorpusPath()};
  o.steps = 3;
  o.batch_size = 4;
  o.grad_accum = 2;
  o.lr = 3e-3;
  o.warmup_steps = 1;
  o.grad_clip = 0.05;  // small: clipping is active on every step
  o.eval_windows = 8;
  o.seed = 9;
  return o;
}

using ::testing::HasSubstr;
using testing::ExpertCluster;

std::map<std::string, at::Tensor> AllParameters(Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : t.model().named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : t.model().named_buffers()) out[b.key()] = b.value().detach().clone();
  for (int g = 0; g < t.experts().num_groups(); ++g) {
    auto state = t.experts().GetState(g);
    EXPECT_TRUE(state.ok()) << state.status();
    for (const auto& [name, tensor] : *state) {
      if (name.find("exp_avg") != std::string::npos || name.find(".step") != std::string::npos ||
          name.rfind("optimizer.", 0) == 0) {
        continue;  // optimizer state: compared through the weights it produced
      }
      out["expert_g" + std::to_string(g) + "." + name] = tensor;
    }
  }
  return out;
}

// Every parameter and buffer of `got` (dense and expert) bit for bit `want`'s.
void ExpectSameParameters(Trainer& want, Trainer& got) {
  const auto w = AllParameters(want);
  const auto g = AllParameters(got);
  ASSERT_EQ(w.size(), g.size());
  for (const auto& [name, tensor] : w) {
    ASSERT_TRUE(g.count(name)) << name;
    EXPECT_TRUE(at::equal(g.at(name), tensor)) << name;
  }
}

// Runs `steps` steps of `t`: their losses, fewer after a failed step.
std::vector<double> StepLosses(Trainer& t, int steps) {
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    auto r = t.Step();
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    losses.push_back(r->loss);
  }
  return losses;
}

// `call`, again while a group is still unreachable (the channel
// reconnecting), for up to 5 s.
absl::Status RetryWhileUnreachable(const std::function<absl::Status()>& call) {
  absl::Status s = call();
  for (int i = 0; i < 50 && absl::IsUnavailable(s); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s = call();
  }
  return s;
}

absl::Status RetryWhileUnreachable(Trainer& t) {
  return RetryWhileUnreachable([&] { return t.RetryFailedStep(); });
}

// A method, whether the balance controller runs (target expert CV > 0), and
// the experts chosen per group (k; 2 of 4 per group sends each token once
// for two experts).
struct EquivalenceParam {
  router::RoutingMethod method;
  double target_cv = 0;
  int per_group = 1;
};

// 16 experts in 4 groups, k = 2 per group (K = 8 for flat methods).
void TwoExpertsPerGroup(TrainerOptions& o) {
  o.model.routing.num_experts = 16;
  o.model.routing.top_k = 2;
}

class EquivalenceTest : public ::testing::TestWithParam<EquivalenceParam> {};

TEST_P(EquivalenceTest, RemoteGroupsTrainExactlyLikeInProcess) {
  TrainerOptions local = SmallOptions(GetParam().method);
  local.model.routing.target_expert_cv = GetParam().target_cv;
  if (GetParam().per_group == 2) TwoExpertsPerGroup(local);
  ExpertCluster cluster(local);
  TrainerOptions remote = local;
  remote.remote_experts = true;
  remote.expert_addresses = cluster.addresses();
  auto a = Trainer::Create(local);
  auto b = Trainer::Create(remote);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const auto before = AllParameters(**a);
  for (int step = 0; step < 3; ++step) {
    auto ra = (*a)->Step();
    auto rb = (*b)->Step();
    ASSERT_TRUE(ra.ok()) << ra.status();
    ASSERT_TRUE(rb.ok()) << rb.status();
    EXPECT_NEAR(ra->loss, rb->loss, 1e-4) << "step " << step + 1;
    EXPECT_NEAR(ra->task, rb->task, 1e-4) << "step " << step + 1;
    EXPECT_NEAR(ra->grad_norm, rb->grad_norm, 1e-4 * std::max(1.0, ra->grad_norm));
    EXPECT_GT(ra->grad_norm, local.grad_clip);  // the clip really acted
  }
  const auto pa = AllParameters(**a);
  const auto pb = AllParameters(**b);
  ASSERT_EQ(pa.size(), pb.size());
  int moved = 0;
  for (const auto& [name, ta] : pa) {
    ASSERT_TRUE(pb.count(name)) << name;
    EXPECT_LE((ta - pb.at(name)).abs().max().item<double>(), 1e-4) << name;
    moved += !at::equal(ta, before.at(name));
  }
  EXPECT_GT(moved, static_cast<int>(pa.size()) / 2);  // training changed most tensors
  auto va = (*a)->Evaluate();
  auto vb = (*b)->Evaluate();
  ASSERT_TRUE(va.ok() && vb.ok());
  EXPECT_NEAR(va->loss, vb->loss, 1e-4);
  ASSERT_EQ(va->layers.size(), vb->layers.size());
  for (size_t l = 0; l < va->layers.size(); ++l) {
    EXPECT_EQ(va->layers[l].expert_counts, vb->layers[l].expert_counts) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, EquivalenceTest,
                         ::testing::Values(EquivalenceParam{router::RoutingMethod::kHiMoe},
                                           EquivalenceParam{router::RoutingMethod::kVanilla},
                                           EquivalenceParam{router::RoutingMethod::kLossFree},
                                           EquivalenceParam{router::RoutingMethod::kHiMoe, 0.1},
                                           EquivalenceParam{router::RoutingMethod::kHiMoe, 0, 2},
                                           EquivalenceParam{router::RoutingMethod::kVanilla, 0, 2}),
                         [](const auto& info) {
                           return std::string(router::RoutingMethodName(info.param.method)) +
                                  (info.param.target_cv > 0 ? "_controller" : "") +
                                  (info.param.per_group == 2 ? "_2_per_group" : "");
                         });

// Each token's row crosses the link once per group it is routed to, however
// many of that group's experts it chose: a step moves, each way and for
// Forward and Backward alike, tokens x distinct groups per token x d_model x
// the wire's bytes per element, as the transport counted it. The distinct
// groups per token come from the routers' own statistics.
TEST(RemoteTrainingTest, EachRowCrossesTheLinkOncePerGroup) {
  for (const auto& [method, wire] : {std::pair{router::RoutingMethod::kHiMoe, c10::kFloat},
                                     std::pair{router::RoutingMethod::kVanilla, c10::kBFloat16}}) {
    SCOPED_TRACE(router::RoutingMethodName(method));
    TrainerOptions o = SmallOptions(method);
    TwoExpertsPerGroup(o);
    o.grad_accum = 1;  // the step's statistics are its one micro-batch's
    o.wire_dtype = wire;
    ExpertCluster cluster(o);
    o.remote_experts = true;
    o.expert_addresses = cluster.addresses();
    auto t = Trainer::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int step = 0; step < 2; ++step) {
      auto r = (*t)->Step();
      ASSERT_TRUE(r.ok()) << r.status();
      double rows = 0;  // sum over MoE layers of tokens x distinct groups per token
      double assignments = 0;
      for (const router::RoutingStats& layer : r->layers) {
        rows += layer.tokens * layer.groups_per_token;
        for (const double c : layer.expert_counts) assignments += c;
      }
      ASSERT_EQ(r->layers.size(), 2u);
      const int64_t distinct = std::llround(rows);
      EXPECT_NEAR(rows, distinct, 1e-6);
      // Two experts of a group share many tokens: fewer rows than assignments.
      EXPECT_LT(distinct, assignments);
      const int64_t want = 2 * distinct * o.model.d_model * c10::elementSize(wire);
      ASSERT_EQ(r->traffic.size(), static_cast<size_t>(kGroups));
      int64_t sent = 0, received = 0;
      for (const RowTraffic& g : r->traffic) {
        sent += g.sent;
        received += g.received;
      }
      EXPECT_EQ(sent, want) << "step " << step + 1;
      EXPECT_EQ(received, want) << "step " << step + 1;
      // One Forward call a MoE layer, each waiting at least as long for its
      // slowest group as for the mean one.
      EXPECT_EQ(r->waits.calls, 2);
      EXPECT_GT(r->waits.slowest_seconds, 0);
      EXPECT_GE(r->waits.straggler_seconds, 0);
      EXPECT_LE(r->waits.straggler_seconds, r->waits.slowest_seconds);
    }
  }
}

// Every parameter, buffer and expert weight within 1e-4, and the evaluation.
void ExpectSameWeightsAndEvaluation(Trainer& a, Trainer& b) {
  const auto pa = AllParameters(a);
  const auto pb = AllParameters(b);
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& [name, ta] : pa) {
    ASSERT_TRUE(pb.count(name)) << name;
    EXPECT_LE((ta - pb.at(name)).abs().max().item<double>(), 1e-4) << name;
  }
  auto va = a.Evaluate();
  auto vb = b.Evaluate();
  ASSERT_TRUE(va.ok() && vb.ok());
  EXPECT_NEAR(va->loss, vb->loss, 1e-4);
}

// 3 steps of each: `in_process` and `remote` make the same bf16 roundings
// and stay within 1e-4 (loss, grad norm); bf16 keeps 8 bits, so the rounded
// run stays within a few 2^-8 of the float32 one. Returns the largest loss
// gap between the rounded and the float32 run.
double StepRoundedRunsBesideFloat32(Trainer& in_process, Trainer& remote, Trainer& f32) {
  double largest_gap = 0;
  for (int step = 0; step < 3; ++step) {
    auto ra = in_process.Step();
    auto rb = remote.Step();
    auto rc = f32.Step();
    EXPECT_TRUE(ra.ok() && rb.ok() && rc.ok());
    if (!ra.ok() || !rb.ok() || !rc.ok()) return 0;
    EXPECT_NEAR(ra->loss, rb->loss, 1e-4) << "step " << step + 1;
    EXPECT_NEAR(ra->grad_norm, rb->grad_norm, 1e-4 * std::max(1.0, ra->grad_norm));
    EXPECT_NEAR(rb->loss, rc->loss, 2e-2 * rc->loss) << "step " << step + 1;
    largest_gap = std::max(largest_gap, std::abs(rb->loss - rc->loss));
  }
  return largest_gap;
}

// bf16 on the wire: the remote run rounds the rows, the outputs and both
// gradients at each crossing, and equals the in-process run that makes the
// same roundings (autograd's casts); both leave the float32 run by about
// bf16's precision.
TEST(RemoteTrainingTest, Bf16WireTrainsLikeInProcessWithTheSameRoundings) {
  TrainerOptions f32 = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(f32);
  TrainerOptions local = f32;
  local.wire_dtype = at::kBFloat16;
  const TrainerOptions remote = cluster.Remote(local);
  auto a = Trainer::Create(local);
  auto b = Trainer::Create(remote);
  auto c = Trainer::Create(f32);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(RunConfigFor(remote, 0).training().wire_dtype(), "bfloat16");
  EXPECT_EQ(RunConfigFor(f32, 0).training().wire_dtype(), "float32");
  const double largest_gap = StepRoundedRunsBesideFloat32(**a, **b, **c);
  EXPECT_GT(largest_gap, 0) << "the bf16 wire rounded nothing";
  ExpectSameWeightsAndEvaluation(**a, **b);
}

// bf16 products (--matmul_dtype=bfloat16): the groups' products and the
// coordinator's take bfloat16-rounded operands, so the remote run equals the
// in-process one (1e-4), and both leave the float32 run by about bf16's
// precision. Groups that compute in float32 are refused, naming the field.
TEST(RemoteTrainingTest, Bf16ProductsTrainLikeInProcess) {
  TrainerOptions f32 = SmallOptions(router::RoutingMethod::kHiMoe);
  TrainerOptions local = f32;
  local.model.matmul_dtype = v1::DTYPE_BFLOAT16;
  ExpertCluster cluster(local);
  const TrainerOptions remote = cluster.Remote(local);
  auto a = Trainer::Create(local);
  auto b = Trainer::Create(remote);
  auto c = Trainer::Create(f32);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const double largest_gap = StepRoundedRunsBesideFloat32(**a, **b, **c);
  EXPECT_GT(largest_gap, 1e-6) << "the bf16 products rounded nothing";
  ExpectSameWeightsAndEvaluation(**a, **b);

  ExpertCluster float32_groups(f32);
  auto refused = Trainer::Create(float32_groups.Remote(local));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("matmul_dtype float32"));
  EXPECT_THAT(refused.status().message(), HasSubstr("matmul_dtype bfloat16"));
}

// A NaN weight makes the loss and every gradient NaN: the step fails naming
// them, before either optimizer runs, and a step after the weight is mended
// trains from where the failed one started (the experts' NaN gradients were
// dropped with it).
TEST(TrainerTest, ANonFiniteLossFailsTheStepAndAppliesNothing) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Step().ok());
  const std::string poisoned = "wte.weight";
  at::Tensor embedding;
  for (const auto& p : (*t)->model().named_parameters()) {
    if (p.key() == poisoned) embedding = p.value();
  }
  ASSERT_TRUE(embedding.defined()) << "no parameter " << poisoned;
  const at::Tensor good = embedding.detach().clone();
  {
    at::NoGradGuard no_grad;
    embedding.fill_(std::nan(""));
  }
  const auto before = AllParameters(**t);
  auto failed = (*t)->Step();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(failed.status().message(), HasSubstr("step 2: the loss is nan (task nan"));
  EXPECT_THAT(failed.status().message(), HasSubstr("the gradient norm is nan"));
  EXPECT_THAT(failed.status().message(),
              HasSubstr("no update applied, the weights are those after step 1"));
  EXPECT_EQ((*t)->step(), 1);
  const auto after = AllParameters(**t);
  ASSERT_EQ(before.size(), after.size());
  for (const auto& [name, tensor] : before) {
    if (name == poisoned) continue;  // NaN != NaN
    EXPECT_TRUE(at::equal(tensor, after.at(name))) << name << " changed";
  }
  {
    at::NoGradGuard no_grad;
    embedding.copy_(good);
  }
  auto mended = (*t)->Step();
  ASSERT_TRUE(mended.ok()) << mended.status();
  EXPECT_EQ(mended->step, 2);
  // The same run without the failure: step 1, the failed step's batches
  // drawn and dropped, step 2.
  auto plain = Trainer::Create(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE((*plain)->Step().ok());
  for (int mb = 0; mb < o.grad_accum; ++mb) (*plain)->sampler().Next();
  auto expected = (*plain)->Step();
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(mended->loss, expected->loss);
  EXPECT_EQ(mended->grad_norm, expected->grad_norm);
  const auto want = AllParameters(**plain);
  for (const auto& [name, tensor] : AllParameters(**t)) {
    EXPECT_TRUE(at::equal(tensor, want.at(name)))
        << name << " differs from the run without the failure";
  }
}

// The rows, outputs and gradients through shared memory: the same bits as
// through the gRPC messages, step after step. The regions (one per group,
// named after this process) live as long as the trainer.
TEST(RemoteTrainingTest, SharedMemoryTrainsBitForBitLikeMessages) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster shared_cluster(o, /*shared_memory=*/true);
  ExpertCluster message_cluster(o);
  TrainerOptions shared = shared_cluster.Remote(o);
  shared.shared_memory = true;
  const std::string prefix = absl::StrCat("himoe-", getpid(), "-");
  auto regions = [&prefix] {
    const auto names = ListDirectory("/dev/shm");
    EXPECT_TRUE(names.ok()) << names.status();
    int n = 0;
    for (const std::string& name : names.value_or(std::vector<std::string>{})) {
      n += name.rfind(prefix, 0) == 0;
    }
    return n;
  };
  const int before = regions();
  {
    auto a = Trainer::Create(shared);
    auto b = Trainer::Create(message_cluster.Remote(o));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    for (int step = 0; step < 3; ++step) {
      auto ra = (*a)->Step();
      auto rb = (*b)->Step();
      ASSERT_TRUE(ra.ok()) << ra.status();
      ASSERT_TRUE(rb.ok()) << rb.status();
      EXPECT_EQ(ra->loss, rb->loss) << "step " << step + 1;
      EXPECT_EQ(ra->grad_norm, rb->grad_norm) << "step " << step + 1;
    }
    // A region per group, and one more for each micro-batch in flight at once.
    const int groups = o.model.routing.num_groups;
    EXPECT_GE(regions(), before + groups);
    EXPECT_LE(regions(), before + groups * (*a)->micro_batches_in_flight());
    const auto pa = AllParameters(**a);
    const auto pb = AllParameters(**b);
    ASSERT_EQ(pa.size(), pb.size());
    for (const auto& [name, ta] : pa) {
      ASSERT_TRUE(pb.count(name)) << name;
      EXPECT_TRUE(at::equal(ta, pb.at(name))) << name;
    }
    auto va = (*a)->Evaluate();
    auto vb = (*b)->Evaluate();
    ASSERT_TRUE(va.ok() && vb.ok());
    EXPECT_EQ(va->loss, vb->loss);
  }
  EXPECT_EQ(regions(), before);
}

// Micro-batches at once (one's dense work beside another's expert calls,
// their Backwards sent as they come) train bit for bit like one at a time:
// the routers' state, the groups' gradient sums (grad positions) and the
// dense gradient sum all change in micro-batch order; and like in-process
// training of the same micro-batches, within 1e-4.
TEST(RemoteTrainingTest, MicroBatchesAtOnceTrainBitForBitLikeOneAtATime) {
  for (const EquivalenceParam& method : {EquivalenceParam{router::RoutingMethod::kHiMoe, 0.1},
                                         EquivalenceParam{router::RoutingMethod::kLossFree, 0},
                                         EquivalenceParam{router::RoutingMethod::kHiMoe, 0, 2}}) {
    TrainerOptions o = SmallOptions(method.method);
    o.model.routing.target_expert_cv = method.target_cv;
    if (method.per_group == 2) TwoExpertsPerGroup(o);
    o.grad_accum = 3;
    o.shared_memory = true;
    ExpertCluster cluster(o, /*shared_memory=*/true);
    std::vector<double> losses[3], norms[3];
    std::map<std::string, at::Tensor> params[3];
    double val[3] = {};
    for (int in_flight = 1; in_flight <= 3; ++in_flight) {
      const std::string run =
          absl::StrCat(router::RoutingMethodName(method.method), ", ", in_flight, " in flight");
      o.micro_batches_in_flight = in_flight;
      auto t = Trainer::Create(cluster.Remote(o));
      ASSERT_TRUE(t.ok()) << run << ": " << t.status();
      ASSERT_EQ((*t)->micro_batches_in_flight(), in_flight) << run;
      for (int step = 0; step < 3; ++step) {
        auto r = (*t)->Step();
        ASSERT_TRUE(r.ok()) << run << ": " << r.status();
        losses[in_flight - 1].push_back(r->loss);
        norms[in_flight - 1].push_back(r->grad_norm);
      }
      EXPECT_EQ(*(*t)->experts().PendingSaved(), 0) << run;
      params[in_flight - 1] = AllParameters(**t);
      auto v = (*t)->Evaluate();
      ASSERT_TRUE(v.ok()) << run << ": " << v.status();
      val[in_flight - 1] = v->loss;
    }
    // In process, the same micro-batches: equal within 1e-4.
    auto local = Trainer::Create(o);
    ASSERT_TRUE(local.ok()) << local.status();
    for (int step = 0; step < 3; ++step) {
      auto r = (*local)->Step();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_NEAR(r->loss, losses[2][step], 1e-4) << "in process, step " << step + 1;
      EXPECT_NEAR(r->grad_norm, norms[2][step], 1e-4 * std::max(1.0, r->grad_norm));
    }
    for (const auto& [name, tensor] : AllParameters(**local)) {
      ASSERT_TRUE(params[2].count(name)) << name;
      EXPECT_LE((tensor - params[2].at(name)).abs().max().item<double>(), 1e-4) << name;
    }
    auto v = (*local)->Evaluate();
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_NEAR(v->loss, val[2], 1e-4);
    for (int i = 1; i < 3; ++i) {
      SCOPED_TRACE(absl::StrCat(router::RoutingMethodName(method.method), ", ", i + 1,
                                " in flight against 1"));
      EXPECT_EQ(losses[i], losses[0]);
      EXPECT_EQ(norms[i], norms[0]);
      EXPECT_EQ(val[i], val[0]);
      ASSERT_EQ(params[i].size(), params[0].size());
      for (const auto& [name, tensor] : params[0]) {
        ASSERT_TRUE(params[i].count(name)) << name;
        EXPECT_TRUE(at::equal(tensor, params[i].at(name))) << name;
      }
    }
  }
}

// In process, micro-batches run one at a time (both cores already compute).
TEST(TrainerTest, InProcessMicroBatchesRunOneAtATime) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  o.micro_batches_in_flight = 2;
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->micro_batches_in_flight(), 1);
  o.micro_batches_in_flight = 0;
  const auto bad = Trainer::Create(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("micro_batches_in_flight >= 1"));
}

TEST(RemoteTrainingTest, SharedMemoryToServicesWithoutItFailsNamingTheFlag) {
  const TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  TrainerOptions shared = cluster.Remote(o);
  shared.shared_memory = true;
  auto t = Trainer::Create(shared);
  ASSERT_TRUE(t.ok()) << t.status();
  auto step = (*t)->Step();
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
  EXPECT_THAT(step.status().message(), HasSubstr("--shared_memory"));
}

TEST(RemoteTrainingTest, ABadWireDtypeIsRefused) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  o.wire_dtype = at::kHalf;
  const auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("wire dtype must be float32 or bfloat16, got Half"));
}

TEST(RemoteTrainingTest, AbortedStepFreesSavedStateAndStepIsIdempotent) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  o.remote_experts = true;
  o.expert_addresses = cluster.addresses();
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  // A forward in training mode leaves saved state on the services...
  const at::Tensor x = at::randint(0, 256, {2, 16}, at::kLong);
  auto out = (*t)->model().Forward(x, x, /*step=*/7, 0, /*training=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  auto pending = (*t)->experts().PendingSaved();
  ASSERT_TRUE(pending.ok());
  EXPECT_GT(*pending, 0);
  // ... which the abort of that step frees.
  ASSERT_TRUE((*t)->experts().Abort(7).ok());
  pending = (*t)->experts().PendingSaved();
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(*pending, 0);

  // A full step consumes everything it saved.
  ASSERT_TRUE((*t)->Step().ok());
  EXPECT_EQ(*(*t)->experts().PendingSaved(), 0);
  // Replaying step 1's Step RPC (a retry) changes nothing.
  auto state = (*t)->experts().GetState(0);
  AdamWHyper h;
  h.lr = 0.5;
  ASSERT_TRUE((*t)->experts().Step(1, h, 1.0).ok());
  auto again = (*t)->experts().GetState(0);
  ASSERT_TRUE(state.ok() && again.ok());
  ASSERT_EQ(state->size(), again->size());
  for (size_t i = 0; i < state->size(); ++i) {
    EXPECT_TRUE(at::equal((*state)[i].second, (*again)[i].second)) << (*state)[i].first;
  }
}

// A second training run on services that trained already starts from the
// seed's experts and applies every one of its steps: it trains exactly like
// the first run (before run ids, it kept the old weights and skipped steps
// 1..3 as "already applied", exiting 0).
TEST(RemoteTrainingTest, ASecondRunOnTheSameServicesTrainsLikeTheFirst) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  std::vector<double> losses[2];
  std::map<std::string, at::Tensor> params[2];
  std::string run_ids[2];
  for (int run = 0; run < 2; ++run) {
    auto t = Trainer::Create(cluster.Remote(o));
    ASSERT_TRUE(t.ok()) << t.status();
    run_ids[run] = (*t)->run_id();
    for (int step = 0; step < 3; ++step) {
      auto r = (*t)->Step();
      ASSERT_TRUE(r.ok()) << "run " << run << ": " << r.status();
      losses[run].push_back(r->loss);
    }
    params[run] = AllParameters(**t);
  }
  EXPECT_NE(run_ids[0], run_ids[1]);
  EXPECT_EQ(losses[0], losses[1]);
  ASSERT_EQ(params[0].size(), params[1].size());
  for (const auto& [name, tensor] : params[0]) {
    EXPECT_TRUE(at::equal(tensor, params[1].at(name))) << name;
  }
}

// A trainer stopped mid-step (no Abort) leaves saved Forwards on the groups;
// the next run is not blocked by them (it failed with ALREADY_EXISTS).
TEST(RemoteTrainingTest, AStoppedTrainersSavedStateDoesNotBlockTheNextRun) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  {
    auto stopped = Trainer::Create(cluster.Remote(o));
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    const at::Tensor x = at::randint(0, 256, {4, 16}, at::kLong);
    ASSERT_TRUE((*stopped)->model().Forward(x, x, /*step=*/1, 0, /*training=*/true).ok());
    ASSERT_GT(*(*stopped)->experts().PendingSaved(), 0);
  }
  auto next = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*(*next)->experts().PendingSaved(), 0);
  auto r = (*next)->Step();
  ASSERT_TRUE(r.ok()) << r.status();
}

// Two trainers on one set of services: the one whose run was replaced stops
// with FAILED_PRECONDITION naming both runs, and does not disturb the other.
TEST(RemoteTrainingTest, ATrainerWhoseRunWasReplacedStopsAndLeavesTheNewRunAlone) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  auto old_run = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(old_run.ok()) << old_run.status();
  ASSERT_TRUE((*old_run)->Step().ok());
  auto new_run = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(new_run.ok()) << new_run.status();
  auto r = (*old_run)->Step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr((*old_run)->run_id()));
  EXPECT_THAT(r.status().message(), HasSubstr((*new_run)->run_id()));
  // The new run trains exactly like a run on fresh services.
  ExpertCluster fresh_cluster(o);
  auto fresh = Trainer::Create(fresh_cluster.Remote(o));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (int step = 0; step < 2; ++step) {
    auto a = (*new_run)->Step();
    auto b = (*fresh)->Step();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->loss, b->loss) << "step " << step + 1;
  }
}

// A group that goes away mid-run fails the step as UNAVAILABLE (or
// DEADLINE_EXCEEDED) naming the group, through the autograd bridge; not as
// INTERNAL.
TEST(RemoteTrainingTest, UnreachableGroupFailsTheStepAsUnavailable) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  auto t = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Step().ok());
  cluster.Shutdown(2);
  auto r = (*t)->Step();
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsDeadlineExceeded(r.status()))
      << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("expert group 2"));
  EXPECT_EQ((*t)->step(), 1);
  // The failed step's cleanup freed what the reachable groups saved of it,
  // without waiting for group 2.
  for (int g : {0, 1, 3}) {
    expert::ExpertGroupClientOptions go;
    go.group_id = g;
    go.addresses = {cluster.addresses()[g]};
    auto client = expert::ExpertGroupClient::Create(go);
    ASSERT_TRUE(client.ok());
    auto info = (*client)->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->pending_saved(), 0) << "group " << g;
  }
}

// The uninterrupted run a retried one must equal: 3 steps on 4 remote groups.
class RetriedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto reference = Trainer::Create(reference_cluster_.Remote(options_));
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = std::move(reference).value();
    losses_ = StepLosses(*reference_, 3);
    ASSERT_EQ(losses_.size(), 3u);
  }

  const TrainerOptions options_ = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster reference_cluster_{options_};
  std::unique_ptr<Trainer> reference_;
  std::vector<double> losses_;
};

// A step that fails before it updates anything (a group unreachable in its
// forward pass) runs again in place once every group serves the run with
// the state it had: the run then goes on exactly as the uninterrupted one
// (the batches are drawn again, the routers' state and the groups' saved
// Forwards put back). A group that lost its state (a new process on the
// same address) refuses it, and the step is no longer retryable.
TEST_F(RetriedStepTest, RunsAgainInPlaceWhenEveryGroupKeptItsState) {
  const TrainerOptions& o = options_;

  ExpertCluster cluster(o);
  auto t = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Step().ok());
  EXPECT_FALSE((*t)->failed_step_retryable());
  expert::ExpertGroupClientOptions go;
  go.group_id = 2;
  go.addresses = {cluster.addresses()[2]};
  auto client = expert::ExpertGroupClient::Create(go);
  ASSERT_TRUE(client.ok());
  auto kept = (*client)->GetState(/*include_optimizer=*/true);
  ASSERT_TRUE(kept.ok()) << kept.status();

  // Group 2 back with the run and the state it had (as after a stall, a cut
  // link or reset connections): the failed step runs again in place.
  cluster.Shutdown(2);
  auto failed = (*t)->Step();
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_EQ((*t)->step(), 1);
  ASSERT_TRUE((*t)->failed_step_retryable());
  cluster.Restart(2);
  auto back = expert::ExpertGroupClient::Create(go);
  ASSERT_TRUE(back.ok());
  ASSERT_TRUE((*back)->BeginRun((*t)->run_id()).ok());
  ASSERT_TRUE((*back)->SetState(*kept).ok());
  const absl::Status retried = RetryWhileUnreachable(**t);
  ASSERT_TRUE(retried.ok()) << retried;
  EXPECT_FALSE((*t)->failed_step_retryable());
  for (int step = 1; step < 3; ++step) {
    auto r = (*t)->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->loss, losses_[step]) << "step " << step + 1;
  }
  ExpectSameParameters(*reference_, **t);

  // Group 2 lost for good: its new process serves the seed's weights.
  cluster.Shutdown(2);
  failed = (*t)->Step();
  ASSERT_FALSE(failed.ok());
  ASSERT_TRUE((*t)->failed_step_retryable());
  cluster.Restart(2);
  const absl::Status refused = RetryWhileUnreachable(**t);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr((*t)->run_id()));
  EXPECT_FALSE((*t)->failed_step_retryable());
}

// A group restarted on its run state file (as a killed himoe-expert with
// --run_state_file) serves the run again: the failed step runs again in place
// and the run ends as an uninterrupted one. Restarted on a file older than the
// trainer's last step, it is refused naming both steps.
TEST_F(RetriedStepTest, AGroupRestartedOnItsRunStateFileRunsItAgain) {
  const TrainerOptions& o = options_;

  test_util::TempDir dir("trainer_run_state");
  ExpertCluster cluster(o, /*shared_memory=*/false, dir.path());
  auto t = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Step().ok());
  ASSERT_TRUE(cluster.server(2).FlushRunState().ok());
  auto after_step_1 = ReadFileToString(cluster.run_state_file(2));
  ASSERT_TRUE(after_step_1.ok()) << after_step_1.status();

  cluster.Shutdown(2);
  auto failed = (*t)->Step();
  ASSERT_FALSE(failed.ok());
  ASSERT_TRUE((*t)->failed_step_retryable());
  cluster.Restart(2);  // a new server: only the file is left
  ASSERT_EQ(cluster.server(2).restored_step(), std::optional<uint64_t>(1));
  const absl::Status retried = RetryWhileUnreachable(**t);
  ASSERT_TRUE(retried.ok()) << retried;
  for (int step = 1; step < 3; ++step) {
    auto r = (*t)->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->loss, losses_[step]) << "step " << step + 1;
  }
  ExpectSameParameters(*reference_, **t);

  // Back on the file of step 1 while the trainer is at step 3.
  ASSERT_TRUE(cluster.server(2).FlushRunState().ok());
  cluster.Shutdown(2);
  failed = (*t)->Step();
  ASSERT_FALSE(failed.ok());
  ASSERT_TRUE((*t)->failed_step_retryable());
  ASSERT_TRUE(WriteFileAtomically(cluster.run_state_file(2), *after_step_1).ok());
  cluster.Restart(2);
  ASSERT_EQ(cluster.server(2).restored_step(), std::optional<uint64_t>(1));
  const absl::Status refused = RetryWhileUnreachable(**t);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("expert group 2 last applied step 1"));
  EXPECT_THAT(refused.message(), HasSubstr("last step is 3"));
  EXPECT_FALSE((*t)->failed_step_retryable());
}

// One training Forward of layer 0, step 1 through a remote backend on
// `cluster`: 3 rows to each group's first expert.
void TrainingForward(const TrainerOptions& o, const ExpertCluster& cluster,
                     std::unique_ptr<ExpertBackend>* backend, std::vector<at::Tensor>* out) {
  ExpertBackendOptions bo;
  bo.shape = model::ExpertShapeFor(o.model);
  bo.addresses = cluster.addresses();
  bo.deadline = std::chrono::milliseconds(5000);
  auto created = CreateRemoteBackend(bo);
  ASSERT_TRUE(created.ok()) << created.status();
  *backend = std::move(created).value();
  const int per_group = bo.shape.num_experts() / bo.shape.num_groups();
  std::vector<GroupRows> groups(bo.shape.num_groups());
  for (int g = 0; g < bo.shape.num_groups(); ++g) {
    groups[g].rows = at::randn({3, bo.shape.d_model()}).requires_grad_();
    groups[g].assignment_rows = at::arange(3);
    groups[g].expert_ids = at::full({3}, g * per_group, at::kLong);
    groups[g].weights = at::ones({3}).requires_grad_();
  }
  auto y = (*backend)->Forward(/*layer=*/0, /*step=*/1, /*micro_batch=*/0, groups,
                               /*training=*/true);
  ASSERT_TRUE(y.ok()) << y.status();
  *out = std::move(y).value();
}

// The backward pass of the sum of `out`.
absl::Status BackwardOf(const std::vector<at::Tensor>& out) {
  return CatchTorchErrors([&] {
    at::Tensor loss = at::zeros({});
    for (const at::Tensor& y : out) loss = loss + y.sum();
    loss.backward();
    return absl::OkStatus();
  });
}

// A group lost between Forward and Backward: the error thrown inside the
// autograd engine's backward comes out as UNAVAILABLE naming the group, not
// as an INTERNAL "torch error".
TEST(RemoteTrainingTest, GroupLostBeforeBackwardStaysUnavailable) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  std::unique_ptr<ExpertBackend> backend;
  std::vector<at::Tensor> out;
  ASSERT_NO_FATAL_FAILURE(TrainingForward(o, cluster, &backend, &out));
  cluster.Shutdown(1);
  const absl::Status s = BackwardOf(out);
  EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("expert group 1"));
}

// A group restarted between a step's Forward and its Backward (its new
// process serving the run again) no longer holds the saved Forward: the
// Backward is UNAVAILABLE naming the group, a failure the step recovers from,
// not the group's NOT_FOUND.
TEST(RemoteTrainingTest, ABackwardWhoseForwardTheGroupLostIsUnavailable) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  std::unique_ptr<ExpertBackend> backend;
  std::vector<at::Tensor> out;
  ASSERT_NO_FATAL_FAILURE(TrainingForward(o, cluster, &backend, &out));
  cluster.Restart(1);
  // Every group answers again (the channel to group 1 reconnected).
  const absl::Status back = RetryWhileUnreachable([&] { return backend->CheckLastApplied(0); });
  ASSERT_TRUE(back.ok()) << back;
  const absl::Status s = BackwardOf(out);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("expert group 1"));
  EXPECT_THAT(s.message(), HasSubstr("lost the step's saved Forward"));
}

// A group restarted without a run state file serves no run: the next step's
// calls it refuses are a group failure (UNAVAILABLE naming it), which the
// trainer recovers from a checkpoint, not the end of the run.
TEST(RemoteTrainingTest, AGroupThatLostTheRunIsAGroupFailure) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  auto t = Trainer::Create(cluster.Remote(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Step().ok());
  cluster.Restart(3);
  absl::StatusOr<StepResult> failed = (*t)->Step();
  for (int i = 0; i < 50 && !failed.ok() &&
                  absl::StrContains(failed.status().message(),
                                    "unreachable");
       ++i) {  // the channel reconnecting
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE((*t)->failed_step_retryable());
    failed = (*t)->Step();
  }
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("expert group 3 serves no run"));
  EXPECT_TRUE(IsGroupFailure(failed.status()));
  EXPECT_EQ((*t)->step(), 1);
}

// The Info handshake compares the whole expert shape: services built from
// another seed hold other experts and are refused.
TEST(RemoteTrainingTest, ServicesOfAnotherSeedAreRefused) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  TrainerOptions other = o;
  other.model.seed = o.model.seed + 1;
  ExpertCluster cluster(other);
  auto t = Trainer::Create(cluster.Remote(o));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("seed"));
  EXPECT_THAT(t.status().message(), HasSubstr(cluster.addresses()[0]));
}

// Groups serving a model a router loaded are refused at start, before any
// group begins the run; with take_over_served_experts the run begins there.
TEST(RemoteTrainingTest, GroupsServingARoutersModelAreTakenOverOnlyWhenAsked) {
  TrainerOptions o = SmallOptions(router::RoutingMethod::kHiMoe);
  ExpertCluster cluster(o);
  expert::ExpertGroupClientOptions go;
  go.group_id = 2;
  go.addresses = {cluster.addresses()[2]};
  auto router = expert::ExpertGroupClient::Create(go);
  ASSERT_TRUE(router.ok());
  auto state = (*router)->GetState(false);
  ASSERT_TRUE(state.ok()) << state.status();
  const auto loaded = (*router)->ServeState(*state, 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  auto refused = Trainer::Create(cluster.Remote(o));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr("expert groups 2 (" + cluster.addresses()[2] + ", weights " + *loaded));
  EXPECT_THAT(refused.status().message(), HasSubstr("--take_over_served_experts"));
  for (int g = 0; g < o.model.routing.num_groups; ++g) {
    go.group_id = g;
    go.addresses = {cluster.addresses()[g]};
    auto client = expert::ExpertGroupClient::Create(go);
    ASSERT_TRUE(client.ok());
    EXPECT_EQ((*client)->Info()->run_id(), "") << "group " << g << " began a run";
  }
  EXPECT_TRUE((*router)->Info()->served());

  TrainerOptions take_over = cluster.Remote(o);
  take_over.take_over_served_experts = true;
  auto t = Trainer::Create(take_over);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*router)->Info()->served());
  EXPECT_EQ((*router)->Info()->run_id(), (*t)->run_id());
}

}  // namespace
}  // namespace himoe::trainer
