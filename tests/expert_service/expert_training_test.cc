// The training half of the expert service: ExpertOptimizer, save-for-backward
// Forward, Backward, Step, Abort, the saved-state TTL and the optimizer state,
// in process and over gRPC, against local autograd and torch::optim::AdamW.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <openssl/sha.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/shared_memory.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_grpc_service.h"
#include "expert_service/expert_optimizer.h"
#include "expert_service/expert_rows.h"
#include "expert_service/expert_service_core.h"
#include "expert_service/run_state_file.h"
#include "expert_service/state_stream.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "tests/expert_service/expert_test_util.h"
#include "tests/temp_dir.h"

// Its own namespace: expert_service_test.cc, built with it, has helpers of
// the same names for another shape.
namespace himoe::expert::training_test {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using testing::Decode;
using testing::Encode;
using testing::GroupLike;
using testing::MakeShape;
using testing::MaxAbsDiff;
using testing::SumOrderTolerance;

constexpr int kGroup = 1;
constexpr int kNumGroups = 4;
constexpr int kNumExperts = 8;  // experts 2 and 3 are served
constexpr int kLayers = 2;
constexpr int64_t kD = 8;
constexpr int64_t kDff = 16;
constexpr uint64_t kSeed = 42;

using Inputs = std::vector<std::pair<int, at::Tensor>>;  // (expert id, rows)

ExpertServiceOptions CoreOptions(absl::Duration ttl = absl::Seconds(300)) {
  ExpertServiceOptions o;
  o.shape = MakeShape(kNumExperts, kNumGroups, kLayers, kD, kDff, kSeed);
  o.group_id = kGroup;
  o.saved_state_ttl = ttl;
  return o;
}

std::unique_ptr<ExpertServiceCore> MakeCore(absl::Duration ttl = absl::Seconds(300)) {
  auto core = ExpertServiceCore::Create(CoreOptions(ttl));
  EXPECT_TRUE(core.ok()) << core.status();
  return core.ok() ? std::move(*core) : nullptr;
}

// The same experts as the service's layer `layer`.
std::unique_ptr<ExpertGroup> LocalGroup(int layer) { return GroupLike(CoreOptions(), layer); }

struct Key {
  Key(uint64_t step = 1, uint32_t micro_batch = 0, int layer = 1, uint64_t request_id = 0,
      std::string run_id = "")
      : step(step),
        micro_batch(micro_batch),
        layer(layer),
        request_id(request_id),
        run_id(std::move(run_id)) {}
  uint64_t step;
  uint32_t micro_batch;
  int layer;
  uint64_t request_id;
  std::string run_id;
};

v1::ExpertForwardRequest ForwardRequest(const Key& key, const Inputs& inputs,
                                        bool save = true) {
  v1::ExpertForwardRequest r;
  r.set_layer(key.layer);
  r.set_step(key.step);
  r.set_micro_batch(key.micro_batch);
  r.set_request_id(key.request_id);
  r.set_save_for_backward(save);
  r.set_run_id(key.run_id);
  for (const auto& [expert, rows] : inputs) {
    v1::ExpertRows* in = r.add_inputs();
    in->set_expert_id(expert);
    *in->mutable_rows() = Encode(rows);
  }
  return r;
}

v1::ExpertBackwardRequest BackwardRequest(const Key& key, const Inputs& inputs,
                                          const std::vector<at::Tensor>& grads) {
  v1::ExpertBackwardRequest r;
  r.set_layer(key.layer);
  r.set_step(key.step);
  r.set_micro_batch(key.micro_batch);
  r.set_request_id(key.request_id);
  r.set_run_id(key.run_id);
  for (size_t i = 0; i < inputs.size(); ++i) {
    v1::ExpertRows* g = r.add_output_grads();
    g->set_expert_id(inputs[i].first);
    *g->mutable_rows() = Encode(grads[i]);
  }
  return r;
}

Inputs RandomInputs(const std::vector<std::pair<int, int64_t>>& shape) {
  Inputs inputs;
  for (const auto& [expert, n] : shape) inputs.emplace_back(expert, at::randn({n, kD}));
  return inputs;
}

std::vector<at::Tensor> RandomGrads(const Inputs& inputs) {
  std::vector<at::Tensor> grads;
  for (const auto& [expert, rows] : inputs) grads.push_back(at::randn({rows.size(0), kD}));
  return grads;
}

// Forward with save_for_backward then Backward on the core; the input grads.
std::vector<at::Tensor> CoreForwardBackward(ExpertServiceCore* core, const Key& key,
                                            const Inputs& inputs,
                                            const std::vector<at::Tensor>& grads) {
  v1::ExpertForwardResponse forward;
  const absl::Status f = core->Forward(ForwardRequest(key, inputs), &forward);
  EXPECT_TRUE(f.ok()) << f;
  v1::ExpertBackwardResponse backward;
  const absl::Status b = core->Backward(BackwardRequest(key, inputs, grads), &backward);
  EXPECT_TRUE(b.ok()) << b;
  std::vector<at::Tensor> out;
  for (const v1::ExpertRows& g : backward.input_grads()) out.push_back(Decode(g.rows()));
  return out;
}

// The oracle: one leaf and one Forward per input on a local group, autograd.
std::vector<at::Tensor> LocalForwardBackward(const ExpertGroup& group, const Inputs& inputs,
                                             const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor x = inputs[i].second.clone().requires_grad_(true);
    auto y = group.Forward(x, at::full({x.size(0)}, inputs[i].first, at::kLong));
    EXPECT_TRUE(y.ok()) << y.status();
    if (x.size(0) == 0) {
      out.push_back(at::zeros_like(x));
      continue;
    }
    torch::autograd::backward({*y}, {grads[i]});
    out.push_back(x.grad());
  }
  return out;
}

double LocalGradNormSquared(const std::vector<const ExpertGroup*>& groups) {
  double sum = 0;
  for (const ExpertGroup* g : groups) {
    for (const at::Tensor& p : g->parameters()) {
      if (p.grad().defined()) sum += p.grad().to(at::kDouble).square().sum().item<double>();
    }
  }
  return sum;
}

double CoreGradNormSquared(ExpertServiceCore* core) {
  v1::ExpertStepRequest request;
  request.set_norm_only(true);
  v1::ExpertStepResponse response;
  EXPECT_TRUE(core->Step(request, &response).ok());
  EXPECT_FALSE(response.applied());
  return response.grad_norm_squared();
}

v1::ExpertStepRequest StepRequest(uint64_t step, double grad_scale = 1.0) {
  v1::ExpertStepRequest r;
  r.set_step(step);
  r.set_learning_rate(1e-2);
  r.set_grad_scale(grad_scale);
  r.set_weight_decay(0.1);
  r.set_beta1(0.8);
  r.set_beta2(0.95);
  r.set_eps(1e-6);
  return r;
}

// The local AdamW equivalent of StepRequest: w1/w2 decayed, b1/b2 not.
std::unique_ptr<torch::optim::AdamW> LocalAdamW(const std::vector<ExpertGroup*>& groups) {
  using torch::optim::AdamWOptions;
  std::vector<at::Tensor> decayed, plain;
  for (ExpertGroup* g : groups) {
    for (const auto& [name, p] : g->named_parameters()) {
      (name == "w1" || name == "w2" ? decayed : plain).push_back(p);
    }
  }
  const AdamWOptions o =
      AdamWOptions(1e-2).betas(std::make_tuple(0.8, 0.95)).eps(1e-6).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  param_groups.emplace_back(decayed, std::make_unique<AdamWOptions>(o));
  param_groups.emplace_back(plain,
                            std::make_unique<AdamWOptions>(AdamWOptions(o).weight_decay(0)));
  return std::make_unique<torch::optim::AdamW>(std::move(param_groups));
}

std::vector<NamedTensor> Weights(const ExpertServiceCore& core) {
  auto state = core.GetState();
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? *state : std::vector<NamedTensor>();
}

bool SameWeights(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !at::equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

// --- ExpertOptimizer ------------------------------------------------------------

TEST(ExpertOptimizerTest, WeightDecayOnlyOnW1AndW2) {
  auto group = LocalGroup(0);
  auto opt = ExpertOptimizer::Create({group.get()});
  ASSERT_TRUE(opt.ok()) << opt.status();
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : group->parameters()) {
    before.push_back(p.detach().clone());
    p.mutable_grad() = at::zeros_like(p);
  }
  StepOptions o;
  o.step = 1;
  o.lr = 0.1;
  o.weight_decay = 0.5;
  auto result = (*opt)->Step(o);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->applied);
  EXPECT_EQ(result->last_applied_step, 1u);
  EXPECT_EQ(result->grad_norm_squared, 0.0);
  const auto params = group->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(params[i].first);
    const at::Tensor& now = params[i].second;
    if (params[i].first == "b1" || params[i].first == "b2") {
      EXPECT_TRUE(at::equal(now, before[i]));
    } else {
      EXPECT_FALSE(at::equal(now, before[i]));
      EXPECT_LE(MaxAbsDiff(now, before[i] - 0.1 * 0.5 * before[i]), 1e-7);
    }
  }
  // State for every parameter: it had a (zero) grad.
  const auto state = (*opt)->State();
  ASSERT_EQ(state.size(), 4u * 3 + 1);
  EXPECT_EQ(state[0].first, "layer0.w1.exp_avg");
  EXPECT_EQ(state[2].first, "layer0.w1.step");
  EXPECT_EQ(state[2].second.item<int64_t>(), 1);
  EXPECT_EQ(state.back().first, "optimizer.last_applied_step");
  EXPECT_EQ(state.back().second.item<int64_t>(), 1);
}

// Odd widths (d 3, d_ff 5): every tensor ends in elements the 4-wide loop
// leaves to the scalar one. Three steps against torch::optim::AdamW, with a
// clip scale and weight decay on w1, w2.
TEST(ExpertOptimizerTest, OddSizesMatchTorchAdamW) {
  ExpertServiceOptions odd = CoreOptions();
  odd.shape = MakeShape(kNumExperts, kNumGroups, kLayers, 3, 5, kSeed);
  auto group = GroupLike(odd, 0);
  auto reference = GroupLike(odd, 0);
  auto opt = ExpertOptimizer::Create({group.get()});
  ASSERT_TRUE(opt.ok()) << opt.status();
  auto adamw = LocalAdamW({reference.get()});
  torch::manual_seed(11);
  for (uint64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(step);
    const double scale = 0.7;
    const auto params = group->parameters(), want = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_NE(params[i].numel() % 4, 0);
      const at::Tensor g = torch::randn_like(params[i]);
      params[i].mutable_grad() = g.clone();
      want[i].mutable_grad() = g * scale;
    }
    StepOptions o;
    o.step = step;
    o.lr = 1e-2;
    o.grad_scale = scale;
    o.weight_decay = 0.1;
    o.beta1 = 0.8;
    o.beta2 = 0.95;
    o.eps = 1e-6;
    ASSERT_TRUE((*opt)->Step(o).ok());
    adamw->step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(MaxAbsDiff(params[i].detach(), want[i].detach()), 1e-6) << i;
      EXPECT_TRUE(params[i].grad().eq(0).all().item<bool>()) << i;
    }
  }
}

