// The tensor codec on arbitrary bytes parsed as a himoe.v1.Tensor: an error
// or a tensor, never a crash; a tensor it accepts encodes back to the same
// shape, dtype and bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <ATen/ATen.h>

#include "common/tensor_codec.h"
#include "himoe/v1/tensor.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  himoe::v1::Tensor proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto tensor = himoe::DecodeTensor(proto, "fuzz");
  if (!tensor.ok()) return 0;
  himoe::v1::Tensor again;
  if (!himoe::EncodeTensor(*tensor, &again).ok()) std::abort();
  if (again.dtype() != proto.dtype() || again.data() != proto.data() ||
      again.shape_size() != proto.shape_size()) {
    std::abort();
  }
  for (int i = 0; i < proto.shape_size(); ++i) {
    if (again.shape(i) != proto.shape(i)) std::abort();
  }
  return 0;
}
