#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/parallel_for.h"

namespace himoe::model {
namespace {

// The B·H heads split into one block per thread, forward and backward; the
// same products and elementwise ops as at::matmul and autograd, in the same
// order.
class CausalAttention : public torch::autograd::Function<CausalAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                            const at::Tensor& k_in, const at::Tensor& v_in) {
    const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
    const at::Tensor q = q_in.reshape({B * H, T, D}), k = k_in.reshape({B * H, T, D}),
                     v = v_in.reshape({B * H, T, D});
    const double scale = std::sqrt(static_cast<double>(D));
    const at::Tensor mask = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);
    at::Tensor att = at::empty({B * H, T, T}, q.options());
    at::Tensor y = at::empty({B * H, T, D}, q.options());
    ForEachBlock(B * H, q, [&](int64_t begin, int64_t count) {
      at::Tensor att_b = att.narrow(0, begin, count), y_b = y.narrow(0, begin, count);
      const at::Tensor scores =
          at::bmm(q.narrow(0, begin, count), k.narrow(0, begin, count).transpose(1, 2))
              .div_(scale)
              .masked_fill_(mask, -std::numeric_limits<float>::infinity());
      at::_softmax_out(att_b, scores, -1, false);
      at::bmm_out(y_b, att_b, v.narrow(0, begin, count));
    });
    ctx->save_for_backward({q, k, v, att});
    return y.view({B, H, T, D});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &att = saved[3];
    const int64_t BH = q.size(0), T = q.size(1), D = q.size(2);
    const double scale = std::sqrt(static_cast<double>(D));
    const at::Tensor gy = grads[0].reshape({BH, T, D});
    at::Tensor gq = at::empty_like(q), gk = at::empty_like(k), gv = at::empty_like(v);
    ForEachBlock(BH, q, [&](int64_t begin, int64_t count) {
      const at::Tensor att_b = att.narrow(0, begin, count), gy_b = gy.narrow(0, begin, count);
      at::Tensor gv_b = gv.narrow(0, begin, count), gq_b = gq.narrow(0, begin, count),
                 gk_b = gk.narrow(0, begin, count);
      at::bmm_out(gv_b, att_b.transpose(1, 2), gy_b);
      // Masked entries have att = 0, so their score gradient is 0, as
      // masked_fill's backward makes it.
      const at::Tensor gs =
          at::_softmax_backward_data(at::bmm(gy_b, v.narrow(0, begin, count).transpose(1, 2)),
                                     att_b, -1, att_b.scalar_type())
              .div_(scale);
      at::bmm_out(gq_b, gs, k.narrow(0, begin, count));
      at::bmm_out(gk_b, gs.transpose(1, 2), q.narrow(0, begin, count));
    });
    const int64_t B = grads[0].size(0), H = grads[0].size(1);
    return {gq.view({B, H, T, D}), gk.view({B, H, T, D}), gv.view({B, H, T, D})};
  }

 private:
  // fn(begin, count) on one contiguous block of the `n` heads per thread.
  template <class Fn>
  static void ForEachBlock(int64_t n, const at::Tensor& like, Fn fn) {
    const int64_t blocks = like.is_cpu() ? std::min<int64_t>(n, at::get_num_threads()) : 1;
    const at::ThreadLocalState caller;  // grad mode, dispatch keys: per thread
    ParallelFor(blocks, static_cast<int>(blocks), [&](int64_t b) {
      at::ThreadLocalStateGuard same_state(caller);
      const int64_t begin = n * b / blocks, end = n * (b + 1) / blocks;
      if (end > begin) fn(begin, end - begin);
    });
  }
};

}  // namespace

at::Tensor CausalSelfAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return CausalAttention::apply(q, k, v);
}

}  // namespace himoe::model
