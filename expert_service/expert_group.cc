#include "expert_service/expert_group.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/expert_shape.h"
#include "common/gelu.h"
#include "common/linear.h"
#include "common/matmul.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"
#include "common/weight_init.h"

namespace himoe::expert {
namespace {

// A distinct, stable seed per (seed, layer, expert).
uint64_t ExpertSeed(uint64_t seed, int layer, int64_t expert) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  for (const uint64_t v : {static_cast<uint64_t>(layer), static_cast<uint64_t>(expert)}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
  }
  return h;
}

// nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
at::Tensor Uniform(at::IntArrayRef shape, int64_t fan_in, at::Generator& gen) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return at::empty(shape, at::dtype(at::kFloat)).uniform_(-bound, bound, gen);
}

int ThreadsFor(const at::Tensor& x) { return x.is_cpu() ? at::get_num_threads() : 1; }

// One chunk per thread where ParallelFor splits; otherwise one chunk.
int ChunksFor(const at::Tensor& x) {
  return ParallelForEnabled() && !InParallelRegion() ? ThreadsFor(x) : 1;
}

// One GroupedExpertFfn backward, piece by piece of its row plan: the rows'
// gradient (gh, gx) and the weight gradients. Experts without rows get zero
// weight gradients, as autograd gave them; an expert whose rows two threads
// share sums its two halves after the join.
enum { kW1, kB1, kW2, kB2 };
struct FfnBackward {
  std::vector<std::vector<RowPiece>> plan;
  // x, a, w1q, w2q, gyq: the products' operands (bfloat16 copies with bf16).
  at::Tensor x, w1, w2, w1q, w2q, h, a, gy, gyq, gx;
  bool need_x = false;
  bool bf16 = false;  // the products on bfloat16-rounded operands (MatmulBf16Out)
  std::array<bool, 4> need{};  // kW1..kB2
  std::vector<std::vector<at::Tensor>> gh;   // [chunk][piece]: grad of h
  std::vector<std::vector<at::Tensor>> ghq;  // ... as a product operand

  void MmOut(at::Tensor& out, const at::Tensor& m1, const at::Tensor& m2) const {
    if (bf16) {
      MatmulBf16Out(out, m1, m2, 0.0f);
    } else {
      at::mm_out(out, m1, m2);
    }
  }

  void RowsGrad(size_t t, size_t i) {
    const RowPiece& p = plan[t][i];
    if (!need_x && !need[kW1] && !need[kB1]) return;
    if (bf16) {
      gh[t][i] = at::empty({p.count, w2.size(2)}, gy.options());
      MmOut(gh[t][i], gyq.narrow(0, p.begin, p.count), w2q[p.expert]);
    } else {
      gh[t][i] = at::mm(gy.narrow(0, p.begin, p.count), w2[p.expert]);
    }
    GeluBackwardOut(gh[t][i], gh[t][i], h.narrow(0, p.begin, p.count));
    ghq[t][i] = bf16 ? gh[t][i].to(at::kBFloat16) : gh[t][i];
    if (need_x) {
      at::Tensor o = gx.narrow(0, p.begin, p.count);
      MmOut(o, ghq[t][i], w1q[p.expert]);
    }
  }

  // The weight gradients [kW1, kB1, kW2, kB2] (undefined where not needed);
  // with rows_too, RowsGrad of each piece first, in the same fork-join.
  std::array<at::Tensor, 4> Compute(bool rows_too) {
    std::array<at::Tensor, 4> g;
    if (need[kW1]) g[kW1] = at::zeros_like(w1);
    if (need[kB1]) g[kB1] = at::zeros({w1.size(0), w1.size(1)}, w1.options());
    if (need[kW2]) g[kW2] = at::zeros_like(w2);
    if (need[kB2]) g[kB2] = at::zeros({w2.size(0), w2.size(1)}, w2.options());
    // A shared expert's weight gradients, per piece: [chunk][piece][kW1..kB2].
    std::vector<std::vector<std::array<at::Tensor, 4>>> partial(plan.size());
    for (size_t t = 0; t < plan.size(); ++t) partial[t].resize(plan[t].size());
    const at::ThreadLocalState caller;
    ParallelFor(static_cast<int64_t>(plan.size()), ThreadsFor(x), [&](int64_t t) {
      at::ThreadLocalStateGuard same_state(caller);
      for (size_t i = 0; i < plan[t].size(); ++i) {
        if (rows_too) RowsGrad(t, i);
        const RowPiece& p = plan[t][i];
        std::array<at::Tensor, 4>& part = partial[t][i];
        // Into the gradient itself when the piece is all of the expert's rows.
        const auto out = [&](int k) {
          if (p.whole) return g[k][p.expert];
          part[k] = at::empty_like(g[k][p.expert]);
          return part[k];
        };
        if (need[kW2]) {
          at::Tensor o = out(kW2);
          MmOut(o, gyq.narrow(0, p.begin, p.count).t(), a.narrow(0, p.begin, p.count));
        }
        if (need[kB2]) {
          at::Tensor o = out(kB2);
          at::sum_out(o, gy.narrow(0, p.begin, p.count), at::IntArrayRef{0});
        }
        if (need[kW1]) {
          at::Tensor o = out(kW1);
          MmOut(o, ghq[t][i].t(), x.narrow(0, p.begin, p.count));
        }
        if (need[kB1]) {
          at::Tensor o = out(kB1);
          at::sum_out(o, gh[t][i], at::IntArrayRef{0});
        }
      }
    });
    for (size_t t = 0; t < plan.size(); ++t) {
      for (size_t i = 0; i < plan[t].size(); ++i) {
        for (int k = 0; k < 4; ++k) {
          const at::Tensor& part = partial[t][i][k];
          if (part.defined()) g[k][plan[t][i].expert].add_(part);
        }
      }
    }
    return g;
  }
};