TEST(ExpertOptimizerTest, RejectsBadOptionsNamingTheField) {
  auto group = LocalGroup(0);
  auto opt = ExpertOptimizer::Create({group.get()});
  ASSERT_TRUE(opt.ok());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const struct {
    std::function<void(StepOptions*)> mutate;
    std::string field;
  } cases[] = {
      {[](StepOptions* o) { o->lr = -1; }, "learning_rate: -1"},
      {[&](StepOptions* o) { o->grad_scale = nan; }, "grad_scale: nan"},
      {[](StepOptions* o) { o->grad_scale = -0.5; }, "grad_scale: -0.5"},
      {[](StepOptions* o) { o->weight_decay = -1; }, "weight_decay: -1"},
      {[](StepOptions* o) { o->beta1 = 1; }, "beta1: 1; expected in [0, 1)"},
      {[](StepOptions* o) { o->beta2 = -0.1; }, "beta2: -0.1"},
      {[](StepOptions* o) { o->eps = 0; }, "eps: 0; expected finite > 0"},
  };
  for (const auto& c : cases) {
    StepOptions o;
    o.step = 1;
    c.mutate(&o);
    const auto result = (*opt)->Step(o);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(c.field));
  }
  EXPECT_EQ((*opt)->last_applied_step(), 0u);
  EXPECT_EQ(ExpertOptimizer::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ExpertOptimizer::Create({group.get(), group.get()}).status().message()),
              HasSubstr("layer 0 appears twice"));
}

TEST(ExpertOptimizerTest, StepIsIdempotentPerStepId) {
  auto group = LocalGroup(1);
  auto opt = ExpertOptimizer::Create({group.get()});
  ASSERT_TRUE(opt.ok());
  const auto set_grads = [&] {
    for (const at::Tensor& p : group->parameters()) p.mutable_grad() = at::randn_like(p);
  };
  const auto snapshot = [&] {
    std::vector<at::Tensor> w;
    for (const at::Tensor& p : group->parameters()) w.push_back(p.detach().clone());
    return w;
  };
  const auto equal = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (!at::equal(a[i], b[i])) return false;
    }
    return true;
  };
  set_grads();
  StepOptions o;
  o.step = 3;
  auto first = (*opt)->Step(o);
  ASSERT_TRUE(first.ok() && first->applied);
  EXPECT_EQ((*opt)->GradNormSquared(), 0.0);  // zeroed
  const auto after_first = snapshot();
  set_grads();
  const double pending = (*opt)->GradNormSquared();
  for (const uint64_t step : {3, 2, 0}) {
    o.step = step;
    auto again = (*opt)->Step(o);
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->applied) << step;
    EXPECT_EQ(again->last_applied_step, 3u);
    EXPECT_TRUE(equal(snapshot(), after_first)) << step;
    EXPECT_EQ((*opt)->GradNormSquared(), pending) << "grads must be left alone";
  }
  o.step = 4;
  auto next = (*opt)->Step(o);
  ASSERT_TRUE(next.ok() && next->applied);
  EXPECT_EQ(next->grad_norm_squared, pending);
  EXPECT_FALSE(equal(snapshot(), after_first));
}

TEST(ExpertOptimizerTest, StateRoundTripsAndBadStateIsRefused) {
  auto g0 = LocalGroup(0), g1 = LocalGroup(1);
  auto opt = ExpertOptimizer::Create({g0.get(), g1.get()});
  ASSERT_TRUE(opt.ok());
  // Only layer 1 gets grads: layer 0 has no optimizer state.
  for (const at::Tensor& p : g1->parameters()) p.mutable_grad() = at::randn_like(p);
  StepOptions o;
  o.step = 7;
  ASSERT_TRUE((*opt)->Step(o).ok());
  const auto state = (*opt)->State();
  ASSERT_EQ(state.size(), 4u * 3 + 1);
  EXPECT_EQ(state[0].first, "layer1.w1.exp_avg");
  EXPECT_EQ(state[1].first, "layer1.w1.exp_avg_sq");

  auto f0 = LocalGroup(0), f1 = LocalGroup(1);
  auto fresh = ExpertOptimizer::Create({f0.get(), f1.get()});
  ASSERT_TRUE(fresh.ok());
  const auto bad = [&](std::vector<NamedTensor> tensors, const std::string& message) {
    const absl::Status s = (*fresh)->SetState(tensors);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(message));
  };
  bad({{"layer2.w1.exp_avg", at::zeros({2, kDff, kD})}},
      "unknown optimizer tensor name 'layer2.w1.exp_avg'");
  bad({{"layer0.w1.exp_avg", at::zeros({2, kDff, kD + 1})}},
      "state 'layer0.w1.exp_avg': shape [2, 16, 9] does not match the parameter's [2, 16, 8]");
  bad({{"layer0.b1.exp_avg", at::zeros({2, kDff}, at::kBFloat16)}},
      "state 'layer0.b1.exp_avg': dtype BFloat16 does not match");
  bad({{"layer0.b1.step", at::ones({1}, at::kLong)}},
      "state 'layer0.b1.step': expected an int64 scalar, got Long [1]");
  bad({{"optimizer.last_applied_step", at::scalar_tensor(1.0)}},
      "state 'optimizer.last_applied_step': expected an int64 scalar");
  bad({{"layer0.b1.exp_avg", at::zeros({2, kDff})}, {"layer0.b1.step", at::scalar_tensor(1, at::kLong)}},
      "state 'layer0.b1': optimizer state lacks exp_avg_sq");
  bad({state[0], state[0]}, "given twice");
  EXPECT_TRUE((*fresh)->State().size() == 1u) << "a refused SetState applies nothing";
  EXPECT_EQ((*fresh)->last_applied_step(), 0u);

  ASSERT_TRUE((*fresh)->SetState(state).ok());
  EXPECT_EQ((*fresh)->last_applied_step(), 7u);
  const auto restored = (*fresh)->State();
  ASSERT_EQ(restored.size(), state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(restored[i].first, state[i].first);
    EXPECT_TRUE(at::equal(restored[i].second, state[i].second)) << state[i].first;
  }
}

// --- ExpertServiceCore, in process ---------------------------------------------------

TEST(ExpertTrainingCoreTest, BackwardMatchesLocalAutograd) {
  auto core = MakeCore();
  const Key key{/*step=*/1, /*micro_batch=*/0, /*layer=*/1, /*request_id=*/9};
  const Inputs inputs = RandomInputs({{3, 5}, {2, 3}, {3, 0}, {2, 4}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  const std::vector<at::Tensor> got = CoreForwardBackward(core.get(), key, inputs, grads);
  EXPECT_EQ(core->pending_saved(), 0);
  // Backward answered with the rows' gradient; the weight gradients wait.
  EXPECT_EQ(core->pending_weight_grads(), 1);
  for (const at::Tensor& p : core->group(1)->parameters()) EXPECT_FALSE(p.grad().defined());
  ASSERT_TRUE(core->RunPendingWeightGrads().ok());
  EXPECT_EQ(core->pending_weight_grads(), 0);

  const auto local = LocalGroup(1);
  const std::vector<at::Tensor> want = LocalForwardBackward(*local, inputs, grads);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), at::kFloat);
    ASSERT_EQ(got[i].sizes(), want[i].sizes()) << i;
    EXPECT_LE(MaxAbsDiff(got[i], want[i]), SumOrderTolerance(want[i])) << i;
  }
  // Parameter grads, one by one, then the norm the coordinator would see.
  const auto core_params = core->group(1)->named_parameters();
  const auto local_params = local->named_parameters();
  for (size_t i = 0; i < core_params.size(); ++i) {
    ASSERT_TRUE(core_params[i].second.grad().defined()) << core_params[i].first;
    const at::Tensor& want_grad = local_params[i].second.grad();
    EXPECT_LE(MaxAbsDiff(core_params[i].second.grad(), want_grad), SumOrderTolerance(want_grad))
        << core_params[i].first;
  }
  for (const at::Tensor& p : core->group(0)->parameters()) EXPECT_FALSE(p.grad().defined());
  const double want_norm = LocalGradNormSquared({local.get()});
  EXPECT_GT(want_norm, 0);
  EXPECT_NEAR(CoreGradNormSquared(core.get()), want_norm, 1e-6 * want_norm);
}

// A Forward of TokenAssignments: rows 0, 3, 1, 0, 4 of 5 go to experts 2, 2,
// 3, 3, 3 (row 0 to both, row 2 to none).
struct Assigned {
  at::Tensor rows = at::randn({5, kD});
  std::vector<int32_t> row = {0, 3, 1, 0, 4};
  std::vector<int32_t> expert = {2, 2, 3, 3, 3};
  std::vector<float> weight = {0.7f, -0.4f, 1.3f, 0.2f, 0.9f};
};

v1::ExpertForwardRequest TokensRequest(const Key& key, const Assigned& a, bool save = true) {
  v1::ExpertForwardRequest r = ForwardRequest(key, {}, save);
  v1::TokenAssignments* t = r.mutable_tokens();
  *t->mutable_rows() = Encode(a.rows);
  t->mutable_row()->Add(a.row.begin(), a.row.end());
  t->mutable_expert_id()->Add(a.expert.begin(), a.expert.end());
  t->mutable_weight()->Add(a.weight.begin(), a.weight.end());
  return r;
}

// The combined rows against a row-by-row oracle: each assignment its own
// local Forward of one row, summed by hand; the input gradients by autograd
// through that oracle, the weight gradients by the hand formula
// dL/dw_a = <dL/d(combined)[row_a], expert_a(row_a)>.
TEST(ExpertTrainingCoreTest, TokensAreComputedOnceEachAndCombinedPerRow) {
  auto core = MakeCore();
  const Key key{1, 0, 1, 4};
  const Assigned a;
  v1::ExpertForwardResponse forward;
  ASSERT_TRUE(core->Forward(TokensRequest(key, a), &forward).ok());
  EXPECT_EQ(forward.outputs_size(), 0);
  const at::Tensor combined = Decode(forward.combined());
  ASSERT_EQ(combined.sizes(), (std::vector<int64_t>{5, kD}));

  const auto local = LocalGroup(1);
  const at::Tensor x = a.rows.clone().requires_grad_(true);
  std::vector<at::Tensor> per_assignment;
  at::Tensor want = at::zeros({5, kD});
  for (size_t i = 0; i < a.row.size(); ++i) {
    auto y = local->Forward(x.narrow(0, a.row[i], 1), at::full({1}, a.expert[i], at::kLong));
    ASSERT_TRUE(y.ok()) << y.status();
    per_assignment.push_back(*y);
    want = want.index_add(0, at::full({1}, a.row[i], at::kLong), *y * a.weight[i]);
  }
  EXPECT_LE(MaxAbsDiff(combined, want.detach()), SumOrderTolerance(want.detach()));
  EXPECT_EQ(at::count_nonzero(combined[2]).item<int64_t>(), 0);  // row 2: no expert

  const at::Tensor grad = at::randn({5, kD});
  v1::ExpertBackwardRequest request = BackwardRequest(key, {}, {});
  *request.mutable_combined_grad() = Encode(grad);
  v1::ExpertBackwardResponse backward;
  const absl::Status b = core->Backward(request, &backward);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_TRUE(core->RunPendingWeightGrads().ok());
  torch::autograd::backward({want}, {grad});
  const at::Tensor token_grads = Decode(backward.token_grads());
  EXPECT_LE(MaxAbsDiff(token_grads, x.grad()), SumOrderTolerance(x.grad()));
  ASSERT_EQ(backward.weight_grads_size(), 5);
  for (size_t i = 0; i < a.row.size(); ++i) {
    const double hand = (grad[a.row[i]] * per_assignment[i].detach()[0]).sum().item<double>();
    EXPECT_NEAR(backward.weight_grads(i), hand, 1e-5 * std::max(1.0, std::abs(hand))) << i;
  }
  const auto core_params = core->group(1)->named_parameters();
  const auto local_params = local->named_parameters();
  for (size_t i = 0; i < core_params.size(); ++i) {
    const at::Tensor& want_grad = local_params[i].second.grad();
    EXPECT_LE(MaxAbsDiff(core_params[i].second.grad(), want_grad), SumOrderTolerance(want_grad))
        << core_params[i].first;
  }
  // The service counted assignments per expert, once each.
  const ExpertServiceCounters counters = core->counters();
  EXPECT_EQ(counters.tokens_per_layer_expert[1], (std::vector<int64_t>{2, 3}));
}

