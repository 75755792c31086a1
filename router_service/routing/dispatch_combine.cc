#include "router_service/routing/dispatch_combine.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/parallel_for.h"
#include "common/vector_lanes.h"

namespace himoe::router {
namespace {

using lanes::kLanes;
using lanes::Load;
using lanes::Store;
using lanes::V16;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
constexpr int64_t kGrainRows = 64;

// out = sum_j scale[j] * rows[j] (scale null: 1) over d values, in j order;
// zero when n is 0.
HIMOE_CPU_CLONES
void SumRows(float* out, const float* const* rows, const float* scale, int64_t n, int64_t d) {
  if (n == 0) {
    std::memset(out, 0, d * sizeof(float));
    return;
  }
  int64_t c = 0;
  if (scale == nullptr) {
    for (; c + kLanes <= d; c += kLanes) {
      V16 acc = Load(rows[0] + c);
      for (int64_t j = 1; j < n; ++j) acc += Load(rows[j] + c);
      Store(out + c, acc);
    }
    for (; c < d; ++c) {
      float acc = rows[0][c];
      for (int64_t j = 1; j < n; ++j) acc += rows[j][c];
      out[c] = acc;
    }
    return;
  }
  for (; c + kLanes <= d; c += kLanes) {
    V16 acc = scale[0] * Load(rows[0] + c);
    for (int64_t j = 1; j < n; ++j) acc += scale[j] * Load(rows[j] + c);
    Store(out + c, acc);
  }
  for (; c < d; ++c) {
    float acc = scale[0] * rows[0][c];
    for (int64_t j = 1; j < n; ++j) acc += scale[j] * rows[j][c];
    out[c] = acc;
  }
}

HIMOE_CPU_CLONES
void ScaleRow(float* out, const float* in, float scale, int64_t d) {
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) Store(out + c, scale * Load(in + c));
  for (; c < d; ++c) out[c] = scale * in[c];
}

// Sixteen partial sums, then added in lane order, then the tail.
HIMOE_CPU_CLONES
float Dot(const float* a, const float* b, int64_t d) {
  V16 acc{};
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) acc += Load(a + c) * Load(b + c);
  float sum = lanes::Sum(acc);
  for (; c < d; ++c) sum += a[c] * b[c];
  return sum;
}

// Each token's rows across the groups, group by group and in row order:
// row[begin[t]] .. row[begin[t + 1] - 1], indices into the groups' rows laid
// end to end.
struct TokenRowIndex {
  std::vector<int64_t> begin;
  std::vector<int64_t> row;
};

TokenRowIndex IndexRowsByToken(int64_t num_tokens, at::TensorList token_rows) {
  TokenRowIndex index;
  index.begin.assign(num_tokens + 1, 0);
  for (const at::Tensor& rows : token_rows) {
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) {
      TORCH_CHECK(r[i] >= 0 && r[i] < num_tokens, "dispatch: token row ", r[i],
                  " is outside [0, ", num_tokens, ")");
      ++index.begin[r[i] + 1];
    }
  }
  std::partial_sum(index.begin.begin(), index.begin.end(), index.begin.begin());
  index.row.resize(index.begin.back());
  std::vector<int64_t> next(index.begin.begin(), index.begin.end() - 1);
  int64_t base = 0;
  for (const at::Tensor& rows : token_rows) {
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) index.row[next[r[i]]++] = base + i;
    base += rows.numel();
  }
  return index;
}

// The first row of every group's [n_g, d] tensor, laid end to end.
std::vector<const float*> RowPointers(at::TensorList parts, int64_t d) {
  std::vector<const float*> rows;
  for (const at::Tensor& p : parts) {
    const float* data = p.data_ptr<float>();
    for (int64_t i = 0; i < p.size(0); ++i) rows.push_back(data + i * d);
  }
  return rows;
}

// out[t] = sum over the token's rows of scale * row (scale null: 1).
void SumRowsPerToken(const TokenRowIndex& index, const std::vector<const float*>& rows,
                     const std::vector<float>* scale, int64_t d, float* out) {
  const int64_t tokens = static_cast<int64_t>(index.begin.size()) - 1;
  ParallelForRange(0, tokens, kGrainRows, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    std::vector<const float*> mine;
    std::vector<float> weights;
    for (int64_t t = begin; t < end; ++t) {
      mine.clear();
      weights.clear();
      for (int64_t e = index.begin[t]; e < index.begin[t + 1]; ++e) {
        mine.push_back(rows[index.row[e]]);
        if (scale != nullptr) weights.push_back((*scale)[index.row[e]]);
      }
      SumRows(out + t * d, mine.data(), scale != nullptr ? weights.data() : nullptr,
              static_cast<int64_t>(mine.size()), d);
    }
  });
}

