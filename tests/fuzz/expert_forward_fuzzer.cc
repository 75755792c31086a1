// An expert service's Forward on arbitrary bytes parsed as an
// ExpertForwardRequest (the decode path of its gRPC handler): an error or one
// output per input with the same row counts, never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

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
    return himoe::expert::ExpertServiceCore::Create(o).value().release();
  }();
  return core;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  himoe::v1::ExpertForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  request.set_save_for_backward(false);  // no state kept between inputs
  himoe::v1::ExpertForwardResponse response;
  if (!Core()->Forward(&request, &response).ok()) return 0;  // the served, taking form
  if (response.outputs_size() != request.inputs_size()) std::abort();
  for (int i = 0; i < request.inputs_size(); ++i) {
    if (response.outputs(i).rows().shape(0) != request.inputs(i).rows().shape(0)) std::abort();
  }
  return 0;
}