TEST(ExpertTrainingCoreTest, BadTokenAssignmentsAreRefusedNamingTheField) {
  auto core = MakeCore();
  const Assigned a;
  const struct {
    std::string name;
    std::function<void(v1::ExpertForwardRequest*)> mutate;
    std::string message;
  } cases[] = {
      {"row outside", [](v1::ExpertForwardRequest* r) { r->mutable_tokens()->set_row(1, 5); },
       "tokens.row[1]: 5; expected a row of rows, in [0, 5)"},
      {"expert outside",
       [](v1::ExpertForwardRequest* r) { r->mutable_tokens()->set_expert_id(4, 4); },
       "tokens.expert_id[4]: 4 is outside this group; expected an expert id in [2, 4)"},
      {"descending", [](v1::ExpertForwardRequest* r) { r->mutable_tokens()->set_expert_id(0, 3); },
       "tokens.expert_id[1]: 2 after 3; expected ascending expert ids"},
      {"lengths",
       [](v1::ExpertForwardRequest* r) { r->mutable_tokens()->mutable_weight()->RemoveLast(); },
       "tokens: 5 rows, 5 expert ids, 4 weights; expected one of each per assignment"},
      {"weight",
       [](v1::ExpertForwardRequest* r) {
         r->mutable_tokens()->set_weight(2, std::numeric_limits<float>::infinity());
       },
       "tokens.weight[2]: inf; expected finite"},
      {"shape",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_tokens()->mutable_rows() = Encode(at::randn({5, kD + 1}));
       },
       "tokens.rows: expected shape [n, 8]"},
      {"both forms",
       [](v1::ExpertForwardRequest* r) {
         v1::ExpertRows* in = r->add_inputs();
         in->set_expert_id(2);
         *in->mutable_rows() = Encode(at::randn({1, kD}));
       },
       "inputs: set together with tokens; expected one of them"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    v1::ExpertForwardRequest request = TokensRequest(Key{1, 0, 1, 7}, a);
    c.mutate(&request);
    v1::ExpertForwardResponse response;
    const absl::Status s = core->Forward(request, &response);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_EQ(core->pending_saved(), 0);

  // A Backward in the other form than its Forward; each frees the state.
  v1::ExpertForwardResponse forward;
  ASSERT_TRUE(core->Forward(TokensRequest(Key{1, 0, 1, 8}, a), &forward).ok());
  const Inputs inputs = RandomInputs({{2, 2}});
  v1::ExpertBackwardResponse response;
  absl::Status s =
      core->Backward(BackwardRequest(Key{1, 0, 1, 8}, inputs, RandomGrads(inputs)), &response);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("was of tokens; expected combined_grad [5, 8]"));
  ASSERT_TRUE(core->Forward(ForwardRequest(Key{1, 0, 1, 9}, inputs), &forward).ok());
  v1::ExpertBackwardRequest combined = BackwardRequest(Key{1, 0, 1, 9}, {}, {});
  *combined.mutable_combined_grad() = Encode(at::randn({2, kD}));
  s = core->Backward(combined, &response);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("which was of inputs; expected output_grads"));
  EXPECT_EQ(core->pending_saved(), 0);
}

