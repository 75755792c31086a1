#ifndef HIMOE_ROUTER_SERVICE_ROUTING_DISPATCH_COMBINE_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_DISPATCH_COMBINE_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "router_service/routing/router_layer.h"

namespace himoe::router {

// The two ends of an MoE layer around its experts, with their backward.
// On float32 CPU tensors each is one autograd node whose loops run over the
// tokens (a token's sum is its own, in group order, so results do not depend
// on the thread count); LibTorch's index_select / index_add each cost a pass
// over all rows per group and ran on one thread. Elsewhere (other devices or
// dtypes) they are those ATen ops.

// rows[g] = x[groups[g].token_rows], [n_g, d]. Backward: a token's gradient
// is the sum of its rows' gradients, group by group.
std::vector<at::Tensor> DispatchGroupRows(const at::Tensor& x,
                                          const std::vector<GroupDispatch>& groups);

// out[t] = sum over groups and rows of weight * expert_output, [T, d] float.
// `outputs[g]` holds group g's expert outputs, row-aligned with groups[g].
// Backward: each row's gradient is weight * grad_out[t], its weight's
// gradient is the dot product of grad_out[t] and the row.
at::Tensor CombineGroupOutputs(int64_t num_tokens, int64_t d_model,
                               const std::vector<GroupDispatch>& groups,
                               const std::vector<at::Tensor>& outputs);

// A group's assignments with each token once: `tokens` (int64 [u],
// ascending) are the distinct rows of the layer input among d.token_rows,
// and `rows` (int64 [n]) is each assignment's index into `tokens`, so that
// d.token_rows == tokens[rows]. On the CPU.
struct DistinctTokens {
  at::Tensor tokens;
  at::Tensor rows;
};
DistinctTokens DistinctTokenRows(int64_t num_tokens, const GroupDispatch& d);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_DISPATCH_COMBINE_H_
