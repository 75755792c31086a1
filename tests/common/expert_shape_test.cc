#include "common/expert_shape.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/cluster_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/small_expert_shape.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

v1::ExpertShape Shape() { return test_util::SmallExpertShape(1); }

TEST(ExpertShapeTest, ValidShapePassesAndEachBadFieldIsNamed) {
  EXPECT_TRUE(ValidateExpertShape(Shape()).ok());
  struct Case {
    void (*mutate)(v1::ExpertShape*);
    const char* field;
  } cases[] = {
      {[](v1::ExpertShape* s) { s->set_num_experts(0); }, "num_experts"},
      {[](v1::ExpertShape* s) { s->set_num_groups(3); }, "multiple of num_groups"},
      {[](v1::ExpertShape* s) { s->set_num_layers(0); }, "num_layers"},
      {[](v1::ExpertShape* s) { s->set_d_model(0); }, "d_model"},
      {[](v1::ExpertShape* s) { s->set_d_ff(-1); }, "d_ff"},
      {[](v1::ExpertShape* s) { s->set_dtype(v1::DTYPE_INT64); }, "dtype"},
      {[](v1::ExpertShape* s) { s->set_matmul_dtype(v1::DTYPE_FLOAT16); }, "matmul_dtype"},
      {[](v1::ExpertShape* s) { s->set_init(static_cast<v1::WeightInit>(9)); }, "init"},
      {[](v1::ExpertShape* s) { s->set_init(v1::WEIGHT_INIT_SWITCH); }, "n_layer"},
  };
  for (const Case& c : cases) {
    v1::ExpertShape s = Shape();
    c.mutate(&s);
    const absl::Status status = ValidateExpertShape(s);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
  }
}

TEST(ExpertShapeTest, HandshakeNamesEveryDifferingField) {
  EXPECT_TRUE(CheckExpertShape(Shape(), Shape(), "group 0").ok());
  v1::ExpertShape served = Shape();
  served.set_seed(7);
  served.set_dtype(v1::DTYPE_BFLOAT16);
  const absl::Status s = CheckExpertShape(Shape(), served, "expert group 2 at 127.0.0.1:5");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "expert group 2 at 127.0.0.1:5 serves seed 7, dtype bfloat16; the model needs "
            "seed 1, dtype float32");
  // Unset products are the weights' dtype: float32 here, as if set so.
  v1::ExpertShape f32_products = Shape();
  f32_products.set_matmul_dtype(v1::DTYPE_FLOAT32);
  EXPECT_TRUE(CheckExpertShape(Shape(), f32_products, "group 0").ok());
  v1::ExpertShape bf16_products = Shape();
  bf16_products.set_matmul_dtype(v1::DTYPE_BFLOAT16);
  EXPECT_EQ(CheckExpertShape(bf16_products, Shape(), "group 3").message(),
            "group 3 serves matmul_dtype float32; the model needs matmul_dtype bfloat16");
  EXPECT_EQ(ExpertShapeDebugString(bf16_products),
            "N=8 M=4 layers=2 d_model=64 d_ff=256 seed=1 float32 matmul=bfloat16");
  v1::ExpertShape released = Shape();
  released.set_init(v1::WEIGHT_INIT_SWITCH);
  released.set_n_layer(4);
  EXPECT_EQ(CheckExpertShape(released, Shape(), "group 1").message(),
            "group 1 serves init default, n_layer 0; the model needs init switch, n_layer 4");
}

