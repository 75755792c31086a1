#include "common/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef HIMOE_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>

// oneDNN's bf16 x bf16 -> f32 GEMM: exported by libdnnl (DNNL_API in
// src/cpu/gemm/gemm.hpp) but not declared in its public headers. Row-major,
// arguments as dnnl_sgemm's.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
                                                dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                                const uint16_t* A, dnnl_dim_t lda,
                                                const uint16_t* B, dnnl_dim_t ldb, float beta,
                                                float* C, dnnl_dim_t ldc);
#endif

namespace himoe {
namespace {

// A 2-D operand as row-major memory: 'N' with rows `ld` apart, or 'T' (the
// transpose of a row-major matrix). Copies it contiguous when it is neither.
struct Operand {
  at::Tensor t;
  char trans = 'N';
  int64_t ld = 0;
};

Operand AsBf16Operand(const at::Tensor& x) {
  Operand o;
  o.t = x.to(at::kBFloat16);  // keeps a dense tensor's strides; no copy if bf16
  if (o.t.size(1) == 1 || o.t.stride(1) == 1) {
    o.ld = std::max<int64_t>(o.t.stride(0), o.t.size(1));
  } else if (o.t.size(0) == 1 || o.t.stride(0) == 1) {
    o.trans = 'T';
    o.ld = std::max<int64_t>(o.t.stride(1), o.t.size(0));
  } else {
    o.t = o.t.contiguous();
    o.ld = o.t.size(1);
  }
  return o;
}

bool DnnlGemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta) {
#ifdef HIMOE_HAVE_DNNL
  const Operand oa = AsBf16Operand(a), ob = AsBf16Operand(b);
  at::internal::lazy_init_num_threads();  // oneDNN takes this thread's OpenMP count
  const dnnl_status_t s = dnnl_gemm_bf16bf16f32(
      oa.trans, ob.trans, out.size(0), out.size(1), a.size(1), 1.0f,
      reinterpret_cast<const uint16_t*>(oa.t.data_ptr<at::BFloat16>()), oa.ld,
      reinterpret_cast<const uint16_t*>(ob.t.data_ptr<at::BFloat16>()), ob.ld, beta,
      out.data_ptr<float>(), out.stride(0));
  return s == dnnl_success;
#else
  (void)out, (void)a, (void)b, (void)beta;
  return false;
#endif
}

bool ProbeNative() {
  at::Tensor out = at::zeros({2, 2});
  const at::Tensor a = at::ones({2, 16}), b = at::ones({16, 2});
  return DnnlGemm(out, a, b, 0.0f) && out.eq(16.0f).all().item<bool>();
}

// y = x W^T + b on 2-D x (b empty: none), backward gx = gy W, gW = gy^T x, gb = sum(gy).
class LinearBf16Function : public torch::autograd::Function<LinearBf16Function> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    const bool has_bias = bias.numel() > 0;
    if (has_bias) y.copy_(bias);
    MatmulBf16Out(y, x, weight.t(), has_bias ? 1.0f : 0.0f);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = has_bias;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor gy = grads[0].contiguous();
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {
      gx = at::empty_like(x, at::MemoryFormat::Contiguous);
      MatmulBf16Out(gx, gy, weight, 0.0f);
    }
    if (ctx->needs_input_grad(1)) {
      gw = at::empty_like(weight, at::MemoryFormat::Contiguous);
      MatmulBf16Out(gw, gy.t(), x, 0.0f);
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = gy.sum(0);
    return {gx, gw, gb};
  }
};

}  // namespace

at::Tensor LinearBf16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  // No bias is an empty tensor: the autograd engine wants a device for every input.
  at::Tensor y = LinearBf16Function::apply(x2, weight,
                                           bias.defined() ? bias : at::empty({0}, x.options()));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return y.view(shape);
}

std::atomic<bool> native_enabled{true};

bool Bf16GemmNative() {
  static const bool native = ProbeNative();
  return native && native_enabled.load(std::memory_order_relaxed);
}

void SetBf16GemmNativeEnabled(bool enabled) { native_enabled = enabled; }

void MatmulBf16Out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "MatmulBf16Out: shapes ", a.sizes(), " x ", b.sizes(), " -> ", out.sizes());
  const auto operand = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(out.scalar_type() == at::kFloat && operand(a) && operand(b),
              "MatmulBf16Out: float32 or bfloat16 operands, a float32 result");
  if (out.numel() == 0) return;
  if (a.size(1) == 0) {
    out.mul_(beta);
    return;
  }
  if (out.is_cpu() && out.stride(1) == 1 && out.stride(0) >= out.size(1) && Bf16GemmNative() &&
      DnnlGemm(out, a, b, beta)) {
    return;
  }
  const at::Tensor ra = a.to(at::kBFloat16).to(at::kFloat);
  const at::Tensor rb = b.to(at::kBFloat16).to(at::kFloat);
  at::addmm_out(out, out, ra, rb, beta, 1.0);
}

}  // namespace himoe
