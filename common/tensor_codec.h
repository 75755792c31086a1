#ifndef HIMOE_COMMON_TENSOR_CODEC_H_
#define HIMOE_COMMON_TENSOR_CODEC_H_

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/shared_memory.h"
#include "himoe/v1/tensor.pb.h"

namespace himoe {

// Wire dtype <-> torch scalar type. Unknown values give InvalidArgument.
absl::StatusOr<c10::ScalarType> ScalarTypeFromProto(v1::DType dtype);
absl::StatusOr<v1::DType> DTypeToProto(c10::ScalarType type);

// Writes `tensor` (any device, any layout) as little-endian row-major bytes.
// The bytes are copied once into `out`.
absl::Status EncodeTensor(const at::Tensor& tensor, v1::Tensor* out);

// Writes `tensor` into `region` at `offset` (a multiple of
// kSharedMemoryAlignment) and makes `out` name the slice (Tensor.shared).
absl::Status EncodeTensorShared(const at::Tensor& tensor, SharedMemoryRegion& region,
                                uint64_t offset, v1::Tensor* out);

// Validates `proto` completely (known dtype, non-negative shape, numel fits in
// int64, byte length == numel * element size) and returns a CPU tensor that
// owns a single copy of the bytes. `field` names the message field in errors.
// A Tensor.shared slice is InvalidArgument here (TakeTensor reads those).
absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto,
                                        absl::string_view field = "tensor");

// DecodeTensor without the copy, for a message the caller owns: the tensor
// takes `proto`'s bytes and aliases them (proto->data() is left empty). Falls
// back to a copy where the bytes are not aligned for the dtype. On error
// `proto` is unchanged. A Tensor.shared slice is found through `shared`
// (InvalidArgument when null) and the tensor aliases the region's bytes,
// keeping the region mapped while it lives: a caller whose region may be
// written again copies it.
absl::StatusOr<at::Tensor> TakeTensor(v1::Tensor* proto, absl::string_view field = "tensor",
                                      SharedMemoryLookup* shared = nullptr);

}  // namespace himoe

#endif  // HIMOE_COMMON_TENSOR_CODEC_H_