thread_local DeferredWeightGrads* tls_weight_grad_sink = nullptr;

// Every expert's FFN (ExpertFfn) on rows `x` sorted by expert, the rows
// split evenly across the threads (PlanRowChunks), each product on one
// thread (BLIS gains little splitting one [~500,128]x[128,512] product
// across threads: see docs/benchmarks.md, Measurements behind choices in the
// code). Autograd sees one node
// per group and layer, whose backward is split the same way; an expert
// whose rows two threads share sums its weight gradients after the join.
// The worker threads take the caller's thread-local state (grad mode,
// dispatch keys). Under a DeferWeightGradsScope the backward returns the
// rows' gradient and leaves the weight gradients to the scope's sink. With
// `bf16`, every product forward and backward is MatmulBf16Out's, each
// operand rounded once: the rows, the weights and the GELU's output in
// forward (saved so), the incoming gradient and h's in backward.
class GroupedExpertFfn : public torch::autograd::Function<GroupedExpertFfn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                            const at::Tensor& b2, std::vector<int64_t> counts, bool bf16) {
    const auto plan = PlanRowChunks(counts, ChunksFor(x), kMinRowPiece);
    const int64_t d_ff = w1.size(1);
    at::Tensor h = at::empty({x.size(0), d_ff}, x.options());
    at::Tensor a = at::empty_like(h);
    at::Tensor y = at::empty({x.size(0), w2.size(1)}, x.options());
    at::Tensor xq = x, w1q, w2q, aq = a;  // the products' operands
    if (bf16) {
      xq = x.to(at::kBFloat16);
      w1q = w1.to(at::kBFloat16);
      w2q = w2.to(at::kBFloat16);
      aq = at::empty_like(h, at::kBFloat16);
    }
    const at::ThreadLocalState caller;  // grad mode off, as Function::forward set it
    ParallelFor(static_cast<int64_t>(plan.size()), ThreadsFor(x), [&](int64_t t) {
      at::ThreadLocalStateGuard same_state(caller);
      for (const RowPiece& p : plan[t]) {
        const int64_t s = p.expert;
        const at::Tensor x_s = x.narrow(0, p.begin, p.count);
        at::Tensor h_s = h.narrow(0, p.begin, p.count);
        at::Tensor a_s = a.narrow(0, p.begin, p.count);
        at::Tensor y_s = y.narrow(0, p.begin, p.count);
        if (bf16) {
          at::Tensor aq_s = aq.narrow(0, p.begin, p.count);
          h_s.copy_(b1[s]);
          MatmulBf16Out(h_s, xq.narrow(0, p.begin, p.count), w1q[s].t(), 1.0f);
          GeluOut(a_s, h_s);
          aq_s.copy_(a_s);
          y_s.copy_(b2[s]);
          MatmulBf16Out(y_s, aq_s, w2q[s].t(), 1.0f);
        } else if (p.count < RowwiseLinearRows()) {  // Linear's GEMVs
          h_s.copy_(Linear(x_s, w1[s], b1[s]));
          GeluOut(a_s, h_s);
          y_s.copy_(Linear(a_s, w2[s], b2[s]));
        } else {  // at::linear's own product, written in place
          at::addmm_out(h_s, b1[s], x_s, w1[s].t());
          GeluOut(a_s, h_s);
          at::addmm_out(y_s, b2[s], a_s, w2[s].t());
        }
      }
    });
    ctx->save_for_backward({xq, w1, w2, h, aq, b1, b2, w1q, w2q});
    ctx->saved_data["counts"] = std::move(counts);
    ctx->saved_data["bf16"] = bf16;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    auto work = std::make_shared<FfnBackward>();
    FfnBackward& w = *work;
    w.bf16 = ctx->saved_data["bf16"].toBool();
    w.x = saved[0];
    w.w1 = saved[1];
    w.w2 = saved[2];
    w.h = saved[3];
    w.a = saved[4];
    w.w1q = w.bf16 ? saved[7] : w.w1;
    w.w2q = w.bf16 ? saved[8] : w.w2;
    w.plan = PlanRowChunks(ctx->saved_data["counts"].toIntVector(), ChunksFor(w.x), kMinRowPiece);
    w.gy = grads[0].contiguous();
    w.gyq = w.bf16 ? w.gy.to(at::kBFloat16) : w.gy;
    w.need_x = ctx->needs_input_grad(0);
    w.need = {ctx->needs_input_grad(1), ctx->needs_input_grad(2), ctx->needs_input_grad(3),
              ctx->needs_input_grad(4)};
    w.gx = w.need_x ? at::empty(w.x.sizes(), w.h.options()) : at::Tensor();
    w.gh.resize(w.plan.size());
    w.ghq.resize(w.plan.size());
    for (size_t t = 0; t < w.plan.size(); ++t) {
      w.gh[t].resize(w.plan[t].size());
      w.ghq[t].resize(w.plan[t].size());
    }
    DeferredWeightGrads* sink = tls_weight_grad_sink;
    const bool any_weight = std::any_of(w.need.begin(), w.need.end(), [](bool b) { return b; });
    if (sink == nullptr || !any_weight) {
      const std::array<at::Tensor, 4> g = w.Compute(/*rows_too=*/true);
      return {w.gx, g[kW1], g[kB1], g[kW2], g[kB2], at::Tensor(), at::Tensor()};
    }
    // The rows' gradient now; the weight gradients when the sink runs them,
    // into the parameters (leaves, saved as themselves) as autograd would.
    const at::ThreadLocalState caller;
    ParallelFor(static_cast<int64_t>(w.plan.size()), ThreadsFor(w.x), [&](int64_t t) {
      at::ThreadLocalStateGuard same_state(caller);
      for (size_t i = 0; i < w.plan[t].size(); ++i) w.RowsGrad(t, i);
    });
    const std::array<at::Tensor, 4> params = {saved[1], saved[5], saved[2], saved[6]};
    sink->push_back([work, params] {
      at::NoGradGuard no_grad;
      const std::array<at::Tensor, 4> g = work->Compute(/*rows_too=*/false);
      for (int k = 0; k < 4; ++k) {
        if (!g[k].defined()) continue;
        at::Tensor param = params[k];
        at::Tensor& grad = param.mutable_grad();
        if (grad.defined()) {
          grad.add_(g[k]);
        } else {
          grad = g[k];
        }
      }
    });
    return {w.gx,        at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

DeferWeightGradsScope::DeferWeightGradsScope(DeferredWeightGrads* sink)
    : previous_(tls_weight_grad_sink) {
  tls_weight_grad_sink = sink;
}

DeferWeightGradsScope::~DeferWeightGradsScope() { tls_weight_grad_sink = previous_; }

std::vector<std::vector<RowPiece>> PlanRowChunks(const std::vector<int64_t>& counts,
                                                 int chunks, int64_t min_rows) {
  chunks = std::max(chunks, 1);
  std::vector<int64_t> ends;  // ends[s]: one past expert s's last row
  int64_t total = 0;
  for (const int64_t c : counts) ends.push_back(total += c);
  // cuts[i]: the first row of chunk i; cuts[chunks] = total.
  std::vector<int64_t> cuts(chunks + 1, total);
  cuts[0] = 0;
  for (int i = 1; i < chunks; ++i) {
    int64_t cut = (total * i + chunks / 2) / chunks;
    const int64_t s = std::upper_bound(ends.begin(), ends.end(), cut) - ends.begin();
    if (s < static_cast<int64_t>(ends.size())) {
      const int64_t begin = ends[s] - counts[s], end = ends[s];
      if (cut - begin < min_rows || end - cut < min_rows) {
        cut = cut - begin <= end - cut ? begin : end;
      }
    }
    cuts[i] = std::max(cut, cuts[i - 1]);
  }
  std::vector<std::vector<RowPiece>> plan(chunks);
  for (int i = 0; i < chunks; ++i) {
    for (size_t s = 0; s < counts.size(); ++s) {
      const int64_t begin = std::max(ends[s] - counts[s], cuts[i]);
      const int64_t end = std::min(ends[s], cuts[i + 1]);
      if (end <= begin) continue;
      plan[i].push_back({static_cast<int64_t>(s), begin, end - begin, end - begin == counts[s]});
    }
  }
  return plan;
}

at::Tensor ExpertFfn(const at::Tensor& x, const at::Tensor& w1,
                     const at::Tensor& b1, const at::Tensor& w2,
                     const at::Tensor& b2) {
  const at::Tensor h = Linear(x, w1, b1);
  if (at::GradMode::is_enabled() && h.requires_grad()) return Linear(at::gelu(h), w2, b2);
  at::Tensor a = at::empty_like(h);  // no autograd: the GELU GroupedExpertFfn computes
  GeluOut(a, h);
  return Linear(a, w2, b2);
}

absl::StatusOr<std::unique_ptr<ExpertGroup>> ExpertGroup::Create(const v1::ExpertShape& shape,
                                                                 int group_id, int layer,
                                                                 c10::Device device) {
  HIMOE_RETURN_IF_ERROR(ValidateExpertShape(shape));
  if (group_id < 0 || group_id >= shape.num_groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group_id: ", group_id, " is outside [0, ", shape.num_groups(), ")"));
  }
  if (layer < 0 || layer >= shape.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group: layer ", layer, " is outside [0, ", shape.num_layers(), ")"));
  }
  HIMOE_ASSIGN_OR_RETURN(const c10::ScalarType dtype, ScalarTypeFromProto(shape.dtype()));
  std::unique_ptr<ExpertGroup> group(new ExpertGroup(shape, group_id, layer, device, dtype));
  const int64_t d = shape.d_model(), d_ff = shape.d_ff();
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    std::vector<at::Tensor> w1, b1, w2, b2;
    for (int s = 0; s < group->experts_per_group(); ++s) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
          ExpertSeed(shape.seed(), layer, group->first_expert() + s));
      if (shape.init() == v1::WEIGHT_INIT_SWITCH) {
        at::Tensor a = at::empty({d_ff, d}), b = at::empty({d, d_ff});
        SwitchInit_(a, d, gen);
        b.normal_(0.0, ResidualInitStd(shape.n_layer()), gen);
        w1.push_back(a);
        b1.push_back(at::zeros({d_ff}));
        w2.push_back(b);
        b2.push_back(at::zeros({d}));
        continue;
      }
      w1.push_back(Uniform({d_ff, d}, d, gen));
      b1.push_back(Uniform({d_ff}, d, gen));
      w2.push_back(Uniform({d, d_ff}, d_ff, gen));
      b2.push_back(Uniform({d}, d_ff, gen));
    }
    const auto place = [&](const std::vector<at::Tensor>& parts) {
      return at::stack(parts).to(device, dtype).set_requires_grad(true);
    };
    group->w1_ = place(w1);
    group->b1_ = place(b1);
    group->w2_ = place(w2);
    group->b2_ = place(b2);
    return absl::OkStatus();
  }));
  return group;
}

