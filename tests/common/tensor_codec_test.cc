#include "common/tensor_codec.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "himoe/v1/tensor.pb.h"

namespace himoe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// The tensor's bytes in storage order; `t` must be contiguous.
std::string RawBytes(const at::Tensor& t) {
  if (t.nbytes() == 0) return {};
  return std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
}

struct DTypePair {
  v1::DType wire;
  c10::ScalarType torch;
};

std::ostream& operator<<(std::ostream& os, const DTypePair& p) {
  return os << c10::toString(p.torch);
}

constexpr DTypePair kAllDTypes[] = {
    {v1::DTYPE_FLOAT32, c10::kFloat}, {v1::DTYPE_BFLOAT16, c10::kBFloat16},
    {v1::DTYPE_FLOAT16, c10::kHalf},  {v1::DTYPE_INT64, c10::kLong},
    {v1::DTYPE_INT32, c10::kInt},
};

at::Tensor RandomTensor(c10::ScalarType type, at::IntArrayRef shape) {
  const auto options = at::TensorOptions().dtype(type);
  switch (type) {
    case c10::kLong:
      return at::randint(-(int64_t{1} << 62), int64_t{1} << 62, shape,
                            options);
    case c10::kInt:
      return at::randint(std::numeric_limits<int32_t>::min(),
                            std::numeric_limits<int32_t>::max(), shape,
                            options);
    default:
      return (at::randn(shape) * 100).to(type);
  }
}

TEST(DTypeMappingTest, RoundTripsEveryWireType) {
  for (const DTypePair& p : kAllDTypes) {
    SCOPED_TRACE(c10::toString(p.torch));
    absl::StatusOr<c10::ScalarType> torch_type = ScalarTypeFromProto(p.wire);
    ASSERT_TRUE(torch_type.ok()) << torch_type.status();
    EXPECT_EQ(*torch_type, p.torch);
    absl::StatusOr<v1::DType> wire = DTypeToProto(p.torch);
    ASSERT_TRUE(wire.ok()) << wire.status();
    EXPECT_EQ(*wire, p.wire);
  }
}

TEST(DTypeMappingTest, RejectsTypesWithoutWireEncoding) {
  const absl::StatusOr<v1::DType> wire = DTypeToProto(c10::kDouble);
  EXPECT_EQ(wire.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wire.status().message(),
              HasSubstr("Double has no wire encoding"));
}

using RoundTripParam = std::tuple<DTypePair, std::vector<int64_t>>;

class TensorCodecRoundTripTest
    : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(TensorCodecRoundTripTest, IsBitExact) {
  const auto& [dtype, shape] = GetParam();
  at::manual_seed(1234);
  const at::Tensor original = RandomTensor(dtype.torch, shape);
  ASSERT_EQ(original.scalar_type(), dtype.torch);

  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensor(original, &proto).ok());
  EXPECT_EQ(proto.dtype(), dtype.wire);
  EXPECT_THAT(proto.shape(), ElementsAreArray(shape));
  EXPECT_EQ(proto.data(), RawBytes(original));

  const absl::StatusOr<at::Tensor> decoded = DecodeTensor(proto, "hidden");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->scalar_type(), dtype.torch);
  EXPECT_EQ(decoded->sizes(), original.sizes());
  EXPECT_TRUE(decoded->device().is_cpu());
  EXPECT_TRUE(decoded->is_contiguous());
  EXPECT_TRUE(at::equal(*decoded, original));
  EXPECT_EQ(RawBytes(*decoded), RawBytes(original));
  if (decoded->numel() > 0) {
    // The decoded tensor owns its bytes rather than aliasing the message.
    EXPECT_NE(decoded->data_ptr(),
              static_cast<const void*>(proto.data().data()));
  }

  // TakeTensor gives the same tensor, whether it takes the bytes or (small
  // payloads) copies them.
  const absl::StatusOr<at::Tensor> taken = TakeTensor(&proto, "hidden");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->scalar_type(), dtype.torch);
  EXPECT_EQ(taken->sizes(), original.sizes());
  EXPECT_TRUE(taken->is_contiguous());
  EXPECT_EQ(RawBytes(*taken), RawBytes(original));
}

std::string RoundTripName(
    const ::testing::TestParamInfo<RoundTripParam>& info) {
  const auto& [dtype, shape] = info.param;
  return absl::StrCat(c10::toString(dtype.torch), "_",
                      shape.empty() ? "scalar" : absl::StrJoin(shape, "x"));
}

INSTANTIATE_TEST_SUITE_P(
    AllDTypesAndShapes, TensorCodecRoundTripTest,
    ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                       ::testing::Values(std::vector<int64_t>{},
                                         std::vector<int64_t>{1},
                                         std::vector<int64_t>{17},
                                         std::vector<int64_t>{3, 5},
                                         std::vector<int64_t>{4, 0, 3},
                                         std::vector<int64_t>{2, 3, 4, 5})),
    RoundTripName);