TEST(ExpertShapeTest, FromClusterFile) {
  auto cluster = ParseClusterConfig(R"pb(
    model { num_layers: 2 d_model: 64 d_ff: 256 num_experts: 8 seed: 1 }
    groups { address: "127.0.0.1:1" } groups { address: "127.0.0.1:2" }
    groups { address: "127.0.0.1:3" } groups { address: "127.0.0.1:4" }
  )pb",
                                    "test");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_TRUE(CheckExpertShape(Shape(), ExpertShapeFromCluster(*cluster), "cluster").ok());
  EXPECT_EQ(ExpertShapeDebugString(Shape()), "N=8 M=4 layers=2 d_model=64 d_ff=256 seed=1 float32");

  cluster->mutable_model()->set_matmul_dtype("bfloat16");
  EXPECT_EQ(ExpertShapeFromCluster(*cluster).matmul_dtype(), v1::DTYPE_BFLOAT16);
  cluster->mutable_model()->set_matmul_dtype("float32");
  EXPECT_TRUE(CheckExpertShape(Shape(), ExpertShapeFromCluster(*cluster), "cluster").ok());

  cluster->mutable_model()->set_init("switch");
  cluster->mutable_model()->set_n_layer(4);
  const v1::ExpertShape released = ExpertShapeFromCluster(*cluster);
  EXPECT_EQ(released.init(), v1::WEIGHT_INIT_SWITCH);
  EXPECT_EQ(released.n_layer(), 4);
  EXPECT_EQ(ExpertShapeDebugString(released),
            "N=8 M=4 layers=2 d_model=64 d_ff=256 seed=1 float32 init=switch n_layer=4");
  cluster->mutable_model()->set_init("fancy");
  EXPECT_THAT(std::string(ValidateExpertShape(ExpertShapeFromCluster(*cluster)).message()),
              HasSubstr("init"));
  EXPECT_EQ(ParseWeightInit("fancy").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertShapeTest, FromFlags) {
  ExpertShapeFlags flags;
  flags.num_experts = 8;
  flags.num_groups = 4;
  flags.num_layers = 2;
  flags.d_model = 64;
  flags.d_ff = 256;
  flags.seed = 1;
  absl::StatusOr<v1::ExpertShape> shape = ExpertShapeFromFlags(flags);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_TRUE(CheckExpertShape(Shape(), *shape, "flags").ok());
  EXPECT_EQ(shape->matmul_dtype(), v1::DTYPE_UNSPECIFIED);

  flags.dtype = "bfloat16";
  flags.matmul_dtype = "bfloat16";
  flags.init = "switch";
  flags.n_layer = 4;
  shape = ExpertShapeFromFlags(flags);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(shape->matmul_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(shape->init(), v1::WEIGHT_INIT_SWITCH);
  EXPECT_EQ(shape->n_layer(), 4);

  flags.dtype = "fp8";
  EXPECT_EQ(ExpertShapeFromFlags(flags).status().message(),
            "--dtype: expected float32 or bfloat16, got 'fp8'");
  flags.dtype = "float32";
  flags.matmul_dtype = "fp16";
  EXPECT_EQ(ExpertShapeFromFlags(flags).status().message(),
            "--matmul_dtype: expected float32 or bfloat16, got 'fp16'");
  flags.matmul_dtype = "float32";
  flags.init = "fancy";
  EXPECT_EQ(ExpertShapeFromFlags(flags).status().message(),
            "--init: expected default or switch, got 'fancy'");
}

TEST(ExpertShapeTest, ArgsGiveTheShapeBack) {
  EXPECT_THAT(ExpertShapeArgs(Shape()),
              ::testing::ElementsAre("--num_groups=4", "--num_experts=8", "--num_layers=2",
                                     "--d_model=64", "--d_ff=256", "--seed=1",
                                     "--dtype=float32"));
  v1::ExpertShape released = Shape();
  released.set_dtype(v1::DTYPE_BFLOAT16);
  released.set_matmul_dtype(v1::DTYPE_BFLOAT16);
  released.set_init(v1::WEIGHT_INIT_SWITCH);
  released.set_n_layer(4);
  const std::vector<std::string> args = ExpertShapeArgs(released);
  EXPECT_THAT(args, ::testing::ElementsAre("--num_groups=4", "--num_experts=8", "--num_layers=2",
                                           "--d_model=64", "--d_ff=256", "--seed=1",
                                           "--dtype=bfloat16", "--matmul_dtype=bfloat16",
                                           "--init=switch", "--n_layer=4"));
  // Read back as himoe-expert reads its flags.
  ExpertShapeFlags flags;
  flags.num_groups = 4;
  flags.num_experts = 8;
  flags.num_layers = 2;
  flags.d_model = 64;
  flags.d_ff = 256;
  flags.seed = 1;
  flags.dtype = "bfloat16";
  flags.matmul_dtype = "bfloat16";
  flags.init = "switch";
  flags.n_layer = 4;
  const absl::StatusOr<v1::ExpertShape> back = ExpertShapeFromFlags(flags);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(CheckExpertShape(released, *back, "flags").ok());
}

}  // namespace
}  // namespace himoe