absl::StatusOr<at::Tensor> ExpertGroup::Forward(const at::Tensor& rows,
                                                const at::Tensor& expert_ids) const {
  if (rows.dim() != 2 || rows.size(1) != d_model()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group ", group_id_, ": rows must be [n, d_model=",
        d_model(), "], got [", absl::StrJoin(rows.sizes(), ", "), "]"));
  }
  if (expert_ids.dim() != 1 || expert_ids.size(0) != rows.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group ", group_id_, ": expert_ids must be [n=", rows.size(0),
        "], got [", absl::StrJoin(expert_ids.sizes(), ", "), "]"));
  }
  at::Tensor out;
  if (device_.is_cpu() && !matmul_bf16() && rows.size(0) > 0 &&
      rows.size(0) < RowwiseLinearRows()) {
    return ForwardFewRows(rows, expert_ids);
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const at::Tensor local =
        (expert_ids.to(device_, at::kLong) - first_expert());
    const int s_count = experts_per_group();
    if (local.numel() > 0 &&
        (local.min().item<int64_t>() < 0 || local.max().item<int64_t>() >= s_count)) {
      return IdsOutsideGroupError();
    }
    const at::Tensor x = rows.to(device_, dtype_);
    const at::Tensor counts_t = at::bincount(local, {}, s_count).cpu();
    const std::vector<int64_t> counts(counts_t.data_ptr<int64_t>(),
                                      counts_t.data_ptr<int64_t>() + s_count);
    // The backends send rows sorted by expert; others are sorted here, stably.
    const bool sorted =
        local.numel() < 2 ||
        local.narrow(0, 1, local.numel() - 1).ge(local.narrow(0, 0, local.numel() - 1))
            .all().item<bool>();
    if (sorted) {
      out = GroupedExpertFfn::apply(x, w1_, b1_, w2_, b2_, counts, matmul_bf16());
    } else {
      const at::Tensor order =
          std::get<1>(at::sort(local, /*stable=*/c10::optional<bool>(true), 0, false));
      const at::Tensor y =
          GroupedExpertFfn::apply(x.index_select(0, order), w1_, b1_, w2_, b2_, counts,
                                  matmul_bf16());
      out = at::zeros({rows.size(0), d_model()}, x.options()).index_copy(0, order, y);
    }
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<at::Tensor> ExpertGroup::CombinedForward(const at::Tensor& rows,
                                                        const at::Tensor& assignment_rows,
                                                        const at::Tensor& expert_ids,
                                                        const at::Tensor& weights) const {
  if (assignment_rows.dim() != 1 || !expert_ids.sizes().equals(assignment_rows.sizes()) ||
      !weights.sizes().equals(assignment_rows.sizes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group ", group_id_, ": assignment rows, expert ids and weights must be [n], got [",
        absl::StrJoin(assignment_rows.sizes(), ", "), "], [",
        absl::StrJoin(expert_ids.sizes(), ", "), "], [", absl::StrJoin(weights.sizes(), ", "),
        "]"));
  }
  at::Tensor index, gathered;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    index = assignment_rows.to(rows.device(), at::kLong);
    gathered = rows.index_select(0, index);
    return absl::OkStatus();
  }));
  HIMOE_ASSIGN_OR_RETURN(const at::Tensor y, Forward(gathered, expert_ids));
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    const at::Tensor weighted = y.to(at::kFloat) * weights.to(y.device(), at::kFloat).unsqueeze(1);
    out = at::zeros({rows.size(0), d_model()}, weighted.options())
              .index_add(0, index.to(y.device()), weighted);
    return absl::OkStatus();
  }));
  return out;
}