// The forms the gRPC service calls take the rows' bytes instead of copying
// them (TakeTensor): the request's payloads are empty afterwards, and the
// saved Forward, which held them, still differentiates after the request is
// gone.
TEST(ExpertTrainingCoreTest, TheServedFormsTakeTheRowBytes) {
  auto core = MakeCore();
  const Key key{/*step=*/1, /*micro_batch=*/0, /*layer=*/1, /*request_id=*/4};
  const Inputs inputs = RandomInputs({{3, 16}, {2, 9}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  const auto local = LocalGroup(1);
  const std::vector<at::Tensor> want = LocalForwardBackward(*local, inputs, grads);

  v1::ExpertForwardResponse forward;
  {
    auto request = std::make_unique<v1::ExpertForwardRequest>(ForwardRequest(key, inputs));
    ASSERT_TRUE(core->Forward(request.get(), &forward).ok());
    for (const v1::ExpertRows& in : request->inputs()) EXPECT_TRUE(in.rows().data().empty());
  }
  ASSERT_EQ(forward.outputs_size(), 2);
  for (int i = 0; i < 2; ++i) {
    auto y = local->Forward(inputs[i].second,
                            at::full({inputs[i].second.size(0)}, inputs[i].first, at::kLong));
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_LE(MaxAbsDiff(Decode(forward.outputs(i).rows()), *y), 1e-6) << i;
  }
  v1::ExpertBackwardRequest backward_request = BackwardRequest(key, inputs, grads);
  v1::ExpertBackwardResponse backward;
  ASSERT_TRUE(core->Backward(&backward_request, &backward).ok());
  for (const v1::ExpertRows& g : backward_request.output_grads()) {
    EXPECT_TRUE(g.rows().data().empty());
  }
  ASSERT_EQ(backward.input_grads_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_LE(MaxAbsDiff(Decode(backward.input_grads(i).rows()), want[i]), 1e-6) << i;
  }
}

// Rows in shared memory (Tensor.shared) with an output_slice: the answers
// land in the region, bit for bit the inline path's. The saved Forward
// holds its own copy of the rows: the region written over between Forward
// and Backward (the client's next call) changes no gradient.
TEST(ExpertTrainingCoreTest, SharedMemoryRowsTrainLikeInlineRows) {
  ExpertServiceOptions o = CoreOptions();
  o.shared_memory = true;
  auto shared_core = ExpertServiceCore::Create(o);
  ASSERT_TRUE(shared_core.ok()) << shared_core.status();
  auto inline_core = MakeCore();
  const Key key{/*step=*/1, /*micro_batch=*/0, /*layer=*/1, /*request_id=*/7};
  const Inputs inputs = RandomInputs({{2, 5}, {3, 4}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  auto made = SharedMemoryRegion::Create("test", 1 << 16);
  ASSERT_TRUE(made.ok()) << made.status();
  std::shared_ptr<SharedMemoryRegion> region = std::move(*made);
  OwnSharedMemory own(region);
  // Moves each entry's rows into the region; the answer's slice after them.
  auto to_shared = [&](ExpertRowsList* entries, v1::SharedMemorySlice* output_slice) {
    uint64_t offset = 0;
    for (v1::ExpertRows& e : *entries) {
      const at::Tensor rows = Decode(e.rows());
      ASSERT_TRUE(EncodeTensorShared(rows, *region, offset, e.mutable_rows()).ok());
      EXPECT_TRUE(e.rows().data().empty());
      offset = AlignSharedOffset(offset + rows.nbytes());
    }
    output_slice->set_region(region->name());
    output_slice->set_key(region->key());
    output_slice->set_offset(offset);
    output_slice->set_byte_size(region->size() - offset);
  };
  auto decoded = [&](v1::Tensor proto) {
    EXPECT_TRUE(proto.has_shared());
    auto t = TakeTensor(&proto, "answer", &own);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->clone() : at::Tensor();
  };

  v1::ExpertForwardRequest forward = ForwardRequest(key, inputs);
  to_shared(forward.mutable_inputs(), forward.mutable_output_slice());
  v1::ExpertForwardResponse shared_y, inline_y;
  ASSERT_TRUE((*shared_core)->Forward(&forward, &shared_y).ok());
  ASSERT_TRUE(inline_core->Forward(ForwardRequest(key, inputs), &inline_y).ok());
  ASSERT_EQ(shared_y.outputs_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(
        at::equal(decoded(shared_y.outputs(i).rows()), Decode(inline_y.outputs(i).rows())))
        << i;
  }
  // The next call's bytes (NaN) over the whole region.
  std::memset(*region->Slice(0, region->size(), "all"), 0xff, region->size());

  v1::ExpertBackwardRequest backward = BackwardRequest(key, inputs, grads);
  to_shared(backward.mutable_output_grads(), backward.mutable_output_slice());
  v1::ExpertBackwardResponse shared_dx, inline_dx;
  ASSERT_TRUE((*shared_core)->Backward(&backward, &shared_dx).ok());
  ASSERT_TRUE(inline_core->Backward(BackwardRequest(key, inputs, grads), &inline_dx).ok());
  ASSERT_EQ(shared_dx.input_grads_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(decoded(shared_dx.input_grads(i).rows()),
                          Decode(inline_dx.input_grads(i).rows())))
        << i;
  }
  std::memset(*region->Slice(0, region->size(), "all"), 0xff, region->size());
  ASSERT_TRUE((*shared_core)->RunPendingWeightGrads().ok());
  ASSERT_TRUE(inline_core->RunPendingWeightGrads().ok());
  const auto got = (*shared_core)->group(1)->named_parameters();
  const auto want = inline_core->group(1)->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(want[i].second.grad().defined()) << want[i].first;
    EXPECT_TRUE(at::equal(got[i].second.grad(), want[i].second.grad())) << got[i].first;
  }
  // A slice too small for an answer: that answer comes inline.
  v1::ExpertForwardRequest small = ForwardRequest(Key{2, 0, 0, 8}, inputs, /*save=*/false);
  to_shared(small.mutable_inputs(), small.mutable_output_slice());
  small.mutable_output_slice()->set_byte_size(5 * kD * sizeof(float));  // outputs[0] only
  v1::ExpertForwardResponse mixed;
  ASSERT_TRUE((*shared_core)->Forward(&small, &mixed).ok());
  EXPECT_TRUE(mixed.outputs(0).rows().has_shared());
  EXPECT_FALSE(mixed.outputs(1).rows().has_shared());
  EXPECT_EQ(Decode(mixed.outputs(1).rows()).size(0), 4);
}

// What a shared-memory request may not do; the core answers the next call.
TEST(ExpertTrainingCoreTest, BadSharedMemoryRequestsAreRefusedNamingTheField) {
  auto made = SharedMemoryRegion::Create("test", 4096);
  ASSERT_TRUE(made.ok()) << made.status();
  const Inputs inputs = RandomInputs({{2, 3}});
  auto request = [&](uint64_t offset, const std::string& name) {
    v1::ExpertForwardRequest r = ForwardRequest(Key{1, 0, 0, 1}, inputs, /*save=*/false);
    v1::Tensor* rows = r.mutable_inputs(0)->mutable_rows();
    rows->clear_data();
    rows->mutable_shared()->set_region(name);
    rows->mutable_shared()->set_key((*made)->key());
    rows->mutable_shared()->set_offset(offset);
    rows->mutable_shared()->set_byte_size(3 * kD * sizeof(float));
    return r;
  };
  const std::string name = (*made)->name();
  v1::ExpertForwardResponse response;
  // A service without --shared_memory.
  v1::ExpertForwardRequest r = request(0, name);
  absl::Status s = MakeCore()->Forward(&r, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("inputs[0].rows.shared"));
  EXPECT_THAT(s.message(), HasSubstr("--shared_memory"));

  ExpertServiceOptions o = CoreOptions();
  o.shared_memory = true;
  auto core = ExpertServiceCore::Create(o);
  ASSERT_TRUE(core.ok()) << core.status();
  struct Case {
    v1::ExpertForwardRequest request;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases = {
      {request(0, "/himoe-not-here"), absl::StatusCode::kFailedPrecondition, "on this host"},
      {request(0, "/etc/passwd"), absl::StatusCode::kInvalidArgument,
       "inputs[0].rows.shared.region: '/etc/passwd' is not a himoe shared-memory name"},
      {request(4096 - 64, name), absl::StatusCode::kInvalidArgument, "lie outside region"},
      {request(8, name), absl::StatusCode::kInvalidArgument, "is not a multiple of 64"},
  };
  cases.push_back({request(0, name), absl::StatusCode::kInvalidArgument, "needs 96 and no data"});
  cases.back().request.mutable_inputs(0)->mutable_rows()->mutable_shared()->set_byte_size(64);
  cases.push_back({request(0, name), absl::StatusCode::kInvalidArgument, "output_slice"});
  cases.back().request.mutable_output_slice()->set_region(name);
  cases.back().request.mutable_output_slice()->set_key((*made)->key());
  cases.back().request.mutable_output_slice()->set_offset(128);
  cases.back().request.mutable_output_slice()->set_byte_size(4096);
  for (Case& c : cases) {
    s = (*core)->Forward(&c.request, &response);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  v1::ExpertForwardRequest good = request(0, name);
  std::memset(*(*made)->Slice(0, 96, "rows"), 0, 96);
  ASSERT_TRUE((*core)->Forward(&good, &response).ok());
  EXPECT_EQ(Decode(response.outputs(0).rows()).size(0), 3);
}

// Two clients of one service on one host: the victim's rows for another
// group wait in its region. A caller that names that region, without its key
// or with its own, neither reads the rows nor writes over them; the same
// call naming the caller's own region is served.
TEST(ExpertTrainingCoreTest, AnotherClientsRegionIsNeitherReadNorWritten) {
  ExpertServiceOptions o = CoreOptions();
  o.shared_memory = true;
  auto core = ExpertServiceCore::Create(o);
  ASSERT_TRUE(core.ok()) << core.status();
  auto victim = SharedMemoryRegion::Create("g3", 4096);
  auto mine = SharedMemoryRegion::Create("g1", 4096);
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_TRUE(mine.ok()) << mine.status();
  const Inputs inputs = RandomInputs({{2, 3}});
  const uint64_t row_bytes = 3 * kD * sizeof(float);
  v1::Tensor parked;
  ASSERT_TRUE(EncodeTensorShared(inputs[0].second, **victim, 0, &parked).ok());
  const std::string before(reinterpret_cast<const char*>(*(*victim)->Slice(0, 4096, "all")), 4096);

  // rows_in / out_in: the region the rows / the outputs name; key: the key sent.
  auto call = [&](SharedMemoryRegion& rows_in, SharedMemoryRegion& out_in, const std::string& key) {
    v1::ExpertForwardRequest r = ForwardRequest(Key{1, 0, 1, 9}, inputs, /*save=*/false);
    if (&rows_in == &**mine) {
      EXPECT_TRUE(
          EncodeTensorShared(inputs[0].second, rows_in, 0, r.mutable_inputs(0)->mutable_rows())
              .ok());
    } else {
      v1::SharedMemorySlice* slice = r.mutable_inputs(0)->mutable_rows()->mutable_shared();
      r.mutable_inputs(0)->mutable_rows()->clear_data();
      slice->set_region(rows_in.name());
      slice->set_offset(0);
      slice->set_byte_size(row_bytes);
    }
    r.mutable_inputs(0)->mutable_rows()->mutable_shared()->set_key(key);
    r.mutable_output_slice()->set_region(out_in.name());
    r.mutable_output_slice()->set_key(key);
    r.mutable_output_slice()->set_offset(1024);
    r.mutable_output_slice()->set_byte_size(1024);
    v1::ExpertForwardResponse response;
    const absl::Status s = (*core)->Forward(&r, &response);
    return std::make_pair(s, response);
  };
  const std::string& my_key = (*mine)->key();
  struct Attack {
    SharedMemoryRegion* rows;
    SharedMemoryRegion* out;
    std::string key;
    std::string field;
  };
  const std::vector<Attack> attacks = {
      {victim->get(), mine->get(), "", "inputs[0].rows.shared.key: missing"},
      {victim->get(), mine->get(), my_key, "inputs[0].rows.shared.key: not the key of region"},
      {mine->get(), victim->get(), my_key, "output_slice.key: not the key of region"},
  };
  for (const Attack& a : attacks) {
    const auto [s, response] = call(*a.rows, *a.out, a.key);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr(a.field));
    EXPECT_THAT(s.message(), HasSubstr((*victim)->name()));
    EXPECT_EQ(response.outputs_size(), 0);
  }
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(*(*victim)->Slice(0, 4096, "all")), 4096),
            before);

  // The caller's own region, with its key: served, into its region.
  const auto [s, response] = call(**mine, **mine, my_key);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(response.outputs_size(), 1);
  v1::Tensor out = response.outputs(0).rows();
  EXPECT_EQ(out.shared().region(), (*mine)->name());
  OwnSharedMemory own(std::shared_ptr<SharedMemoryRegion>(std::move(*mine)));
  auto y = TakeTensor(&out, "y", &own);
  ASSERT_TRUE(y.ok()) << y.status();
  auto want = LocalGroup(1)->Forward(inputs[0].second, at::full({3}, 2, at::kLong));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_LE(MaxAbsDiff(*y, *want), 1e-6);
}

TEST(ExpertTrainingCoreTest, Bf16OutputGradsGiveBf16InputGrads) {
  auto core = MakeCore();
  const Key key{1, 0, 0, 0};
  const Inputs inputs = RandomInputs({{2, 3}});
  const std::vector<at::Tensor> grads = {at::randn({3, kD}).to(at::kBFloat16)};
  const std::vector<at::Tensor> got = CoreForwardBackward(core.get(), key, inputs, grads);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].scalar_type(), at::kBFloat16);
  const auto want = LocalForwardBackward(*LocalGroup(0), inputs, {grads[0].to(at::kFloat)});
  EXPECT_LE(MaxAbsDiff(got[0], want[0]), 1e-2 * (1 + want[0].abs().max().item<double>()));
}

// The weight gradients Backward leaves pending sum, over three micro-batches,
// to the bits of a core that computes them inside Backward (each Backward
// runs the earlier one first, a norm-only Step the last); an Abort drops
// what is pending with the grads.
TEST(ExpertTrainingCoreTest, PendingWeightGradsSumAsComputedInBackward) {
  ExpertServiceOptions eager_options = CoreOptions();
  eager_options.defer_weight_grads = false;
  auto eager = ExpertServiceCore::Create(eager_options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  auto deferred = MakeCore();
  for (uint32_t mb = 0; mb < 3; ++mb) {
    SCOPED_TRACE(mb);
    const Inputs inputs = RandomInputs({{3, 40 + mb}, {2, 33}});
    const std::vector<at::Tensor> grads = RandomGrads(inputs);
    const auto want = CoreForwardBackward(eager->get(), Key{1, mb, 1, 0}, inputs, grads);
    const auto got = CoreForwardBackward(deferred.get(), Key{1, mb, 1, 0}, inputs, grads);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
    EXPECT_EQ((*eager)->pending_weight_grads(), 0);
    EXPECT_EQ(deferred->pending_weight_grads(), 1);
  }
  EXPECT_EQ(CoreGradNormSquared(deferred.get()), CoreGradNormSquared(eager->get()));
  EXPECT_EQ(deferred->pending_weight_grads(), 0);
  const auto want_params = (*eager)->group(1)->named_parameters();
  const auto got_params = deferred->group(1)->named_parameters();
  for (size_t i = 0; i < got_params.size(); ++i) {
    EXPECT_TRUE(at::equal(got_params[i].second.grad(), want_params[i].second.grad()))
        << got_params[i].first;
  }

  const Inputs inputs = RandomInputs({{2, 20}});
  CoreForwardBackward(deferred.get(), Key{2, 0, 1, 0}, inputs, RandomGrads(inputs));
  EXPECT_EQ(deferred->pending_weight_grads(), 1);
  v1::ExpertAbortRequest abort;
  abort.set_step(2);
  v1::ExpertAbortResponse aborted;
  ASSERT_TRUE(deferred->Abort(abort, &aborted).ok());
  EXPECT_EQ(deferred->pending_weight_grads(), 0);
  EXPECT_EQ(CoreGradNormSquared(deferred.get()), 0.0);
}

// Trainer ranks sharing a run: each rank's gradients are summed apart and
// added in rank order, so the sums do not depend on the order the ranks'
// Backwards come in; calls of another world size or an out-of-range rank are
// refused naming the field.
TEST(ExpertTrainingCoreTest, RanksGradientsAddInRankOrderWhateverTheArrival) {
  struct Call {
    uint32_t rank;
    uint32_t micro_batch;
    Inputs inputs;
    std::vector<at::Tensor> grads;
  };
  std::vector<Call> calls;
  for (uint32_t mb = 0; mb < 4; ++mb) {
    Call c{mb % 2, mb, RandomInputs({{2, 5 + mb}, {3, 7}}), {}};
    c.grads = RandomGrads(c.inputs);
    calls.push_back(std::move(c));
  }
  // One rank sums c0 + c2 + c1 + c3; two ranks (c0 + c2) + (c1 + c3), the
  // same to rounding, and bit for bit whatever order the calls come in.
  const auto run = [&](ExpertServiceCore* core, uint32_t world, const std::vector<int>& order) {
    v1::BeginRunRequest begin;
    begin.set_run_id("ranks");
    begin.set_world_size(world);
    v1::BeginRunResponse begun;
    EXPECT_TRUE(core->BeginRun(begin, &begun).ok());
    for (const int i : order) {
      const Call& c = calls[i];
      v1::ExpertForwardRequest f = ForwardRequest(Key{1, c.micro_batch, 1, 0, "ranks"}, c.inputs);
      f.set_rank(world > 1 ? c.rank : 0);
      f.set_world_size(world);
      v1::ExpertForwardResponse forward;
      const absl::Status fs = core->Forward(f, &forward);
      EXPECT_TRUE(fs.ok()) << fs;
      v1::ExpertBackwardRequest b =
          BackwardRequest(Key{1, c.micro_batch, 1, 0, "ranks"}, c.inputs, c.grads);
      b.set_rank(world > 1 ? c.rank : 0);
      b.set_world_size(world);
      v1::ExpertBackwardResponse backward;
      const absl::Status bs = core->Backward(b, &backward);
      EXPECT_TRUE(bs.ok()) << bs;
    }
    return CoreGradNormSquared(core);
  };
  auto one = MakeCore();
  auto two = MakeCore();
  auto reversed = MakeCore();
  const double one_rank = run(one.get(), 1, {0, 2, 1, 3});
  EXPECT_GT(one_rank, 0);
  const double in_order = run(two.get(), 2, {0, 1, 2, 3});
  EXPECT_NEAR(in_order, one_rank, 1e-5 * one_rank);
  EXPECT_EQ(run(reversed.get(), 2, {3, 1, 2, 0}), in_order);
  const auto one_params = one->group(1)->named_parameters();
  const auto want_params = two->group(1)->named_parameters();
  const auto got_params = reversed->group(1)->named_parameters();
  for (size_t i = 0; i < got_params.size(); ++i) {
    EXPECT_TRUE(at::equal(got_params[i].second.grad(), want_params[i].second.grad()))
        << got_params[i].first;
    EXPECT_LT(MaxAbsDiff(want_params[i].second.grad(), one_params[i].second.grad()), 1e-5)
        << got_params[i].first;
  }

  // Another world size, an out-of-range rank.
  const Inputs inputs = RandomInputs({{2, 3}});
  v1::ExpertForwardRequest f = ForwardRequest(Key{2, 0, 1, 0, "ranks"}, inputs);
  f.set_world_size(3);
  v1::ExpertForwardResponse forward;
  absl::Status s = two->Forward(f, &forward);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("world_size: Forward of step 2 comes from 3 trainer rank(s), but run "
                        "'ranks' on this group was begun for 2"));
  f.set_world_size(2);
  f.set_rank(2);
  s = two->Forward(f, &forward);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank: 2; expected below world_size 2"));
  v1::ExpertStepRequest step = StepRequest(1);
  step.set_run_id("ranks");
  v1::ExpertStepResponse stepped;
  s = two->Step(step, &stepped);  // world_size 0 = 1
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  v1::BeginRunRequest begin;
  begin.set_run_id("huge");
  begin.set_world_size(100000);
  v1::BeginRunResponse begun;
  s = two->BeginRun(begin, &begun);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("world_size: 100000 trainer ranks"));
  EXPECT_EQ(two->Info().run_id, "ranks");
}