std::vector<at::Tensor> Contiguous(at::TensorList ts) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.contiguous());
  return out;
}

class DispatchRows : public torch::autograd::Function<DispatchRows> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               at::TensorList token_rows) {
    const at::Tensor src = x.contiguous();
    const int64_t d = src.size(1);
    const float* data = src.data_ptr<float>();
    variable_list rows;
    for (const at::Tensor& r : token_rows) {
      at::Tensor out = at::empty({r.numel(), d}, src.options());
      const int64_t* t = r.data_ptr<int64_t>();
      float* dst = out.data_ptr<float>();
      const int threads = at::get_num_threads();
      ParallelForRange(0, r.numel(), kGrainRows, threads, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          TORCH_CHECK(t[i] >= 0 && t[i] < src.size(0), "dispatch: token row ", t[i],
                      " is outside [0, ", src.size(0), ")");
          std::memcpy(dst + i * d, data + t[i] * d, d * sizeof(float));
        }
      });
      rows.push_back(std::move(out));
    }
    ctx->save_for_backward(std::vector<at::Tensor>(token_rows.begin(), token_rows.end()));
    ctx->saved_data["tokens"] = src.size(0);
    ctx->saved_data["d"] = d;
    return rows;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list token_rows = ctx->get_saved_variables();
    const int64_t tokens = ctx->saved_data["tokens"].toInt();
    const int64_t d = ctx->saved_data["d"].toInt();
    variable_list out(1 + token_rows.size());
    if (!ctx->needs_input_grad(0)) return out;
    std::vector<at::Tensor> parts;
    for (size_t g = 0; g < grads.size(); ++g) {
      parts.push_back(grads[g].defined()
                          ? grads[g].contiguous()
                          : at::zeros({token_rows[g].numel(), d}, at::kFloat));
    }
    const TokenRowIndex index = IndexRowsByToken(tokens, token_rows);
    at::Tensor gx = at::empty({tokens, d}, at::kFloat);
    SumRowsPerToken(index, RowPointers(parts, d), nullptr, d, gx.data_ptr<float>());
    out[0] = gx;
    return out;
  }
};

// Inputs: the groups' outputs, then their weights, then their token rows.
class CombineRows : public torch::autograd::Function<CombineRows> {
 public:
  static at::Tensor forward(AutogradContext* ctx, at::TensorList outputs, at::TensorList weights,
                            at::TensorList token_rows, int64_t num_tokens) {
    const std::vector<at::Tensor> ys = Contiguous(outputs);
    const std::vector<at::Tensor> ws = Contiguous(weights);
    const int64_t d = ys.front().size(1);
    std::vector<float> scale;
    for (const at::Tensor& w : ws) {
      scale.insert(scale.end(), w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
    }
    at::Tensor out = at::empty({num_tokens, d}, at::kFloat);
    SumRowsPerToken(IndexRowsByToken(num_tokens, token_rows), RowPointers(ys, d), &scale, d,
                    out.data_ptr<float>());
    std::vector<at::Tensor> saved = ys;
    saved.insert(saved.end(), ws.begin(), ws.end());
    saved.insert(saved.end(), token_rows.begin(), token_rows.end());
    ctx->save_for_backward(saved);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t groups = saved.size() / 3;
    variable_list out(3 * groups + 1);
    if (!grads[0].defined()) return out;
    const at::Tensor gout = grads[0].contiguous();
    const int64_t d = gout.size(1);
    const float* go = gout.data_ptr<float>();
    for (size_t g = 0; g < groups; ++g) {
      const at::Tensor& y = saved[g];
      const at::Tensor& w = saved[groups + g];
      const at::Tensor& rows = saved[2 * groups + g];
      const bool need_y = ctx->needs_input_grad(g);
      const bool need_w = ctx->needs_input_grad(groups + g);
      if (!need_y && !need_w) continue;
      const int64_t n = rows.numel();
      at::Tensor gy = need_y ? at::empty({n, d}, at::kFloat) : at::Tensor();
      at::Tensor gw = need_w ? at::empty({n}, at::kFloat) : at::Tensor();
      const int64_t* t = rows.data_ptr<int64_t>();
      const float* yd = y.data_ptr<float>();
      const float* wd = w.data_ptr<float>();
      float* gyd = need_y ? gy.data_ptr<float>() : nullptr;
      float* gwd = need_w ? gw.data_ptr<float>() : nullptr;
      ParallelForRange(0, n, kGrainRows, at::get_num_threads(), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const float* g_t = go + t[i] * d;
          if (gyd != nullptr) ScaleRow(gyd + i * d, g_t, wd[i], d);
          if (gwd != nullptr) gwd[i] = Dot(g_t, yd + i * d, d);
        }
      });
      out[g] = gy;
      out[groups + g] = gw;
    }
    return out;
  }
};

