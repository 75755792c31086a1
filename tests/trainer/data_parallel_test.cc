// Data-parallel trainer ranks on c10d (TCPStore, Gloo) on 127.0.0.1: the
// collectives against hand-computed sums, and 2 ranks of batch B against 1
// rank accumulating 2 micro-batches of B (BackendMoE::RouteTraining makes
// the routers' state that rank's).
#include "trainer/data_parallel.h"

#include <cmath>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "router_service/routing/routing_config.h"
#include "tests/trainer/trainer_test_util.h"
#include "trainer/trainer.h"
#include "trainer/trainer_metrics.h"

namespace himoe::trainer {
namespace {

using ::testing::HasSubstr;

// Runs `body(rank, dp)` on `world` threads, each rank joined through a
// TCPStore that rank 0 serves on an ephemeral port; the ranks' statuses.
std::vector<absl::Status> OnRanks(int world,
                                  const std::function<absl::Status(int, DataParallel&)>& body,
                                  const std::vector<std::string>& fingerprints = {},
                                  int lanes = 1) {
  std::promise<int> port;
  std::shared_future<int> port_ready = port.get_future().share();
  std::vector<std::future<absl::Status>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r]() -> absl::Status {
      DataParallelOptions o;
      o.rank = r;
      o.world_size = world;
      o.master_addr = "127.0.0.1";
      o.timeout = std::chrono::seconds(60);
      o.lanes = lanes;
      if (r == 0) {
        o.master_port = 0;
        o.on_listening = [&port](int p) { port.set_value(p); };
      } else {
        o.master_port = port_ready.get();
      }
      absl::StatusOr<std::unique_ptr<DataParallel>> dp =
          DataParallel::Create(o, fingerprints.empty() ? "" : fingerprints[r]);
      if (!dp.ok()) {
        if (r == 0 && port_ready.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
          port.set_value(1);  // release the others; they fail too
        }
        return dp.status();
      }
      return body(r, **dp);
    }));
  }
  std::vector<absl::Status> out;
  for (auto& f : ranks) out.push_back(f.get());
  return out;
}

TEST(DataParallel, CollectivesSumGatherAndBroadcastAcrossRanks) {
  const std::vector<absl::Status> done = OnRanks(3, [](int rank, DataParallel& dp) {
    // Rank r holds r+1 and 10*(r+1): the sums are 1+2+3 = 6 and 60.
    std::vector<at::Tensor> grads = {at::full({2, 3}, rank + 1.0f),
                                     at::full({5}, 10.0f * (rank + 1))};
    EXPECT_TRUE(dp.AllReduceSum(grads, /*bucket_bytes=*/8).ok());
    EXPECT_TRUE(at::equal(grads[0], at::full({2, 3}, 6.0f)));
    EXPECT_TRUE(at::equal(grads[1], at::full({5}, 60.0f)));
    absl::StatusOr<std::vector<at::Tensor>> all = dp.AllGather(at::full({4}, rank * 1.5f), 0);
    EXPECT_TRUE(all.ok()) << all.status();
    if (all.ok()) {
      EXPECT_EQ(all->size(), 3u);
      for (int q = 0; q < 3 && q < static_cast<int>(all->size()); ++q) {
        EXPECT_TRUE(at::equal((*all)[q], at::full({4}, q * 1.5f))) << "rank " << q;
      }
    }
    absl::StatusOr<std::string> word = dp.Broadcast(rank == 0 ? "from rank 0" : "other");
    EXPECT_TRUE(word.ok());
    if (word.ok()) EXPECT_EQ(*word, "from rank 0");
    EXPECT_THAT(std::string(dp.AllGather(at::ones({1}), 1).status().message()),
                HasSubstr("lane 1 of 1"));
    return dp.Barrier();
  });
  for (const absl::Status& s : done) EXPECT_TRUE(s.ok()) << s;
}

TEST(DataParallel, RankWithOtherSettingsIsRefusedNamingIt) {
  const std::vector<absl::Status> done =
      OnRanks(2, [](int, DataParallel&) { return absl::OkStatus(); }, {"batch 4", "batch 8"});
  EXPECT_TRUE(done[0].ok()) << done[0];
  EXPECT_TRUE(absl::IsFailedPrecondition(done[1])) << done[1];
  EXPECT_THAT(std::string(done[1].message()), HasSubstr("rank 1's settings differ from rank 0's"));
}