// Backwards with grad_position add their weight gradients in position
// order whatever order they come in: bit for bit the sums of the same calls
// arriving in that order (with the weight gradients deferred or computed
// inside Backward), and not those of the arrival order, which round
// differently. A position that never comes stops the Step; one that came
// already is refused; an Abort lets the retry count from 0.
TEST(ExpertTrainingCoreTest, PositionedBackwardsAddInPositionOrderWhateverTheArrival) {
  struct Call {
    Inputs inputs;
    std::vector<at::Tensor> grads;
  };
  std::vector<Call> calls;
  for (uint32_t mb = 0; mb < 4; ++mb) {
    Call c{RandomInputs({{2, 30 + mb}, {3, 20}}), {}};
    c.grads = RandomGrads(c.inputs);
    calls.push_back(std::move(c));
  }
  // Every Forward first (as micro-batches in flight do), then the Backwards
  // in `order`; the input gradients by micro-batch.
  const auto run = [&](ExpertServiceCore* core, const std::vector<uint32_t>& order,
                       bool positioned) {
    for (uint32_t mb = 0; mb < calls.size(); ++mb) {
      v1::ExpertForwardResponse forward;
      const absl::Status f = core->Forward(ForwardRequest(Key{1, mb}, calls[mb].inputs), &forward);
      EXPECT_TRUE(f.ok()) << f;
    }
    std::vector<std::vector<at::Tensor>> input_grads(calls.size());
    for (const uint32_t mb : order) {
      v1::ExpertBackwardRequest b = BackwardRequest(Key{1, mb}, calls[mb].inputs, calls[mb].grads);
      if (positioned) b.mutable_grad_position()->set_value(mb);
      v1::ExpertBackwardResponse backward;
      const absl::Status s = core->Backward(b, &backward);
      EXPECT_TRUE(s.ok()) << s;
      for (const v1::ExpertRows& g : backward.input_grads()) {
        input_grads[mb].push_back(Decode(g.rows()));
      }
    }
    EXPECT_GT(CoreGradNormSquared(core), 0);
    return input_grads;
  };
  const auto grads_of = [](ExpertServiceCore* core) {
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : core->group(1)->named_parameters()) out.push_back(p.grad());
    return out;
  };
  const auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!at::equal(a[i], b[i])) return false;
    }
    return true;
  };
  auto in_order = MakeCore();
  auto positioned = MakeCore();
  auto arrival = MakeCore();
  ExpertServiceOptions eager_options = CoreOptions();
  eager_options.defer_weight_grads = false;
  auto eager = ExpertServiceCore::Create(eager_options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  const std::vector<uint32_t> shuffled = {2, 0, 3, 1};
  const auto want_inputs = run(in_order.get(), {0, 1, 2, 3}, false);
  const auto got_inputs = run(positioned.get(), shuffled, true);
  run(arrival.get(), shuffled, false);
  run(eager->get(), shuffled, true);
  for (size_t mb = 0; mb < calls.size(); ++mb) {
    EXPECT_TRUE(same(got_inputs[mb], want_inputs[mb])) << "input grads of micro-batch " << mb;
  }
  EXPECT_TRUE(same(grads_of(positioned.get()), grads_of(in_order.get())));
  EXPECT_TRUE(same(grads_of(eager->get()), grads_of(in_order.get())));
  // The order matters to the bits here: without positions the sums differ.
  EXPECT_FALSE(same(grads_of(arrival.get()), grads_of(in_order.get())));

  // Positions 0 and 2 of step 1, 1 never sent; then 0 again.
  auto gap = MakeCore();
  for (const uint32_t mb : {0u, 2u, 1u, 5u}) {
    v1::ExpertForwardResponse forward;
    ASSERT_TRUE(gap->Forward(ForwardRequest(Key{1, mb}, calls[mb % 4].inputs), &forward).ok());
  }
  for (const uint32_t mb : {0u, 2u}) {
    v1::ExpertBackwardRequest b = BackwardRequest(Key{1, mb}, calls[mb].inputs, calls[mb].grads);
    b.mutable_grad_position()->set_value(mb);
    v1::ExpertBackwardResponse backward;
    ASSERT_TRUE(gap->Backward(b, &backward).ok());
  }
  v1::ExpertStepRequest norm;
  norm.set_norm_only(true);
  v1::ExpertStepResponse stepped;
  absl::Status s = gap->Step(norm, &stepped);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("layer 1's Backward at grad_position 2 (rank 0) wait for position 1, "
                        "which never came"));
  s = gap->Step(StepRequest(1), &stepped);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  v1::ExpertBackwardRequest again = BackwardRequest(Key{1, 5}, calls[1].inputs, calls[1].grads);
  again.mutable_grad_position()->set_value(0);
  v1::ExpertBackwardResponse backward;
  s = gap->Backward(again, &backward);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("grad_position: 0 of layer 1, rank 0 came already this step; expected 1 "
                        "or later"));
  v1::ExpertAbortRequest abort;
  abort.set_step(1);
  v1::ExpertAbortResponse aborted;
  ASSERT_TRUE(gap->Abort(abort, &aborted).ok());
  EXPECT_EQ(CoreGradNormSquared(gap.get()), 0.0);
  const auto retried = run(gap.get(), shuffled, true);
  for (size_t mb = 0; mb < calls.size(); ++mb) EXPECT_TRUE(same(retried[mb], want_inputs[mb]));
  EXPECT_TRUE(same(grads_of(gap.get()), grads_of(in_order.get())));
}

TEST(ExpertTrainingCoreTest, StepMatchesTorchAdamW) {
  auto core = MakeCore();
  auto l0 = LocalGroup(0), l1 = LocalGroup(1);
  auto adamw = LocalAdamW({l0.get(), l1.get()});
  const std::vector<const ExpertGroup*> local = {l0.get(), l1.get()};
  for (const uint64_t step : {1, 2}) {
    SCOPED_TRACE(step);
    const double scale = step == 1 ? 1.0 : 0.5;
    for (uint32_t mb = 0; mb < 2; ++mb) {
      for (int layer = 0; layer < kLayers; ++layer) {
        const Inputs inputs = RandomInputs({{2, 3 + mb}, {3, 4}});
        CoreForwardBackward(core.get(), Key{step, mb, layer, 0}, inputs, RandomGrads(inputs));
      }
    }
    // The local group gets exactly the core's grads, scaled as the core will.
    ASSERT_TRUE(core->RunPendingWeightGrads().ok());
    double want_norm = 0;
    for (int layer = 0; layer < kLayers; ++layer) {
      const auto core_params = core->group(layer)->parameters();
      const auto local_params = local[layer]->parameters();
      for (size_t i = 0; i < core_params.size(); ++i) {
        const at::Tensor g = core_params[i].grad().clone();
        want_norm += g.to(at::kDouble).square().sum().item<double>();
        local_params[i].mutable_grad() = g.mul_(scale);
      }
    }
    v1::ExpertStepResponse response;
    ASSERT_TRUE(core->Step(StepRequest(step, scale), &response).ok());
    EXPECT_TRUE(response.applied());
    EXPECT_EQ(response.last_applied_step(), step);
    EXPECT_NEAR(response.grad_norm_squared(), want_norm, 1e-9 * want_norm);
    adamw->step();
    adamw->zero_grad();

    const auto weights = Weights(*core);
    ASSERT_EQ(weights.size(), 8u);
    for (int layer = 0; layer < kLayers; ++layer) {
      const auto params = local[layer]->named_parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        const NamedTensor& w = weights[layer * 4 + i];
        EXPECT_EQ(w.first, "layer" + std::to_string(layer) + "." + params[i].first);
        EXPECT_LE(MaxAbsDiff(w.second, params[i].second.detach()), 1e-6) << w.first;
      }
    }
    EXPECT_EQ(CoreGradNormSquared(core.get()), 0.0) << "grads are zeroed after a step";
  }
  EXPECT_EQ(core->Info().last_applied_step, 2u);
}

