#include "common/tensor_codec.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; add byte swapping for this host");

namespace himoe {

absl::StatusOr<c10::ScalarType> ScalarTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return c10::kFloat;
    case v1::DTYPE_BFLOAT16: return c10::kBFloat16;
    case v1::DTYPE_FLOAT16: return c10::kHalf;
    case v1::DTYPE_INT64: return c10::kLong;
    case v1::DTYPE_INT32: return c10::kInt;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: unknown or unspecified value ", static_cast<int>(dtype),
          "; expected FLOAT32, BFLOAT16, FLOAT16, INT64 or INT32"));
  }
}

absl::StatusOr<v1::DType> DTypeToProto(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat: return v1::DTYPE_FLOAT32;
    case c10::kBFloat16: return v1::DTYPE_BFLOAT16;
    case c10::kHalf: return v1::DTYPE_FLOAT16;
    case c10::kLong: return v1::DTYPE_INT64;
    case c10::kInt: return v1::DTYPE_INT32;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: ", c10::toString(type), " has no wire encoding"));
  }
}

namespace {

// Fills `out`'s dtype and shape and hands the tensor's contiguous CPU bytes
// to `place`, which puts them in the message or in a shared-memory slice.
template <typename Place>
absl::Status EncodeWith(const at::Tensor& tensor, v1::Tensor* out, Place place) {
  if (!tensor.defined()) return absl::InvalidArgumentError("tensor: undefined");
  HIMOE_ASSIGN_OR_RETURN(const v1::DType dtype, DTypeToProto(tensor.scalar_type()));
  return CatchTorchErrors([&]() -> absl::Status {
    // No-ops for a contiguous CPU tensor: then the only copy is `place`'s.
    const at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    HIMOE_RETURN_IF_ERROR(place(cpu.data_ptr(), static_cast<uint64_t>(cpu.nbytes())));
    out->set_dtype(dtype);
    out->clear_shape();
    for (const int64_t s : cpu.sizes()) out->add_shape(s);
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status EncodeTensor(const at::Tensor& tensor, v1::Tensor* out) {
  return EncodeWith(tensor, out, [out](const void* bytes, uint64_t size) {
    out->clear_shared();
    out->set_data(bytes, size);
    return absl::OkStatus();
  });
}

absl::Status EncodeTensorShared(const at::Tensor& tensor, SharedMemoryRegion& region,
                                uint64_t offset, v1::Tensor* out) {
  return EncodeWith(tensor, out, [&](const void* bytes, uint64_t size) -> absl::Status {
    HIMOE_ASSIGN_OR_RETURN(uint8_t* const to, region.Slice(offset, size, "tensor.shared"));
    if (size > 0) std::memcpy(to, bytes, size);
    out->clear_data();
    v1::SharedMemorySlice* slice = out->mutable_shared();
    slice->set_region(region.name());
    slice->set_key(region.key());
    slice->set_offset(offset);
    slice->set_byte_size(size);
    return absl::OkStatus();
  });
}

namespace {

struct Layout {
  c10::ScalarType type;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
};

// Everything DecodeTensor checks, before any byte is touched.
absl::StatusOr<Layout> CheckLayout(const v1::Tensor& proto, absl::string_view field) {
  auto scalar_type = ScalarTypeFromProto(proto.dtype());
  if (!scalar_type.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".", scalar_type.status().message()));
  }
  Layout layout;
  layout.type = *scalar_type;
  const int64_t element_size = c10::elementSize(layout.type);
  std::vector<int64_t>& shape = layout.shape;
  shape.assign(proto.shape().begin(), proto.shape().end());
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape[", i, "] is ", shape[i], "; dimensions must be >= 0"));
    }
    if (__builtin_mul_overflow(numel, shape[i], &numel)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape [", absl::StrJoin(shape, ","),
          "]: the element count overflows int64"));
    }
  }
  if (__builtin_mul_overflow(numel, element_size, &layout.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape [", absl::StrJoin(shape, ","),
        "]: the byte count overflows int64"));
  }
  if (proto.has_shared()) {
    if (!proto.data().empty() ||
        proto.shared().byte_size() != static_cast<uint64_t>(layout.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shared.byte_size is ", proto.shared().byte_size(), " with ",
          proto.data().size(), " bytes of data; shape [", absl::StrJoin(shape, ","), "] of ",
          c10::toString(layout.type), " needs ", layout.bytes, " and no data"));
    }
    return layout;
  }
  if (static_cast<int64_t>(proto.data().size()) != layout.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", proto.data().size(), " bytes; shape [",
        absl::StrJoin(shape, ","), "] of ", c10::toString(layout.type),
        " needs ", layout.bytes));
  }
  return layout;
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto,
                                        absl::string_view field) {
  HIMOE_ASSIGN_OR_RETURN(const Layout layout, CheckLayout(proto, field));
  if (proto.has_shared()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shared: a shared-memory slice where bytes were expected"));
  }
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out = at::empty(layout.shape, at::TensorOptions().dtype(layout.type));
    if (layout.bytes > 0) std::memcpy(out.data_ptr(), proto.data().data(), layout.bytes);
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<at::Tensor> TakeTensor(v1::Tensor* proto, absl::string_view field,
                                      SharedMemoryLookup* shared) {
  HIMOE_ASSIGN_OR_RETURN(const Layout layout, CheckLayout(*proto, field));
  if (proto->has_shared()) {
    const std::string slice_field = absl::StrCat(field, ".shared");
    if (shared == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          slice_field, ": this service takes no shared memory; expected the bytes in data (an "
          "expert service takes shared memory when started with --shared_memory)"));
    }
    HIMOE_ASSIGN_OR_RETURN(
        std::shared_ptr<SharedMemoryRegion> region,
        shared->Find(proto->shared().region(), proto->shared().key(), slice_field));
    HIMOE_ASSIGN_OR_RETURN(uint8_t* const bytes,
                           region->Slice(proto->shared().offset(), layout.bytes, slice_field));
    at::Tensor out;
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      // The deleter's copy of `region` keeps it mapped while the tensor lives.
      out = at::from_blob(bytes, layout.shape, [region](void*) {},
                          at::TensorOptions().dtype(layout.type));
      return absl::OkStatus();
    }));
    return out;
  }
  const auto address = reinterpret_cast<uintptr_t>(proto->data().data());
  // Small payloads live inside the string object (no heap buffer to take).
  constexpr int64_t kMinTakenBytes = 256;
  if (layout.bytes < kMinTakenBytes || address % alignof(std::max_align_t) != 0) {
    return DecodeTensor(*proto, field);
  }
  // The tensor's deleter owns the bytes from here (layout is checked, so
  // from_blob has nothing left to refuse).
  auto* owned = new std::string();
  owned->swap(*proto->mutable_data());
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out = at::from_blob(
        owned->data(), layout.shape, [owned](void*) { delete owned; },
        at::TensorOptions().dtype(layout.type));
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace himoe
