// BackendMoE's grad positions: in training, each micro-batch that sends a
// group rows of a layer gets the next place in that group's order (0, 1,
// ...), in micro-batch order, and a group without rows gets none (-1); the
// order starts again at micro-batch 0 (a step, or its retry), and outside
// training there is none.
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "gtest/gtest.h"
#include "model/model_config.h"
#include "trainer/backend_moe.h"
#include "trainer/expert_backend.h"

namespace himoe::trainer {
namespace {

// An in-process backend that notes each Forward's micro-batch, and per group
// whether it had rows and its grad position.
class RecordingBackend final : public ExpertBackend {
 public:
  struct Call {
    uint32_t micro_batch;
    std::vector<bool> has_rows;
    std::vector<int64_t> positions;
  };
  explicit RecordingBackend(std::unique_ptr<ExpertBackend> inner) : inner_(std::move(inner)) {}

  absl::StatusOr<std::vector<at::Tensor>> Forward(int layer, uint64_t step, uint32_t micro_batch,
                                                  const std::vector<GroupRows>& groups,
                                                  bool training) override {
    Call c{micro_batch, {}, {}};
    for (const GroupRows& g : groups) {
      c.has_rows.push_back(g.rows.defined() && g.rows.size(0) > 0);
      c.positions.push_back(g.grad_position);
    }
    calls[layer].push_back(std::move(c));
    return inner_->Forward(layer, step, micro_batch, groups, training);
  }
  absl::StatusOr<double> GradNormSquared() override { return inner_->GradNormSquared(); }
  absl::Status Step(uint64_t step, const AdamWHyper& hyper, double scale) override {
    return inner_->Step(step, hyper, scale);
  }
  absl::Status Abort(uint64_t step) override { return inner_->Abort(step); }
  void AbortWhereReachable(uint64_t step) override { inner_->AbortWhereReachable(step); }
  absl::Status CheckLastApplied(uint64_t step) override { return inner_->CheckLastApplied(step); }
  absl::StatusOr<std::vector<NamedTensor>> GetState(int group) override {
    return inner_->GetState(group);
  }
  absl::Status SetState(int group, const std::vector<NamedTensor>& state) override {
    return inner_->SetState(group, state);
  }
  absl::StatusOr<int64_t> PendingSaved() override { return inner_->PendingSaved(); }
  int num_groups() const override { return inner_->num_groups(); }

  std::map<int, std::vector<Call>> calls;  // by layer

 private:
  std::unique_ptr<ExpertBackend> inner_;
};

TEST(BackendMoETest, GradPositionsCountEachGroupsMicroBatchesWithRowsInOrder) {
  model::ModelOptions o;
  o.n_layer = 2;
  o.d_model = 16;
  o.vocab_size = 32;
  o.block_size = 8;
  o.d_ff = 32;
  o.routing.num_experts = 8;
  o.routing.num_groups = 4;
  o.routing.top_k = 1;
  // Flat top-1 of 8: a token's row goes to one group of 4, so most groups
  // get none from a micro-batch of 2 tokens.
  o.routing.method = router::RoutingMethod::kVanilla;
  ExpertBackendOptions eo;
  eo.shape = model::ExpertShapeFor(o);
  auto recording = std::make_unique<RecordingBackend>(CreateInProcessBackend(eo).value());
  RecordingBackend& rec = *recording;
  auto moe = BackendMoE::Create(o, recording.get());
  ASSERT_TRUE(moe.ok()) << moe.status();
  at::manual_seed(3);
  const auto forward = [&](uint32_t micro_batch, bool training) {
    model::MoECall call;
    call.step = 1;
    call.micro_batch = micro_batch;
    call.training = training;
    for (int layer = 0; layer < (*moe)->num_layers(); ++layer) {
      auto out = (*moe)->Forward(layer, at::randn({2, o.d_model}), call);
      ASSERT_TRUE(out.ok()) << out.status();
    }
  };
  for (uint32_t mb = 0; mb < 6; ++mb) forward(mb, true);
  forward(0, true);  // the step again: the order starts over
  forward(1, true);
  forward(2, false);  // evaluation
  int empty = 0;
  for (const auto& [layer, calls] : rec.calls) {
    ASSERT_EQ(calls.size(), 9u);
    std::vector<int64_t> next(4, 0);
    for (size_t i = 0; i < calls.size(); ++i) {
      const RecordingBackend::Call& c = calls[i];
      const bool training = i < 8;
      if (c.micro_batch == 0) next.assign(4, 0);
      for (int g = 0; g < 4; ++g) {
        SCOPED_TRACE(::testing::Message()
                     << "layer " << layer << ", call " << i << ", group " << g);
        if (!training || !c.has_rows[g]) {
          EXPECT_EQ(c.positions[g], -1);
          empty += training && !c.has_rows[g];
        } else {
          EXPECT_EQ(c.positions[g], next[g]++);
        }
      }
    }
  }
  EXPECT_GT(empty, 0);  // some group went without rows, and did not take a place
}

}  // namespace
}  // namespace himoe::trainer