// at::equal treats -0 == 0 and NaN != NaN, so special values are checked
// byte for byte.
class TensorCodecSpecialValuesTest
    : public ::testing::TestWithParam<DTypePair> {};

TEST_P(TensorCodecSpecialValuesTest, PreservesBitPatterns) {
  const float inf = std::numeric_limits<float>::infinity();
  const at::Tensor original =
      at::tensor({0.0f, -0.0f, inf, -inf,
                     std::numeric_limits<float>::quiet_NaN(), 1e-40f, 65504.0f})
          .to(GetParam().torch);
  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensor(original, &proto).ok());
  const absl::StatusOr<at::Tensor> decoded = DecodeTensor(proto);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(RawBytes(*decoded), RawBytes(original));
  EXPECT_TRUE(decoded->select(0, 1).signbit().item<bool>());
  EXPECT_TRUE(decoded->select(0, 4).isnan().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(FloatTypes, TensorCodecSpecialValuesTest,
                         ::testing::Values(kAllDTypes[0], kAllDTypes[1],
                                           kAllDTypes[2]),
                         [](const auto& info) {
                           return std::string(c10::toString(info.param.torch));
                         });

TEST(TensorCodecTest, NonContiguousInputIsEncodedInLogicalRowMajorOrder) {
  // [[0, 1, 2], [3, 4, 5]] transposed is [[0, 3], [1, 4], [2, 5]].
  const at::Tensor transposed =
      at::arange(6, at::kFloat).reshape({2, 3}).t();
  ASSERT_FALSE(transposed.is_contiguous());

  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensor(transposed, &proto).ok());
  EXPECT_THAT(proto.shape(), ElementsAre(3, 2));
  const std::vector<float> expected = {0, 3, 1, 4, 2, 5};
  EXPECT_EQ(proto.data(),
            std::string(reinterpret_cast<const char*>(expected.data()),
                        expected.size() * sizeof(float)));

  const absl::StatusOr<at::Tensor> decoded = DecodeTensor(proto);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(at::equal(*decoded, transposed));
}

TEST(TensorCodecTest, EncodeRejectsUndefinedAndUnsupportedTensors) {
  v1::Tensor proto;
  EXPECT_EQ(EncodeTensor(at::Tensor(), &proto).code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status status =
      EncodeTensor(at::ones({2}, at::kDouble), &proto);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("Double"));
}

TEST(TensorCodecTest, TakeTensorAliasesTheMessageBytesAndOutlivesTheMessage) {
  at::manual_seed(7);
  const at::Tensor original = at::randn({64, 256});
  at::Tensor taken;
  const void* bytes = nullptr;
  {
    auto proto = std::make_unique<v1::Tensor>();
    ASSERT_TRUE(EncodeTensor(original, proto.get()).ok());
    bytes = proto->data().data();
    absl::StatusOr<at::Tensor> t = TakeTensor(proto.get(), "outputs");
    ASSERT_TRUE(t.ok()) << t.status();
    taken = *t;
    EXPECT_TRUE(proto->data().empty());
    EXPECT_THAT(proto->shape(), ElementsAre(64, 256));
  }
  // No copy: the tensor's storage is the message's former buffer, still
  // valid (and writable) after the message is gone.
  EXPECT_EQ(taken.data_ptr(), bytes);
  EXPECT_TRUE(at::equal(taken, original));
  taken.add_(1);
  EXPECT_TRUE(at::allclose(taken, original + 1));
}

TEST(TensorCodecTest, DefaultFieldNameIsTensor) {
  v1::Tensor proto;
  proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  const absl::StatusOr<at::Tensor> decoded = DecodeTensor(proto);
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(decoded.status().message()),
              StartsWith("tensor.dtype"));
}

struct RejectCase {
  std::string name;
  v1::DType dtype;
  std::vector<int64_t> shape;
  size_t data_bytes;
  std::string message;  // Expected substring of the error.
};

void PrintTo(const RejectCase& c, std::ostream* os) { *os << c.name; }

class TensorCodecRejectTest : public ::testing::TestWithParam<RejectCase> {
 protected:
  static v1::Tensor Message(const RejectCase& c) {
    v1::Tensor proto;
    proto.set_dtype(c.dtype);
    for (const int64_t s : c.shape) proto.add_shape(s);
    proto.set_data(std::string(c.data_bytes, '\x7f'));
    return proto;
  }
};

TEST_P(TensorCodecRejectTest, IsInvalidArgumentNamingTheProblem) {
  const RejectCase& c = GetParam();
  const v1::Tensor proto = Message(c);

  const absl::StatusOr<at::Tensor> decoded = DecodeTensor(proto, "hidden");
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(decoded.status().message()), StartsWith("hidden."));
  EXPECT_THAT(decoded.status().message(), HasSubstr(c.message));
}