TEST(ExpertTrainingCoreTest, RepeatedOrOlderStepChangesNothing) {
  auto core = MakeCore();
  const auto backward = [&](uint64_t step) {
    const Inputs inputs = RandomInputs({{2, 4}, {3, 2}});
    CoreForwardBackward(core.get(), Key{step, 0, 1, 0}, inputs, RandomGrads(inputs));
  };
  backward(1);
  v1::ExpertStepResponse r;
  ASSERT_TRUE(core->Step(StepRequest(1), &r).ok());
  ASSERT_TRUE(r.applied());
  const auto after_first = Weights(*core);
  ASSERT_TRUE(core->Step(StepRequest(1), &r).ok());  // a retried RPC
  EXPECT_FALSE(r.applied());
  EXPECT_EQ(r.last_applied_step(), 1u);
  EXPECT_TRUE(SameWeights(Weights(*core), after_first));

  backward(2);
  ASSERT_TRUE(core->Step(StepRequest(2), &r).ok());
  ASSERT_TRUE(r.applied());
  const auto after_second = Weights(*core);
  EXPECT_FALSE(SameWeights(after_second, after_first));
  backward(3);
  const double pending = CoreGradNormSquared(core.get());
  ASSERT_TRUE(core->Step(StepRequest(1, 0.5), &r).ok());  // older id
  EXPECT_FALSE(r.applied());
  EXPECT_EQ(r.last_applied_step(), 2u);
  EXPECT_TRUE(SameWeights(Weights(*core), after_second));
  EXPECT_EQ(CoreGradNormSquared(core.get()), pending);

  v1::ExpertStepRequest bad = StepRequest(3);
  bad.set_eps(0);  // proto default: must be set
  const absl::Status s = core->Step(bad, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("eps: 0"));
  EXPECT_EQ(core->last_applied_step(), 2u);
}