TEST(DataParallel, StoppedRankFailsTheOthersNamingIt) {
  std::promise<void> rank1_gone;
  std::shared_future<void> gone = rank1_gone.get_future().share();
  absl::Status rank0;
  std::promise<int> port;
  std::thread second([&] {
    DataParallelOptions o;
    o.rank = 1;
    o.world_size = 2;
    o.master_port = port.get_future().get();
    o.timeout = std::chrono::seconds(60);
    auto dp = DataParallel::Create(o);
    EXPECT_TRUE(dp.ok()) << dp.status();
    // Rank 1 leaves the run: its sockets close and its heartbeat stops.
  });
  DataParallelOptions o;
  o.world_size = 2;
  o.master_port = 0;
  o.timeout = std::chrono::seconds(60);
  o.on_listening = [&port](int p) { port.set_value(p); };
  auto dp = DataParallel::Create(o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  second.join();
  std::vector<at::Tensor> grads = {at::ones({16})};
  const absl::Status s = (*dp)->AllReduceSum(grads);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 stopped"));
}

TEST(DataParallel, EveryTrainerSeriesOfARankCarriesItsRank) {
  prometheus::Registry registry;
  TrainerMetrics metrics(registry, /*num_layers=*/2, /*num_groups=*/2, /*num_experts=*/4,
                         {{"rank", "1"}});
  StepResult step;
  step.step = 3;
  metrics.OnStep(step);
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  int series = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    ++series;
    EXPECT_TRUE(absl::StrContains(line, "rank=\"1\"")) << line;
  }
  EXPECT_GT(series, 50);
  EXPECT_TRUE(absl::StrContains(text, "himoe_trainer_step{rank=\"1\"} 3")) << text;
}

// ---- 2 ranks of batch B against 1 rank accumulating 2 micro-batches of B.

const std::string& CorpusPath() {
  static testing::TempDir* const dir = new testing::TempDir("himoe_dp_corpus");
  static const std::string* path = new std::string(testing::WriteCorpus(*dir));
  return *path;
}

TrainerOptions SmallOptions(router::RoutingMethod method) {
  TrainerOptions o;
  o.model.n_layer = 2;
  o.model.n_head = 2;
  o.model.d_model = 32;
  o.model.d_ff = 48;
  o.model.dense_ff = 64;
  o.model.block_size = 16;
  router::RoutingConfig& r = o.model.routing;
  r.method = method;
  r.num_experts = 4;
  r.num_groups = 2;
  r.top_k = 1;
  r.tau = 0.1;
  r.loss_free_rate = 0.05;
  if (method == router::RoutingMethod::kHiMoe) {
    // Every state a training batch moves: the EMA, the balance controller,
    // both dual weights.
    r.target_expert_cv = 0.1;
    r.epsilon_ov = 0.5;
    r.epsilon_sys = 0.3;
  }
  o.model.seed = 3;
  o.data.paths = {CorpusPath()};
  o.data.format = "bytes";
  o.steps = 3;
  o.batch_size = 4;
  o.lr = 3e-3;
  o.warmup_steps = 1;
  o.eval_windows = 4;
  o.seed = 11;
  return o;
}

struct Trained {
  std::map<std::string, at::Tensor> tensors;  // parameters, buffers, expert state
  std::vector<double> losses;
};

absl::StatusOr<Trained> Train(const TrainerOptions& o) {
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o);
  if (!t.ok()) return t.status();
  Trained out;
  for (int64_t s = 0; s < o.steps; ++s) {
    absl::StatusOr<StepResult> r = (*t)->Step();
    if (!r.ok()) return r.status();
    out.losses.push_back(r->loss);
  }
  for (const auto& p : (*t)->model().named_parameters()) out.tensors[p.key()] = p.value().clone();
  for (const auto& b : (*t)->model().named_buffers()) out.tensors[b.key()] = b.value().clone();
  for (int g = 0; g < (*t)->experts().num_groups(); ++g) {
    absl::StatusOr<std::vector<NamedTensor>> state = (*t)->experts().GetState(g);
    if (!state.ok()) return state.status();
    for (auto& [name, tensor] : *state)
      out.tensors["group" + std::to_string(g) + "." + name] = tensor;
  }
  return out;
}