TEST_P(TensorCodecRejectTest, TakeTensorRefusesTheSameAndLeavesTheBytes) {
  const RejectCase& c = GetParam();
  v1::Tensor proto = Message(c);

  const absl::StatusOr<at::Tensor> taken = TakeTensor(&proto, "hidden");
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(taken.status().message(), HasSubstr(c.message));
  EXPECT_EQ(proto.data(), std::string(c.data_bytes, '\x7f'));
}

INSTANTIATE_TEST_SUITE_P(
    MalformedMessages, TensorCodecRejectTest,
    ::testing::Values(
        RejectCase{"UnknownDType",
                   static_cast<v1::DType>(99),
                   {2},
                   8,
                   "hidden.dtype: unknown or unspecified value 99"},
        RejectCase{"UnspecifiedDType",
                   v1::DTYPE_UNSPECIFIED,
                   {2},
                   8,
                   "hidden.dtype: unknown or unspecified value 0"},
        RejectCase{"NegativeDim",
                   v1::DTYPE_FLOAT32,
                   {2, -3},
                   0,
                   "hidden.shape[1] is -3; dimensions must be >= 0"},
        RejectCase{"ElementCountOverflow",
                   v1::DTYPE_FLOAT32,
                   {int64_t{1} << 40, int64_t{1} << 40},
                   0,
                   "element count overflows int64"},
        RejectCase{"ByteCountOverflow",
                   v1::DTYPE_FLOAT32,
                   {int64_t{1} << 61, 2},
                   0,
                   "byte count overflows int64"},
        RejectCase{"DataTooShort",
                   v1::DTYPE_FLOAT32,
                   {2, 3},
                   23,
                   "hidden.data has 23 bytes; shape [2,3] of Float needs 24"},
        RejectCase{"DataTooLong",
                   v1::DTYPE_INT64,
                   {2, 3},
                   49,
                   "hidden.data has 49 bytes; shape [2,3] of Long needs 48"},
        RejectCase{"ScalarWithoutData",
                   v1::DTYPE_BFLOAT16,
                   {},
                   0,
                   "hidden.data has 0 bytes; shape [] of BFloat16 needs 2"},
        RejectCase{"EmptyShapeWithData",
                   v1::DTYPE_INT32,
                   {4, 0},
                   4,
                   "hidden.data has 4 bytes; shape [4,0] of Int needs 0"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace himoe

namespace himoe {
namespace {

// Tensor.shared: the bytes in a region, the message only naming them.
TEST(TensorCodecSharedTest, SharedSlicesRoundTripAndAreCheckedLikeBytes) {
  auto made = SharedMemoryRegion::Create("codec", 4096);
  ASSERT_TRUE(made.ok()) << made.status();
  std::shared_ptr<SharedMemoryRegion> region = std::move(*made);
  OwnSharedMemory own(region);
  const at::Tensor t = at::arange(12, at::kFloat).view({3, 4}) * 0.5;
  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensorShared(t, *region, 128, &proto).ok());
  EXPECT_TRUE(proto.data().empty());
  EXPECT_EQ(proto.shared().region(), region->name());
  EXPECT_EQ(proto.shared().offset(), 128u);
  EXPECT_EQ(proto.shared().byte_size(), 48u);
  EXPECT_EQ(proto.shared().key(), region->key());
  float* in_region = reinterpret_cast<float*>(*region->Slice(128, 48, "x"));
  EXPECT_EQ(in_region[5], 2.5f);

  v1::Tensor taken = proto;
  auto back = TakeTensor(&taken, "y", &own);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(at::equal(*back, t));
  EXPECT_EQ(back->data_ptr<float>(), in_region);  // aliases the region
  in_region[0] = 7;
  EXPECT_EQ((*back)[0][0].item<float>(), 7);

  v1::Tensor no_lookup = proto;
  EXPECT_EQ(TakeTensor(&no_lookup, "y").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(DecodeTensor(proto, "z").status().message(),
              HasSubstr("z.shared: a shared-memory slice where bytes were expected"));
  v1::Tensor both = proto;
  both.set_data(std::string(48, '\0'));
  EXPECT_THAT(TakeTensor(&both, "w", &own).status().message(),
              HasSubstr("w.shared.byte_size is 48 with 48 bytes of data"));
  v1::Tensor short_slice = proto;
  short_slice.mutable_shared()->set_byte_size(44);
  EXPECT_EQ(TakeTensor(&short_slice, "w", &own).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::Tensor outside = proto;
  outside.mutable_shared()->set_offset(4096);
  EXPECT_THAT(TakeTensor(&outside, "w", &own).status().message(), HasSubstr("lie outside"));
  v1::Tensor keyless = proto;
  keyless.mutable_shared()->clear_key();
  const auto refused = TakeTensor(&keyless, "w", &own);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("w.shared.key: missing"));
  EXPECT_FALSE(EncodeTensorShared(t, *region, 4096, &proto).ok());
  EXPECT_FALSE(EncodeTensorShared(t, *region, 96, &proto).ok());  // not a multiple of 64
}

}  // namespace
}  // namespace himoe