absl::Status ExpertGroup::IdsOutsideGroupError() const {
  return absl::InvalidArgumentError(absl::StrCat("expert group ", group_id_,
                                                 ": expert ids must be in [", first_expert(),
                                                 ", ", first_expert() + experts_per_group(), ")"));
}

absl::StatusOr<at::Tensor> ExpertGroup::ForwardFewRows(const at::Tensor& rows,
                                                       const at::Tensor& expert_ids) const {
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const at::Tensor ids = expert_ids.to(at::kCPU, at::kLong).contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    // Each expert's rows together (Linear's small products: a row's result
    // is what it is alone), then back in the rows' order.
    std::vector<std::vector<int64_t>> by_expert(experts_per_group());
    for (int64_t i = 0; i < ids.size(0); ++i) {
      const int64_t s = id[i] - first_expert();
      if (s < 0 || s >= experts_per_group()) return IdsOutsideGroupError();
      by_expert[s].push_back(i);
    }
    const at::Tensor x = rows.to(device_, dtype_);
    std::vector<at::Tensor> ys;
    std::vector<int64_t> order;
    for (int s = 0; s < experts_per_group(); ++s) {
      if (by_expert[s].empty()) continue;
      if (static_cast<int64_t>(by_expert[s].size()) == x.size(0)) {  // one expert: in order
        out = ExpertFfn(x, w1_[s], b1_[s], w2_[s], b2_[s]);
        return absl::OkStatus();
      }
      ys.push_back(ExpertFfn(x.index_select(0, at::tensor(by_expert[s], at::kLong)), w1_[s],
                             b1_[s], w2_[s], b2_[s]));
      order.insert(order.end(), by_expert[s].begin(), by_expert[s].end());
    }
    std::vector<int64_t> inverse(order.size());
    for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
    out = at::cat(ys).index_select(0, at::tensor(inverse, at::kLong));
    return absl::OkStatus();
  }));
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ExpertGroup::named_parameters() const {
  return {{"w1", w1_}, {"b1", b1_}, {"w2", w2_}, {"b2", b2_}};
}

std::vector<at::Tensor> ExpertGroup::parameters() const {
  return {w1_, b1_, w2_, b2_};
}

}  // namespace himoe::expert
