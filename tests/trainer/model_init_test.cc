// The reference preset's init (v1::WEIGHT_INIT_SWITCH) on a whole model, as
// the released code's GPT._init_weights with use_switch_tfm_init and scale
// 0.1 leaves it: every linear weight truncated normal of std
// sqrt(0.1/fan_in) cut at 2 std, the tied head (so the token embedding) too;
// residual projections N(0, 0.02/sqrt(2 n_layer)); the position embedding
// N(0, 0.02); the gate like any linear weight, except loss_free's, whose
// centroids keep torch's kaiming_uniform_(a = sqrt(5)) = U(-1/sqrt(d), 1/sqrt(d)).
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "gtest/gtest.h"
#include "model/model_config.h"
#include "model/transformer_lm.h"
#include "trainer/backend_moe.h"
#include "trainer/expert_backend.h"

namespace himoe::trainer {
namespace {

// Sample std of a truncated normal at +-2 std, over its std:
// sqrt(1 - 4 phi(2) / (2 Phi(2) - 1)).
constexpr double kTruncatedStd = 0.8796;

struct Built {
  std::unique_ptr<ExpertBackend> experts;
  std::unique_ptr<BackendMoE> moe;
  std::shared_ptr<model::TransformerLM> lm;
};

Built Build(v1::WeightInit init,
            router::RoutingMethod method = router::RoutingMethod::kHiMoe) {
  model::ModelOptions o;
  o.n_layer = 4;
  o.d_model = 128;
  o.vocab_size = 256;
  o.block_size = 128;
  o.d_ff = 512;
  o.routing.num_experts = 8;
  o.routing.num_groups = 4;
  o.routing.method = method;
  o.init = init;
  Built b;
  ExpertBackendOptions eo;
  eo.shape = model::ExpertShapeFor(o);
  b.experts = CreateInProcessBackend(eo).value();
  b.moe = BackendMoE::Create(o, b.experts.get()).value();
  b.lm = model::TransformerLM::Create(o, b.moe.get()).value();
  return b;
}

std::map<std::string, at::Tensor> Params(const model::TransformerLM& lm) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : lm.named_parameters()) out[p.key()] = p.value();
  return out;
}

TEST(ModelInitTest, SwitchInitDrawsEveryLinearWeightAsTheReleasedCode) {
  const Built b = Build(v1::WEIGHT_INIT_SWITCH);
  const auto p = Params(*b.lm);
  const double d_std = std::sqrt(0.1 / 128), residual = 0.02 / std::sqrt(8.0);
  for (const std::string name : {"wte.weight", "h0_qkv.weight", "h3_qkv.weight", "moe0_gate",
                                 "moe3_gate"}) {
    ASSERT_TRUE(p.count(name)) << name;
    const at::Tensor& t = p.at(name);
    EXPECT_LE(t.abs().max().item<double>(), 2 * d_std) << name;
    EXPECT_NEAR(t.std().item<double>(), kTruncatedStd * d_std, 0.06 * d_std) << name;
  }
  for (const std::string name : {"h0_proj.weight", "h2_proj.weight"}) {
    EXPECT_NEAR(p.at(name).std().item<double>(), residual, 0.05 * residual) << name;
  }
  EXPECT_NEAR(p.at("wpe.weight").std().item<double>(), 0.02, 0.001);
  EXPECT_GT(p.at("wpe.weight").abs().max().item<double>(), 2 * d_std);  // not truncated
  EXPECT_EQ(p.at("h1_qkv.bias").abs().max().item<double>(), 0.0);
}

TEST(ModelInitTest, SwitchInitLeavesLossFreeCentroidsKaimingUniform) {
  const Built b = Build(v1::WEIGHT_INIT_SWITCH, router::RoutingMethod::kLossFree);
  const auto p = Params(*b.lm);
  const double bound = 1 / std::sqrt(128.0);  // gain sqrt(2/(1+5)) * sqrt(3/fan_in)
  for (const std::string name : {"moe0_gate", "moe3_gate"}) {
    const at::Tensor& t = p.at(name);
    EXPECT_LE(t.abs().max().item<double>(), bound) << name;
    EXPECT_GT(t.abs().max().item<double>(), 0.99 * bound) << name;  // 1024 draws reach the edge
    EXPECT_NEAR(t.std().item<double>(), bound / std::sqrt(3.0), 0.04 * bound) << name;
  }
  // Everything else as for the other methods.
  EXPECT_NEAR(p.at("h0_qkv.weight").std().item<double>(), kTruncatedStd * std::sqrt(0.1 / 128),
              0.06 * std::sqrt(0.1 / 128));
}

TEST(ModelInitTest, DefaultInitIsNanoGpts) {
  const Built b = Build(v1::WEIGHT_INIT_DEFAULT);
  const auto p = Params(*b.lm);
  for (const std::string name : {"wte.weight", "h0_qkv.weight", "moe0_gate"}) {
    EXPECT_NEAR(p.at(name).std().item<double>(), 0.02, 0.001) << name;
    EXPECT_GT(p.at(name).abs().max().item<double>(), 0.07) << name;  // 3.5 std: untruncated
  }
}

}  // namespace
}  // namespace himoe::trainer