// A new run on a group that trained before starts from the seed's experts,
// with no optimizer state, grads or saved Forwards left, and counts its steps
// from 1: an earlier run's step ids are not mistaken for its own.
TEST(ExpertTrainingCoreTest, BeginRunStartsFromTheSeedAndKeysStepsByRun) {
  auto core = MakeCore();
  const auto seed_weights = Weights(*core);
  const auto train = [&](ExpertServiceCore* c, uint64_t step, const std::string& run) {
    const Inputs inputs = RandomInputs({{2, 4}, {3, 2}});
    CoreForwardBackward(c, Key{step, 0, 1, 0, run}, inputs, RandomGrads(inputs));
    v1::ExpertStepRequest request = StepRequest(step);
    request.set_run_id(run);
    v1::ExpertStepResponse r;
    const absl::Status s = c->Step(request, &r);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(r.applied()) << "step " << step << " of " << run;
  };
  v1::BeginRunRequest begin;
  v1::BeginRunResponse begun;
  begin.set_run_id("run-a");
  ASSERT_TRUE(core->BeginRun(begin, &begun).ok());
  EXPECT_EQ(begun.previous_run_id(), "");
  for (uint64_t step = 1; step <= 3; ++step) train(core.get(), step, "run-a");
  ASSERT_FALSE(SameWeights(Weights(*core), seed_weights));
  // Run a leaves a saved Forward behind (its trainer was stopped mid-step).
  v1::ExpertForwardResponse forward;
  ASSERT_TRUE(
      core->Forward(ForwardRequest(Key{4, 0, 1, 0, "run-a"}, RandomInputs({{2, 3}})), &forward)
          .ok());
  ASSERT_EQ(core->pending_saved(), 1);

  begin.set_run_id("run-b");
  ASSERT_TRUE(core->BeginRun(begin, &begun).ok());
  EXPECT_EQ(begun.previous_run_id(), "run-a");
  EXPECT_EQ(begun.previous_last_applied_step(), 3u);
  EXPECT_EQ(begun.freed(), 1);
  EXPECT_EQ(core->pending_saved(), 0);
  EXPECT_EQ(core->last_applied_step(), 0u);
  EXPECT_EQ(core->Info().run_id, "run-b");
  EXPECT_TRUE(SameWeights(Weights(*core), seed_weights));
  EXPECT_EQ(CoreGradNormSquared(core.get()), 0.0);
  auto optimizer_state = core->GetState(/*include_optimizer=*/true);
  ASSERT_TRUE(optimizer_state.ok());
  EXPECT_EQ(optimizer_state->size(), seed_weights.size() + 1);  // + last_applied_step only

  // Run b's steps 1..3 apply, and reach what a fresh service reaches with the
  // same data.
  auto fresh = MakeCore();
  ASSERT_TRUE(fresh->BeginRun(begin, &begun).ok());
  at::manual_seed(11);
  for (uint64_t step = 1; step <= 3; ++step) train(core.get(), step, "run-b");
  at::manual_seed(11);
  for (uint64_t step = 1; step <= 3; ++step) train(fresh.get(), step, "run-b");
  EXPECT_TRUE(SameWeights(Weights(*core), Weights(*fresh)));

  // A step of another run is refused, naming both runs; nothing changes.
  const auto before = Weights(*core);
  v1::ExpertStepRequest stale = StepRequest(4);
  stale.set_run_id("run-a");
  v1::ExpertStepResponse r;
  const absl::Status s = core->Step(stale, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("run 'run-a'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("serves run 'run-b'"));
  EXPECT_TRUE(SameWeights(Weights(*core), before));
  // So are its Forward with save_for_backward, Backward and Abort; run b's
  // saved Forward and grads stay.
  const Inputs inputs = RandomInputs({{2, 4}});
  ASSERT_TRUE(core->Forward(ForwardRequest(Key{4, 0, 1, 0, "run-b"}, inputs), &forward).ok());
  EXPECT_EQ(core->Forward(ForwardRequest(Key{4, 0, 1, 1, "run-a"}, inputs), &forward).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(core->Forward(ForwardRequest(Key{4, 0, 1, 1, "run-a"}, inputs, /*save=*/false),
                            &forward).ok());  // inference needs no run
  v1::ExpertAbortRequest abort;
  abort.set_step(4);
  abort.set_run_id("run-a");
  v1::ExpertAbortResponse aborted;
  EXPECT_EQ(core->Abort(abort, &aborted).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core->pending_saved(), 1);
  v1::ExpertBackwardResponse backward;
  EXPECT_EQ(core->Backward(BackwardRequest(Key{4, 0, 1, 0, "run-a"}, inputs, RandomGrads(inputs)),
                           &backward).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CoreGradNormSquared(core.get()), 0.0);
  EXPECT_EQ(core->pending_saved(), 1);  // run b's, same key, not consumed
  EXPECT_EQ(CoreForwardBackward(core.get(), Key{5, 0, 1, 0, "run-b"}, inputs,
                                RandomGrads(inputs)).size(), 1u);

  begin.set_run_id("");
  EXPECT_EQ(core->BeginRun(begin, &begun).code(), absl::StatusCode::kInvalidArgument);
  begin.set_run_id(std::string(129, 'x'));
  const absl::Status long_id = core->BeginRun(begin, &begun);
  EXPECT_EQ(long_id.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(long_id.message()), HasSubstr("run_id: 129 bytes; expected 1 to 128"));
  EXPECT_EQ(core->Info().run_id, "run-b");
}

// The oracle of weights_fingerprint's digest: SHA-256 over each parameter's
// name (with its NUL) and bytes, in name order; the first 8 bytes in hex.
std::string HandDigest(std::vector<NamedTensor> weights) {
  std::sort(weights.begin(), weights.end(),
            [](const NamedTensor& a, const NamedTensor& b) { return a.first < b.first; });
  std::string bytes;
  for (const auto& [name, tensor] : weights) {
    bytes.append(name.c_str(), name.size() + 1);
    const at::Tensor t = tensor.contiguous();
    bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  std::string hex;
  for (int i = 0; i < 8; ++i) absl::StrAppend(&hex, absl::Hex(digest[i], absl::kZeroPad2));
  return hex;
}

// The fingerprint names the weights: a digest of them as set last, "+n"
// after n Steps applied. A model a router loaded (served) keeps its weights
// against a BeginRun that does not take it over.
TEST(ExpertTrainingCoreTest, WeightsFingerprintNamesTheWeightsServed) {
  auto trained = MakeCore();
  auto serving = MakeCore();
  const std::string seed = HandDigest(Weights(*trained));
  EXPECT_EQ(trained->Info().weights_fingerprint, seed);
  EXPECT_EQ(serving->Info().weights_fingerprint, seed);  // another process, same weights
  v1::ExpertForwardResponse forward;
  const Inputs inputs = RandomInputs({{2, 3}});
  ASSERT_TRUE(
      trained->Forward(ForwardRequest(Key{1, 0, 1, 0}, inputs, /*save=*/false), &forward).ok());
  EXPECT_EQ(forward.weights_fingerprint(), seed);

  v1::BeginRunRequest begin;
  begin.set_run_id("run");
  v1::BeginRunResponse begun;
  ASSERT_TRUE(trained->BeginRun(begin, &begun).ok());
  for (uint64_t step = 1; step <= 2; ++step) {
    CoreForwardBackward(trained.get(), Key{step, 0, 1, 0, "run"}, inputs, RandomGrads(inputs));
    v1::ExpertStepRequest request = StepRequest(step);
    request.set_run_id("run");
    v1::ExpertStepResponse r;
    ASSERT_TRUE(trained->Step(request, &r).ok());
  }
  EXPECT_EQ(trained->Info().weights_fingerprint, seed + "+2");
  v1::ExpertStepRequest repeated = StepRequest(2);  // not applied again
  repeated.set_run_id("run");
  v1::ExpertStepResponse r;
  ASSERT_TRUE(trained->Step(repeated, &r).ok());
  EXPECT_EQ(trained->Info().weights_fingerprint, seed + "+2");

  // The trained weights, loaded for serving.
  const std::vector<NamedTensor> model = Weights(*trained);
  std::string loaded;
  ASSERT_TRUE(serving->SetState(model, /*served=*/true, &loaded).ok());
  EXPECT_EQ(loaded, HandDigest(model));
  EXPECT_NE(loaded, seed);
  EXPECT_EQ(serving->Info().weights_fingerprint, loaded);
  EXPECT_TRUE(serving->Info().served);
  ASSERT_TRUE(
      serving->Forward(ForwardRequest(Key{1, 0, 1, 0}, inputs, /*save=*/false), &forward).ok());
  EXPECT_EQ(forward.weights_fingerprint(), loaded);

  begin.set_run_id("intruder");
  const absl::Status refused = serving->BeginRun(begin, &begun);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("take_over"));
  EXPECT_TRUE(SameWeights(Weights(*serving), model));
  EXPECT_EQ(serving->Info().weights_fingerprint, loaded);
  EXPECT_EQ(serving->Info().run_id, "");

  begin.set_take_over(true);
  ASSERT_TRUE(serving->BeginRun(begin, &begun).ok());
  EXPECT_EQ(serving->Info().weights_fingerprint, seed);
  EXPECT_FALSE(serving->Info().served);
  EXPECT_EQ(serving->Info().run_id, "intruder");
}

TEST(ExpertTrainingCoreTest, BackwardAfterTheWeightsChangedIsFailedPrecondition) {
  auto core = MakeCore();
  const Inputs inputs = RandomInputs({{2, 2}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  const auto forward = [&](const Key& key) {
    v1::ExpertForwardResponse response;
    ASSERT_TRUE(core->Forward(ForwardRequest(key, inputs), &response).ok());
  };
  const auto expect_stale = [&](const Key& key) {
    v1::ExpertBackwardResponse response;
    const absl::Status s = core->Backward(BackwardRequest(key, inputs, grads), &response);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("the weights changed"));
    EXPECT_EQ(core->pending_saved(), 0);
  };
  forward(Key{2, 0, 1, 0});
  v1::ExpertStepResponse r;
  ASSERT_TRUE(core->Step(StepRequest(1), &r).ok());
  ASSERT_TRUE(r.applied());
  expect_stale(Key{2, 0, 1, 0});

  forward(Key{2, 0, 1, 1});
  ASSERT_TRUE(core->SetState(Weights(*core)).ok());
  expect_stale(Key{2, 0, 1, 1});

  // A step that applies nothing leaves saved Forwards usable.
  forward(Key{2, 0, 1, 2});
  ASSERT_TRUE(core->Step(StepRequest(1), &r).ok());
  ASSERT_FALSE(r.applied());
  EXPECT_EQ(CoreForwardBackward(core.get(), Key{2, 1, 1, 0}, inputs, grads).size(), 1u);
  v1::ExpertBackwardResponse response;
  EXPECT_TRUE(core->Backward(BackwardRequest(Key{2, 0, 1, 2}, inputs, grads), &response).ok());
}

TEST(ExpertTrainingCoreTest, ConcurrentSavedForwardsAccumulateLikeSequential) {
  auto concurrent = MakeCore();
  auto sequential = MakeCore();
  constexpr int kThreads = 4;
  constexpr int kPerThread = 3;
  std::vector<std::vector<Inputs>> inputs(kThreads);
  std::vector<std::vector<std::vector<at::Tensor>>> grads(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int j = 0; j < kPerThread; ++j) {
      inputs[t].push_back(RandomInputs({{2, 3}, {3, 5}}));
      grads[t].push_back(RandomGrads(inputs[t].back()));
    }
  }
  std::vector<std::vector<std::vector<at::Tensor>>> input_grads(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int j = 0; j < kPerThread; ++j) {
        const Key key{1, static_cast<uint32_t>(t), 1, static_cast<uint64_t>(j)};
        input_grads[t].push_back(
            CoreForwardBackward(concurrent.get(), key, inputs[t][j], grads[t][j]));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(concurrent->pending_saved(), 0);
  for (int t = 0; t < kThreads; ++t) {
    for (int j = 0; j < kPerThread; ++j) {
      const Key key{1, static_cast<uint32_t>(t), 1, static_cast<uint64_t>(j)};
      const auto want = CoreForwardBackward(sequential.get(), key, inputs[t][j], grads[t][j]);
      ASSERT_EQ(input_grads[t][j].size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_LE(MaxAbsDiff(input_grads[t][j][i], want[i]), 1e-6) << t << "/" << j << "/" << i;
      }
    }
  }
  const double want = CoreGradNormSquared(sequential.get());
  EXPECT_NEAR(CoreGradNormSquared(concurrent.get()), want, 1e-5 * want);
  v1::ExpertStepResponse r;
  ASSERT_TRUE(concurrent->Step(StepRequest(1), &r).ok());
  ASSERT_TRUE(sequential->Step(StepRequest(1), &r).ok());
  const auto a = Weights(*concurrent), b = Weights(*sequential);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(MaxAbsDiff(a[i].second, b[i].second), 1e-5) << a[i].first;
  }
}

TEST(ExpertTrainingCoreTest, OptimizerStateSurvivesAStateFile) {
  auto source = MakeCore();
  for (const uint64_t step : {1, 2}) {
    const Inputs inputs = RandomInputs({{2, 4}, {3, 3}});
    CoreForwardBackward(source.get(), Key{step, 0, 1, 0}, inputs, RandomGrads(inputs));
    v1::ExpertStepResponse r;
    ASSERT_TRUE(source->Step(StepRequest(step), &r).ok());
  }
  const std::string path = ::testing::TempDir() + "/expert_train_state_" +
                           std::to_string(getpid()) + ".bin";
  ASSERT_TRUE(SaveStateToFile(*source, path, 64, /*include_optimizer=*/true).ok());
  auto target = MakeCore();
  const absl::Status loaded = LoadStateFromFile(path, target.get());
  ASSERT_TRUE(loaded.ok()) << loaded;
  std::remove(path.c_str());
  EXPECT_EQ(target->last_applied_step(), 2u);
  auto a = source->GetState(true), b = target->GetState(true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(SameWeights(*a, *b));
  EXPECT_THAT(
      [&] {
        std::vector<std::string> names;
        for (const auto& [name, t] : *b) names.push_back(name);
        return names;
      }(),
      Contains("layer1.b2.exp_avg_sq"));
}

// --- Over gRPC ------------------------------------------------------------------

class ExpertTrainingGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(absl::Seconds(300)); }
  void TearDown() override { StopServer(); }

  void StartServer(absl::Duration ttl) {
    StopServer();
    ExpertServerOptions options;
    options.core = CoreOptions(ttl);
    options.address = "127.0.0.1:0";
    auto server = ExpertServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::ExpertService::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }
  void StopServer() {
    stub_.reset();
    if (server_ != nullptr) {
      server_->Shutdown(absl::Seconds(5));
      server_->Wait();
      server_.reset();
    }
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return context;
  }
  grpc::Status Forward(const Key& key, const Inputs& inputs) {
    v1::ExpertForwardResponse response;
    return stub_->Forward(Context().get(), ForwardRequest(key, inputs), &response);
  }
  grpc::Status Backward(const v1::ExpertBackwardRequest& request,
                        v1::ExpertBackwardResponse* response) {
    return stub_->Backward(Context().get(), request, response);
  }
  int64_t Abort(uint64_t step) {
    v1::ExpertAbortRequest request;
    request.set_step(step);
    v1::ExpertAbortResponse response;
    const grpc::Status s = stub_->Abort(Context().get(), request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.freed();
  }
  v1::ExpertInfoResponse Info() {
    v1::ExpertInfoResponse info;
    const grpc::Status s = stub_->Info(Context().get(), v1::ExpertInfoRequest(), &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return info;
  }

  std::unique_ptr<ExpertServer> server_;
  std::unique_ptr<v1::ExpertService::Stub> stub_;
};

TEST_F(ExpertTrainingGrpcTest, BackwardAndStepMatchLocal) {
  const Key key{1, 0, 1, 5};
  const Inputs inputs = RandomInputs({{2, 6}, {3, 2}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  ASSERT_TRUE(Forward(key, inputs).ok());
  EXPECT_EQ(Info().pending_saved(), 1);
  v1::ExpertBackwardResponse backward;
  const grpc::Status b = Backward(BackwardRequest(key, inputs, grads), &backward);
  ASSERT_TRUE(b.ok()) << b.error_message();
  const auto local = LocalGroup(1);
  const auto want = LocalForwardBackward(*local, inputs, grads);
  ASSERT_EQ(backward.input_grads_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(backward.input_grads(i).expert_id(), inputs[i].first);
    EXPECT_LE(MaxAbsDiff(Decode(backward.input_grads(i).rows()), want[i]), 1e-6) << i;
  }
  v1::ExpertStepRequest norm_only;
  norm_only.set_norm_only(true);
  v1::ExpertStepResponse step;
  ASSERT_TRUE(stub_->Step(Context().get(), norm_only, &step).ok());
  const double want_norm = LocalGradNormSquared({local.get()});
  EXPECT_NEAR(step.grad_norm_squared(), want_norm, 1e-6 * want_norm);
  EXPECT_FALSE(step.applied());

  ASSERT_TRUE(stub_->Step(Context().get(), StepRequest(1), &step).ok());
  EXPECT_TRUE(step.applied());
  EXPECT_EQ(step.last_applied_step(), 1u);
  EXPECT_NEAR(step.grad_norm_squared(), want_norm, 1e-6 * want_norm);
  const v1::ExpertInfoResponse info = Info();
  EXPECT_EQ(info.last_applied_step(), 1u);
  EXPECT_EQ(info.pending_saved(), 0);

  // A bad Step is INVALID_ARGUMENT over the wire too.
  v1::ExpertStepRequest bad = StepRequest(2);
  bad.set_beta2(1.0);
  const grpc::Status s = stub_->Step(Context().get(), bad, &step);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("beta2"));
}

TEST_F(ExpertTrainingGrpcTest, SavedStatesNeverLeak) {
  const Inputs inputs = RandomInputs({{3, 2}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  EXPECT_EQ(Info().pending_saved(), 0);
  ASSERT_TRUE(Forward(Key{5, 0, 1, 1}, inputs).ok());
  ASSERT_TRUE(Forward(Key{5, 1, 0, 1}, inputs).ok());
  ASSERT_TRUE(Forward(Key{6, 0, 1, 1}, inputs).ok());
  EXPECT_EQ(Info().pending_saved(), 3);

  const grpc::Status dup = Forward(Key{5, 0, 1, 1}, inputs);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(dup.error_message(),
              HasSubstr("(step=5, micro_batch=0, layer=1, request_id=1)"));
  EXPECT_EQ(Info().pending_saved(), 3);

  EXPECT_EQ(Abort(7), 0);
  EXPECT_EQ(Abort(5), 2);
  EXPECT_EQ(Info().pending_saved(), 1);
  v1::ExpertBackwardResponse response;
  grpc::Status s = Backward(BackwardRequest(Key{5, 0, 1, 1}, inputs, grads), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("(step=5, micro_batch=0, layer=1, request_id=1)"));

  // A consumed Backward frees its state; a second one finds nothing.
  s = Backward(BackwardRequest(Key{6, 0, 1, 1}, inputs, grads), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Info().pending_saved(), 0);
  s = Backward(BackwardRequest(Key{6, 0, 1, 1}, inputs, grads), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);

  // Abort(0) drops every step.
  ASSERT_TRUE(Forward(Key{8, 0, 1, 1}, inputs).ok());
  ASSERT_TRUE(Forward(Key{9, 0, 1, 1}, inputs).ok());
  EXPECT_EQ(Abort(0), 2);
  EXPECT_EQ(Info().pending_saved(), 0);
}

TEST_F(ExpertTrainingGrpcTest, BadBackwardIsInvalidArgumentAndFreesTheState) {
  const Inputs inputs = RandomInputs({{2, 3}, {3, 2}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  const struct {
    std::string name;
    std::function<void(v1::ExpertBackwardRequest*)> mutate;
    std::string message;
  } cases[] = {
      {"count", [](v1::ExpertBackwardRequest* r) { r->mutable_output_grads()->RemoveLast(); },
       "output_grads: 1 entries; the saved Forward (step=1, micro_batch=0, layer=1, "
       "request_id=0) has 2 outputs"},
      {"expert id", [](v1::ExpertBackwardRequest* r) { r->mutable_output_grads(1)->set_expert_id(2); },
       "output_grads[1].expert_id: 2; expected 3"},
      {"shape",
       [](v1::ExpertBackwardRequest* r) {
         *r->mutable_output_grads(0)->mutable_rows() = Encode(at::randn({4, kD}));
       },
       "output_grads[0].rows: expected shape [3, 8] (the saved output's), got [4, 8]"},
      {"NaN",
       [](v1::ExpertBackwardRequest* r) {
         at::Tensor g = at::randn({2, kD});
         g[0][0] = std::numeric_limits<float>::quiet_NaN();
         *r->mutable_output_grads(1)->mutable_rows() = Encode(g);
       },
       "output_grads[1].rows contains NaN or Inf"},
      {"integer dtype",
       [](v1::ExpertBackwardRequest* r) {
         *r->mutable_output_grads(0)->mutable_rows() = Encode(at::ones({3, kD}, at::kLong));
       },
       "output_grads[0].rows.dtype: Long is not a floating type"},
  };
  const Key key{1, 0, 1, 0};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_TRUE(Forward(key, inputs).ok());
    v1::ExpertBackwardRequest request = BackwardRequest(key, inputs, grads);
    c.mutate(&request);
    v1::ExpertBackwardResponse response;
    const grpc::Status s = Backward(request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    EXPECT_EQ(Info().pending_saved(), 0);
    EXPECT_EQ(Backward(BackwardRequest(key, inputs, grads), &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // Nothing reached the parameter grads.
  v1::ExpertStepRequest norm_only;
  norm_only.set_norm_only(true);
  v1::ExpertStepResponse step;
  ASSERT_TRUE(stub_->Step(Context().get(), norm_only, &step).ok());
  EXPECT_EQ(step.grad_norm_squared(), 0.0);
}

TEST_F(ExpertTrainingGrpcTest, ExpiredSavedStatesAreDropped) {
  StartServer(absl::ZeroDuration());
  const Inputs inputs = RandomInputs({{2, 2}});
  ASSERT_TRUE(Forward(Key{1, 0, 1, 0}, inputs).ok());
  ASSERT_TRUE(Forward(Key{1, 1, 1, 0}, inputs).ok());  // sweeps the first
  EXPECT_EQ(Info().pending_saved(), 0);
  EXPECT_EQ(server_->core()->counters().saved_expired, 2);
  v1::ExpertBackwardResponse response;
  EXPECT_EQ(Backward(BackwardRequest(Key{1, 0, 1, 0}, inputs, RandomGrads(inputs)), &response)
                .error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ExpertTrainingGrpcTest, OptimizerStateMovesToAFreshService) {
  const auto train_step = [](v1::ExpertService::Stub* stub, uint64_t step,
                             const Inputs& inputs, const std::vector<at::Tensor>& grads) {
    const Key key{step, 0, 1, 0};
    v1::ExpertForwardResponse f;
    ASSERT_TRUE(stub->Forward(Context().get(), ForwardRequest(key, inputs), &f).ok());
    v1::ExpertBackwardResponse b;
    ASSERT_TRUE(stub->Backward(Context().get(), BackwardRequest(key, inputs, grads), &b).ok());
    v1::ExpertStepResponse s;
    ASSERT_TRUE(stub->Step(Context().get(), StepRequest(step, 0.5), &s).ok());
    ASSERT_TRUE(s.applied());
  };
  for (const uint64_t step : {1, 2}) {
    const Inputs inputs = RandomInputs({{2, 3}, {3, 4}});
    train_step(stub_.get(), step, inputs, RandomGrads(inputs));
  }
  // GetState(include_optimizer) over the wire, in small chunks.
  std::vector<v1::StateChunk> chunks;
  {
    auto context = Context();
    v1::GetStateRequest request;
    request.set_include_optimizer(true);
    request.set_chunk_bytes(100);
    auto reader = stub_->GetState(context.get(), request);
    v1::StateChunk chunk;
    while (reader->Read(&chunk)) chunks.push_back(chunk);
    const grpc::Status s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  std::vector<std::string> names;
  for (const auto& c : chunks) {
    if (c.last()) names.push_back(c.name());
  }
  EXPECT_EQ(names.size(), 8u + 4 * 3 + 1);  // layer 0 never had grads
  EXPECT_THAT(names, Contains("layer1.w2.exp_avg"));
  EXPECT_THAT(names, Contains("optimizer.last_applied_step"));

  ExpertServerOptions options;
  options.core = CoreOptions();
  options.address = "127.0.0.1:0";
  auto fresh = ExpertServer::Start(options);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto fresh_stub = v1::ExpertService::NewStub(
      grpc::CreateChannel((*fresh)->address(), grpc::InsecureChannelCredentials()));
  {
    auto context = Context();
    v1::SetStateResponse response;
    auto writer = fresh_stub->SetState(context.get(), &response);
    for (const auto& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.tensors(), static_cast<int>(names.size()));
  }
  v1::ExpertInfoResponse info;
  ASSERT_TRUE(fresh_stub->Info(Context().get(), v1::ExpertInfoRequest(), &info).ok());
  EXPECT_EQ(info.last_applied_step(), 2u);

  const Inputs inputs = RandomInputs({{2, 5}, {3, 1}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  train_step(stub_.get(), 3, inputs, grads);
  train_step(fresh_stub.get(), 3, inputs, grads);
  EXPECT_TRUE(SameWeights(Weights(*server_->core()), Weights(*(*fresh)->core())));
  fresh_stub.reset();
  (*fresh)->Shutdown(absl::Seconds(5));
  (*fresh)->Wait();
}

// --- The run state file ------------------------------------------------------------

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// One step of run `run` through the core: a saved Forward, Backward, Step.
void TrainRunStep(ExpertServiceCore* core, uint64_t step, const std::string& run,
                  const Inputs& inputs, const std::vector<at::Tensor>& grads) {
  CoreForwardBackward(core, Key{step, 0, 1, 0, run}, inputs, grads);
  v1::ExpertStepRequest request = StepRequest(step);
  request.set_run_id(run);
  v1::ExpertStepResponse r;
  const absl::Status s = core->Step(request, &r);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(r.applied());
}

// A service restarted on its run state file serves the run from the step the
// file holds: the weights and AdamW state bit for bit, so that the next step
// equals the one of a service that never stopped.
TEST(ExpertRunStateTest, ARestartedServiceServesTheRunFromItsFile) {
  test_util::TempDir dir("expert_run_state");
  ExpertServerOptions options;
  options.core = CoreOptions();
  options.run_state_file = dir.Sub("group1.run");
  auto server = ExpertServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_FALSE((*server)->restored_step().has_value());
  auto reference = MakeCore();  // never restarted
  v1::BeginRunRequest begin;
  begin.set_run_id("run-r");
  v1::BeginRunResponse begun;
  ASSERT_TRUE((*server)->core()->BeginRun(begin, &begun).ok());
  ASSERT_TRUE(reference->BeginRun(begin, &begun).ok());
  // No file before the first applied Step.
  ASSERT_TRUE((*server)->FlushRunState().ok());
  EXPECT_EQ(KindOf(options.run_state_file), PathKind::kMissing);

  std::string after_step_2;
  for (uint64_t step = 1; step <= 3; ++step) {
    const Inputs inputs = RandomInputs({{2, 4}, {3, 3}});
    const std::vector<at::Tensor> grads = RandomGrads(inputs);
    ASSERT_NO_FATAL_FAILURE(TrainRunStep((*server)->core(), step, "run-r", inputs, grads));
    ASSERT_NO_FATAL_FAILURE(TrainRunStep(reference.get(), step, "run-r", inputs, grads));
    ASSERT_TRUE((*server)->FlushRunState().ok());
    if (step == 2) after_step_2 = ReadBytes(options.run_state_file);
  }
  auto want = reference->GetState(/*include_optimizer=*/true);
  ASSERT_TRUE(want.ok());
  server->reset();  // as a killed process: only the file is left

  auto restarted = ExpertServer::Start(options);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_EQ((*restarted)->restored_step(), std::optional<uint64_t>(3));
  const ExpertServiceInfo info = (*restarted)->core()->Info();
  EXPECT_EQ(info.run_id, "run-r");
  EXPECT_EQ(info.last_applied_step, 3u);
  EXPECT_FALSE(info.served);
  auto got = (*restarted)->core()->GetState(/*include_optimizer=*/true);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(SameWeights(*got, *want));
  // Step 4 depends on the AdamW moments: equal only if they were restored.
  const Inputs inputs = RandomInputs({{2, 5}, {3, 1}});
  const std::vector<at::Tensor> grads = RandomGrads(inputs);
  ASSERT_NO_FATAL_FAILURE(TrainRunStep((*restarted)->core(), 4, "run-r", inputs, grads));
  ASSERT_NO_FATAL_FAILURE(TrainRunStep(reference.get(), 4, "run-r", inputs, grads));
  EXPECT_TRUE(SameWeights(Weights(*(*restarted)->core()), Weights(*reference)));
  // Another run's calls are still refused.
  v1::ExpertAbortRequest abort;
  abort.set_run_id("run-other");
  v1::ExpertAbortResponse aborted;
  EXPECT_EQ((*restarted)->core()->Abort(abort, &aborted).code(),
            absl::StatusCode::kFailedPrecondition);
  restarted->reset();

  // An older file gives the older step: the trainer sees it (CheckLastApplied).
  WriteBytes(options.run_state_file, after_step_2);
  auto older = ExpertServer::Start(options);
  ASSERT_TRUE(older.ok()) << older.status();
  EXPECT_EQ((*older)->restored_step(), std::optional<uint64_t>(2));
  EXPECT_EQ((*older)->core()->last_applied_step(), 2u);
  older->reset();

  // Another group's file, or one cut short, is refused naming the file.
  ExpertServerOptions other = options;
  other.core.group_id = 2;
  auto refused = ExpertServer::Start(other);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("group 1"));
  EXPECT_THAT(refused.status().message(), HasSubstr(options.run_state_file));
  WriteBytes(options.run_state_file, after_step_2.substr(0, after_step_2.size() / 2));
  refused = ExpertServer::Start(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr(options.run_state_file));
}

// Submit never waits for the disk: of snapshots submitted faster than they
// are written, the last one is on disk after Flush.
TEST(ExpertRunStateTest, TheWriterKeepsTheLatestSnapshot) {
  test_util::TempDir dir("expert_run_state");
  auto core = MakeCore();
  auto state = core->GetState(/*include_optimizer=*/true);
  ASSERT_TRUE(state.ok());
  const v1::ExpertShape shape = CoreOptions().shape;
  const std::string path = dir.Sub("writer.run");
  int64_t written = 0;
  {
    RunStateWriter writer(path, shape, kGroup);
    for (uint64_t step = 1; step <= 20; ++step) {
      writer.Submit(RunSnapshot{"run-w", 2, step, *state});
    }
    ASSERT_TRUE(writer.Flush().ok());
    written = writer.written();
    writer.Submit(RunSnapshot{"run-w", 2, 21, *state});
  }  // the destructor writes the one waiting
  EXPECT_GE(written, 1);
  EXPECT_LE(written, 20);
  auto read = ReadRunStateFile(path, shape, kGroup);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->run_id, "run-w");
  EXPECT_EQ((*read)->world_size, 2u);
  EXPECT_EQ((*read)->last_applied_step, 21u);
  EXPECT_TRUE(SameWeights((*read)->state, *state));
  // No file: nothing to restore.
  auto none = ReadRunStateFile(dir.Sub("absent.run"), shape, kGroup);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

}  // namespace
}  // namespace himoe::expert::training_test
