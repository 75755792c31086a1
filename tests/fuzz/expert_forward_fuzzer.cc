// An expert service's Forward on arbitrary bytes parsed as an
// ExpertForwardRequest (the decode path of its gRPC handler), on a group that
// takes shared memory: an error or one output per input with the same row
// counts, never a crash. The input's first byte may point its slices at a
// live region (bit 0), with that region's key (bit 1) or the input's own: a
// call with a key not the region's is never answered.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "common/shared_memory.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_service_core.h"
#include "himoe/v1/expert.pb.h"

namespace {

himoe::expert::ExpertServiceCore* Core() {
  static himoe::expert::ExpertServiceCore* core = [] {
    himoe::ConfigureTorchThreads(1).IgnoreError();
    himoe::expert::ExpertServiceOptions o;
    o.shape.set_num_experts(8);
    o.shape.set_num_groups(4);
    o.shape.set_num_layers(2);
    o.shape.set_d_model(8);
    o.shape.set_d_ff(16);
    o.shape.set_seed(1);
    o.shape.set_dtype(himoe::v1::DTYPE_FLOAT32);
    o.group_id = 1;
    o.max_tokens_per_request = 256;
    o.shared_memory = true;
    return himoe::expert::ExpertServiceCore::Create(o).value().release();
  }();
  return core;
}

himoe::SharedMemoryRegion& Region() {
  static himoe::SharedMemoryRegion* region =
      himoe::SharedMemoryRegion::Create("fuzz", 1 << 16).value().release();
  return *region;
}

// Points `slice` at the live region; with `own_key`, with its key too. False
// when the slice then carries a key that is not the region's.
bool Aim(himoe::v1::SharedMemorySlice* slice, bool own_key) {
  slice->set_region(Region().name());
  if (own_key) slice->set_key(Region().key());
  return slice->key() == Region().key();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  himoe::v1::ExpertForwardRequest request;
  if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  request.set_save_for_backward(false);  // no state kept between inputs
  bool keys_right = true;
  if (mode & 1) {
    for (auto& in : *request.mutable_inputs()) {
      if (in.rows().has_shared()) {
        keys_right &= Aim(in.mutable_rows()->mutable_shared(), mode & 2);
      }
    }
    if (request.has_output_slice()) {
      keys_right &= Aim(request.mutable_output_slice(), mode & 2);
    }
  }
  himoe::v1::ExpertForwardResponse response;
  if (!Core()->Forward(&request, &response).ok()) return 0;  // the served, taking form
  if ((mode & 1) && !keys_right) std::abort();               // a foreign key was accepted
  if (response.outputs_size() != request.inputs_size()) std::abort();
  for (int i = 0; i < request.inputs_size(); ++i) {
    if (response.outputs(i).rows().shape(0) != request.inputs(i).rows().shape(0)) std::abort();
  }
  return 0;
}