// 2 ranks of `accum` micro-batches against 1 rank of 2 * accum, both with
// the experts `place` says (in process, or on services): the weights, the
// routers' state and the experts' weights and AdamW moments.
void ExpectTwoRanksEqualOne(router::RoutingMethod method, int accum,
                            const std::function<TrainerOptions(TrainerOptions)>& place) {
  TrainerOptions one = place(SmallOptions(method));
  one.grad_accum = 2 * accum;
  absl::StatusOr<Trained> reference = Train(one);
  ASSERT_TRUE(reference.ok()) << reference.status();

  std::vector<Trained> ranks(2);
  const std::vector<absl::Status> done = OnRanks(
      2,
      [&](int rank, DataParallel& dp) {
        TrainerOptions o = place(SmallOptions(method));
        o.grad_accum = accum;
        o.data_parallel = &dp;
        absl::StatusOr<Trained> t = Train(o);
        if (!t.ok()) return t.status();
        ranks[rank] = std::move(t).value();
        return absl::OkStatus();
      },
      {}, /*lanes=*/2);
  for (const absl::Status& s : done) ASSERT_TRUE(s.ok()) << s;

  ASSERT_EQ(ranks[0].losses.size(), reference->losses.size());
  for (size_t s = 0; s < reference->losses.size(); ++s) {
    EXPECT_NEAR(ranks[0].losses[s], reference->losses[s], 1e-5) << "step " << s + 1;
    EXPECT_EQ(ranks[1].losses[s], ranks[0].losses[s]) << "step " << s + 1;
  }
  ASSERT_EQ(ranks[0].tensors.size(), reference->tensors.size());
  int moved = 0;
  for (const auto& [name, want] : reference->tensors) {
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(ranks[r].tensors.count(name)) << name;
      const at::Tensor& got = ranks[r].tensors.at(name);
      ASSERT_EQ(got.sizes(), want.sizes()) << name;
      EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), 0, 1e-4))
          << name << " on rank " << r << ": max difference "
          << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    }
    // Every rank holds the same weights and routing state, bit for bit.
    EXPECT_TRUE(at::equal(ranks[0].tensors.at(name), ranks[1].tensors.at(name))) << name;
    if (name.find("logit_ema") != std::string::npos ||
        name.find("loss_free_bias") != std::string::npos ||
        name.find("lambda_intra") != std::string::npos) {
      moved += want.abs().sum().item<double>() > 0 ? 1 : 0;
    }
  }
  // The routing state the method keeps did move (the check above covers it).
  if (method == router::RoutingMethod::kHiMoe || method == router::RoutingMethod::kLossFree) {
    EXPECT_GT(moved, 0);
  }
}

TrainerOptions InProcess(TrainerOptions o) { return o; }

class TwoRanks : public ::testing::TestWithParam<router::RoutingMethod> {};

TEST_P(TwoRanks, EqualOneRankAccumulatingTheirMicroBatches) {
  ExpectTwoRanksEqualOne(GetParam(), 1, InProcess);
}

TEST(TwoRanksInProcess, WithTwoMicroBatchesEachEqualOneRankOfFour) {
  ExpectTwoRanksEqualOne(router::RoutingMethod::kHiMoe, 2, InProcess);
}

// The ranks share 2 expert-group services over gRPC: rank 0 begins the run
// and steps the groups, which sum each rank's gradients apart and add them
// in rank order.
TEST(TwoRanksSharingGroups, EqualOneRankOnTheSameGroups) {
  const testing::ExpertCluster cluster(SmallOptions(router::RoutingMethod::kHiMoe));
  const auto remote = [&](TrainerOptions o) { return cluster.Remote(std::move(o)); };
  ExpectTwoRanksEqualOne(router::RoutingMethod::kHiMoe, 1, remote);
  // Two micro-batches in flight on each rank, each lane its own collectives.
  ExpectTwoRanksEqualOne(router::RoutingMethod::kHiMoe, 2, remote);
}

INSTANTIATE_TEST_SUITE_P(Methods, TwoRanks,
                         ::testing::Values(router::RoutingMethod::kHiMoe,
                                           router::RoutingMethod::kLossFree,
                                           router::RoutingMethod::kStMoe),
                         [](const auto& info) {
                           return std::string(router::RoutingMethodName(info.param));
                         });

}  // namespace
}  // namespace himoe::trainer