bool HostFloat(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

bool HostRows(const std::vector<GroupDispatch>& groups) {
  return std::all_of(groups.begin(), groups.end(), [](const GroupDispatch& d) {
    return d.token_rows.is_cpu() && d.token_rows.scalar_type() == at::kLong &&
           d.token_rows.dim() == 1;
  });
}

std::vector<at::Tensor> TokenRows(const std::vector<GroupDispatch>& groups) {
  std::vector<at::Tensor> rows;
  for (const GroupDispatch& d : groups) rows.push_back(d.token_rows.contiguous());
  return rows;
}

}  // namespace

std::vector<at::Tensor> DispatchGroupRows(const at::Tensor& x,
                                          const std::vector<GroupDispatch>& groups) {
  if (groups.empty()) return {};
  if (!HostFloat(x) || x.dim() != 2 || !HostRows(groups)) {
    std::vector<at::Tensor> rows;
    for (const GroupDispatch& d : groups) rows.push_back(x.index_select(0, d.token_rows));
    return rows;
  }
  const std::vector<at::Tensor> token_rows = TokenRows(groups);
  return DispatchRows::apply(x, at::TensorList(token_rows));
}

at::Tensor CombineGroupOutputs(int64_t num_tokens, int64_t d_model,
                               const std::vector<GroupDispatch>& groups,
                               const std::vector<at::Tensor>& outputs) {
  const auto device = groups.empty() ? at::Device(at::kCPU)
                                     : groups.front().token_rows.device();
  std::vector<at::Tensor> ys;
  std::vector<at::Tensor> ws;
  bool host = device.is_cpu() && HostRows(groups);
  for (size_t g = 0; g < groups.size(); ++g) {
    ys.push_back(outputs[g].to(device, at::kFloat));
    ws.push_back(groups[g].weights);
    host = host && ys.back().dim() == 2 && ys.back().size(1) == d_model &&
           ys.back().size(0) == groups[g].token_rows.numel() && HostFloat(ws.back()) &&
           ws.back().numel() == groups[g].token_rows.numel();
  }
  if (host && !groups.empty()) {
    const std::vector<at::Tensor> token_rows = TokenRows(groups);
    return CombineRows::apply(at::TensorList(ys), at::TensorList(ws),
                              at::TensorList(token_rows), num_tokens);
  }
  at::Tensor out = at::zeros({num_tokens, d_model}, at::dtype(at::kFloat).device(device));
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].token_rows.numel() == 0) continue;
    out = out.index_add(0, groups[g].token_rows, ys[g] * groups[g].weights.unsqueeze(1));
  }
  return out;
}

DistinctTokens DistinctTokenRows(int64_t num_tokens, const GroupDispatch& d) {
  const at::Tensor token_rows = d.token_rows.to(at::kCPU, at::kLong).contiguous();
  const int64_t n = token_rows.numel();
  const int64_t* token = token_rows.data_ptr<int64_t>();
  std::vector<int64_t> place(num_tokens, -1);
  for (int64_t a = 0; a < n; ++a) place[token[a]] = 0;
  DistinctTokens out;
  int64_t u = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (place[t] == 0) ++u;
  }
  out.tokens = at::empty({u}, at::kLong);
  int64_t* tokens = out.tokens.data_ptr<int64_t>();
  u = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (place[t] < 0) continue;
    tokens[u] = t;
    place[t] = u++;
  }
  out.rows = at::empty({n}, at::kLong);
  int64_t* rows = out.rows.data_ptr<int64_t>();
  for (int64_t a = 0; a < n; ++a) rows[a] = place[token[a]];
  return out;
}

}  // namespace himoe::router
