#include "model/transformer_lm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "common/linear.h"
#include "common/matmul.h"
#include "model/attention.h"
#include "common/profile_scope.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "common/weight_init.h"

namespace himoe::model {
TransformerLM::TransformerLM(const ModelOptions& o, MoELayers* moe) : options_(o), moe_(moe) {
  at::manual_seed(o.seed);
  wte_ = register_module("wte", torch::nn::Embedding(o.vocab_size, o.d_model));
  wpe_ = register_module("wpe", torch::nn::Embedding(o.block_size, o.d_model));
  for (int i = 0; i < o.n_layer; ++i) {
    Block b;
    const std::string p = absl::StrCat("h", i, "_");
    b.ln1 = register_module(p + "ln1", torch::nn::LayerNorm(
                                           torch::nn::LayerNormOptions({o.d_model})));
    b.ln2 = register_module(p + "ln2", torch::nn::LayerNorm(
                                           torch::nn::LayerNormOptions({o.d_model})));
    b.qkv = register_module(p + "qkv", torch::nn::Linear(o.d_model, 3 * o.d_model));
    b.proj = register_module(p + "proj", torch::nn::Linear(o.d_model, o.d_model));
    b.moe = MoeIndex(o, i);
    if (b.moe < 0) {
      b.fc = register_module(p + "fc", torch::nn::Linear(o.d_model, o.dense_ff));
      b.fc_out = register_module(p + "fc_out", torch::nn::Linear(o.dense_ff, o.d_model));
    }
    blocks_.push_back(b);
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  // v1::WeightInit: nanoGPT's N(0, 0.02), or the switch init for the
  // linear weights and the tied head; residual projections either way.
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& t = item.value();
    if (name.find("ln") != std::string::npos) continue;  // LayerNorm keeps 1 / 0
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      t.zero_();
      continue;
    }
    const bool residual = name.find("proj.weight") != std::string::npos ||
                          name.find("fc_out.weight") != std::string::npos;
    if (residual) {
      t.normal_(0.0, ResidualInitStd(o.n_layer));
    } else if (o.init == v1::WEIGHT_INIT_SWITCH && name != "wpe.weight") {
      SwitchInit_(t, t.size(1), gen);
    } else {
      t.normal_(0.0, 0.02);
    }
  }
}

absl::StatusOr<std::shared_ptr<TransformerLM>> TransformerLM::Create(const ModelOptions& o,
                                                                     MoELayers* moe) {
  HIMOE_RETURN_IF_ERROR(ValidateModelOptions(o));
  const int num_moe = NumMoeLayers(o);
  if (moe == nullptr || moe->num_layers() != num_moe ||
      moe->num_groups() != o.routing.num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: the MoE layers must be ", num_moe, " layers of ", o.routing.num_groups,
        " groups"));
  }
  for (int m = 0; m < num_moe; ++m) {
    const router::RouterLayer& r = moe->router(m);
    if (r.d_model() != o.d_model || r.config().num_experts != o.routing.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model: MoE layer ", m, "'s router has d_model ", r.d_model(), ", N ",
          r.config().num_experts, "; the model has d_model ", o.d_model, ", N ",
          o.routing.num_experts));
    }
  }
  std::shared_ptr<TransformerLM> model;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    model.reset(new TransformerLM(o, moe));
    for (int m = 0; m < num_moe; ++m) {
      router::RouterLayer& r = moe->router(m);
      const std::string p = absl::StrCat("moe", m, "_");
      model->register_parameter(p + "gate", r.gate_weight());
      model->register_buffer(p + "logit_ema", r.logit_ema());
      model->register_buffer(p + "loss_free_bias", r.loss_free_bias());
      model->register_buffer(p + "balance_upper", r.balance().upper);
      model->register_buffer(p + "balance_lower", r.balance().lower);
      model->register_buffer(p + "balance_multiplier", r.balance().loss_multiplier);
      model->register_buffer(p + "lambda_intra", r.lambda_intra());
      model->register_buffer(p + "lambda_inter", r.lambda_inter());
      model->register_buffer(p + "route_calls", r.route_calls());
      if (r.router_scale().defined()) model->register_parameter(p + "router_scale", r.router_scale());
    }
    return absl::OkStatus();
  }));
  return model;
}

at::Tensor TransformerLM::Attention(Block& b, const at::Tensor& x) {
  HIMOE_PROFILE_SCOPE("attention");
  return Project(b.proj, CausalSelfAttention(Project(b.qkv, x), options_.n_head));
}

at::Tensor TransformerLM::Project(torch::nn::Linear& linear, const at::Tensor& x) {
  if (options_.matmul_dtype == v1::DTYPE_BFLOAT16) {
    return LinearBf16(x, linear->weight, linear->bias);
  }
  return linear->forward(x);
}

std::unique_ptr<KvCachePool> TransformerLM::NewKvCachePool() const {
  return std::make_unique<KvCachePool>(static_cast<int>(blocks_.size()), options_.block_size,
                                       options_.d_model);
}

at::Tensor TransformerLM::CachedAttention(KvCachePool& pool, size_t index, const at::Tensor& q,
                                          int slot, int64_t past) {
  const int64_t n = q.size(0), C = options_.d_model, H = options_.n_head;
  const int64_t keys = past + n;
  const auto heads = [&](const at::Tensor& t, int64_t rows) {
    return t.view({rows, H, C / H}).transpose(0, 1);  // [H, rows, C/H]
  };
  const at::Tensor k = heads(pool.keys(index).select(0, slot).narrow(0, 0, keys), keys);
  const at::Tensor v = heads(pool.values(index).select(0, slot).narrow(0, 0, keys), keys);
  at::Tensor att =
      at::matmul(heads(q, n), k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C / H));
  // Query i sits at position past + i: it sees keys 0 .. past + i.
  const at::Tensor mask = at::ones({n, keys}, q.options().dtype(at::kBool)).triu(past + 1);
  att = at::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  return at::matmul(att, v).transpose(0, 1).contiguous().view({n, C});
}

at::Tensor TransformerLM::BatchedCachedAttention(KvCachePool& pool, size_t index,
                                                 const at::Tensor& q, const at::Tensor& slots,
                                                 int64_t keys, const at::Tensor& key_mask) {
  const int64_t S = q.size(0), C = options_.d_model, H = options_.n_head;
  const auto gather = [&](at::Tensor& pooled) {  // [S, H, keys, C/H]
    return pooled.narrow(1, 0, keys).index_select(0, slots).view({S, keys, H, C / H}).transpose(1, 2);
  };
  const at::Tensor k = gather(pool.keys(index));
  const at::Tensor v = gather(pool.values(index));
  at::Tensor att = at::matmul(q.view({S, H, 1, C / H}), k.transpose(-2, -1)) /
                   std::sqrt(static_cast<double>(C / H));  // [S, H, 1, keys]
  if (key_mask.defined()) att = att.masked_fill(key_mask, -std::numeric_limits<float>::infinity());
  att = at::softmax(att, -1);
  return at::matmul(att, v).view({S, C});  // [S, H, 1, C/H] -> [S, C]
}

absl::StatusOr<at::Tensor> TransformerLM::DecodeStep(
    const std::vector<std::vector<int64_t>>& tokens, const std::vector<KvCache*>& caches) {
  if (tokens.empty() || tokens.size() != caches.size()) {
    return absl::InvalidArgumentError("model: DecodeStep needs one cache per sequence");
  }
  KvCachePool* pool = caches[0] == nullptr ? nullptr : caches[0]->pool();
  MoECall call;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const int64_t n = static_cast<int64_t>(tokens[s].size());
    if (caches[s] == nullptr || pool == nullptr || caches[s]->pool() != pool) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model: sequence ", s, " has no cache of the first sequence's pool"));
    }
    if (n < 1 || caches[s]->length + n > options_.block_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model: sequence ", s, " needs 1 to ", options_.block_size,
          " tokens in all (cache ", caches[s]->length, " + ", n, ")"));
    }
    for (const int64_t t : tokens[s]) {
      if (t < 0 || t >= options_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("model: token ", t, " is not in [0, ",
                                                       options_.vocab_size, ")"));
      }
    }
    call.segments.push_back(n);
  }
  const size_t S = tokens.size();
  at::Tensor logits;
  at::NoGradGuard no_grad;
  ModelOutput unused;
  const at::Tensor zero = at::zeros({});
  unused.aux = {zero, zero, zero, zero, zero};
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    // Rows of every sequence's new tokens, in order; each row's cache place.
    std::vector<int64_t> ids, positions, row_slots, last;
    // The sequences adding one token (attending together) and the rest.
    std::vector<int64_t> single_rows, single_slots, single_lengths, fresh;
    std::vector<size_t> multi;
    int64_t rows = 0, max_rows = 0;
    int max_slot = 0;
    for (size_t s = 0; s < S; ++s) {
      const int64_t past = caches[s]->length, n = call.segments[s];
      if (past == 0) fresh.push_back(caches[s]->slot());
      for (int64_t i = 0; i < n; ++i) {
        ids.push_back(tokens[s][i]);
        positions.push_back(past + i);
        row_slots.push_back(caches[s]->slot());
      }
      if (n == 1) {
        single_rows.push_back(rows);
        single_slots.push_back(caches[s]->slot());
        single_lengths.push_back(past + 1);
      } else {
        multi.push_back(s);
      }
      rows += n;
      last.push_back(rows - 1);
      max_rows = std::max(max_rows, past + n);
      max_slot = std::max(max_slot, caches[s]->slot());
    }
    const auto on_device = [&](const std::vector<int64_t>& v) {
      return at::tensor(v, at::kLong).to(wte_->weight.device());
    };
    const at::Tensor id_t = on_device(ids), position_t = on_device(positions),
                     slot_t = on_device(row_slots), single_row_t = on_device(single_rows),
                     fresh_t = on_device(fresh);
    at::Tensor x = wte_->forward(id_t) + wpe_->forward(position_t);  // [R, C]
    pool->Reserve(max_slot + 1, max_rows, x.options());
    // The project's loops read each one-token sequence's rows by its slot and
    // length. Elsewhere they attend to their longest length's keys, gathered;
    // those past a sequence's own length (another sequence's, or none) get
    // weight 0.
    const bool decode_loops = DecodeAttentionApplies(x, pool->keys(0), options_.n_head);
    at::Tensor single_slot_t, single_mask;
    int64_t single_keys = 0;
    if (!decode_loops && !single_lengths.empty()) {
      single_slot_t = on_device(single_slots);
      single_keys = *std::max_element(single_lengths.begin(), single_lengths.end());
      if (std::any_of(single_lengths.begin(), single_lengths.end(),
                      [&](int64_t l) { return l != single_keys; })) {
        const at::Tensor length =
            on_device(single_lengths).view({static_cast<int64_t>(single_lengths.size()), 1, 1, 1});
        single_mask =
            at::arange(single_keys, length.options()).view({1, 1, 1, single_keys}) >= length;
      }
    }
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& b = blocks_[i];
      const auto qkv = Linear(b.ln1->forward(x), b.qkv->weight, b.qkv->bias)
                           .split(options_.d_model, 1);  // [R, C] x 3
      if (!fresh.empty()) {
        // Sequences starting over: no stale values where a mask reads (a
        // masked weight is 0, but 0 * NaN is not).
        pool->keys(i).index_fill_(0, fresh_t, 0);
        pool->values(i).index_fill_(0, fresh_t, 0);
      }
      pool->keys(i).index_put_({slot_t, position_t}, qkv[1]);
      pool->values(i).index_put_({slot_t, position_t}, qkv[2]);
      const auto single_attention = [&](const at::Tensor& q) {
        if (decode_loops) {
          return DecodeAttention(q, pool->keys(i), pool->values(i), single_slots, single_lengths,
                                 options_.n_head);
        }
        return BatchedCachedAttention(*pool, i, q, single_slot_t, single_keys, single_mask);
      };
      at::Tensor attended;
      if (multi.empty()) {
        attended = single_attention(qkv[0]);
      } else {
        attended = at::empty({rows, options_.d_model}, x.options());
        if (!single_rows.empty()) {
          attended.index_copy_(0, single_row_t,
                               single_attention(qkv[0].index_select(0, single_row_t)));
        }
        for (const size_t s : multi) {
          const int64_t first = last[s] - call.segments[s] + 1;
          attended.narrow(0, first, call.segments[s])
              .copy_(CachedAttention(*pool, i, qkv[0].narrow(0, first, call.segments[s]),
                                     caches[s]->slot(), caches[s]->length));
        }
      }
      x = x + Linear(attended, b.proj->weight, b.proj->bias);
      const at::Tensor n = b.ln2->forward(x);
      if (b.moe >= 0) {
        HIMOE_ASSIGN_OR_RETURN(at::Tensor y, MoeFfn(b.moe, n, call, &unused));
        x = x + y;
      } else {
        x = x + Linear(at::gelu(Linear(n, b.fc->weight, b.fc->bias)), b.fc_out->weight,
                       b.fc_out->bias);
      }
    }
    for (size_t s = 0; s < S; ++s) caches[s]->length += call.segments[s];
    const at::Tensor tail = x.index_select(0, on_device(last));  // [S, C]
    logits = Linear(ln_f_->forward(tail), wte_->weight, at::Tensor()).to(at::kFloat);
    return absl::OkStatus();
  }));
  return logits;
}

absl::StatusOr<at::Tensor> TransformerLM::MoeFfn(int moe, const at::Tensor& x,
                                                 const MoECall& call, ModelOutput* out) {
  const at::Tensor h = x.reshape({-1, options_.d_model});
  HIMOE_ASSIGN_OR_RETURN(router::MoEOutput y, moe_->Forward(moe, h, call));
  const router::RoutingLosses& l = y.routing.losses;
  const auto add = [](at::Tensor& sum, const at::Tensor& term) {
    if (term.defined()) sum = sum + term;
  };
  add(out->aux.load, l.load);
  add(out->aux.intra, l.intra);
  add(out->aux.inter, l.inter);
  add(out->aux.z, l.z);
  add(out->aux.balance, l.balance);
  out->stats.push_back(std::move(y.routing.stats));
  return y.output.view(x.sizes());
}

absl::StatusOr<ModelOutput> TransformerLM::Forward(const at::Tensor& idx, const at::Tensor& targets,
                                                   uint64_t step, uint32_t micro_batch,
                                                   bool training) {
  if (idx.dim() != 2 || idx.size(1) > options_.block_size || idx.size(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model: input must be [B, T <= ",
                                                   options_.block_size, "]"));
  }
  const MoECall call{step, micro_batch, training, /*segments=*/{}};
  ModelOutput out;
  const at::Tensor zero = at::zeros({});
  out.aux = {zero, zero, zero, zero, zero};
  absl::Status status = CatchTorchErrors([&]() -> absl::Status {
    const int64_t T = idx.size(1);
    at::Tensor x;
    {
      HIMOE_PROFILE_SCOPE("embedding");
      x = wte_->forward(idx) + wpe_->forward(at::arange(T, idx.options()));
    }
    for (Block& b : blocks_) {
      HIMOE_PROFILE_SCOPE("layer norm, residual");
      x = x + Attention(b, b.ln1->forward(x));
      const at::Tensor n = b.ln2->forward(x);
      if (b.moe >= 0) {
        HIMOE_ASSIGN_OR_RETURN(at::Tensor y, MoeFfn(b.moe, n, call, &out));
        x = x + y;
      } else {
        HIMOE_PROFILE_SCOPE("dense FFN");
        x = x + Project(b.fc_out, at::gelu(Project(b.fc, n)));
      }
    }
    HIMOE_PROFILE_SCOPE("LM head, loss");
    const at::Tensor head_in = ln_f_->forward(x);  // the head is tied to wte
    out.logits = options_.matmul_dtype == v1::DTYPE_BFLOAT16
                     ? LinearBf16(head_in, wte_->weight, at::Tensor())
                     : at::linear(head_in, wte_->weight);
    if (targets.defined()) {
      out.task_loss = at::cross_entropy_loss(out.logits.view({-1, options_.vocab_size}),
                                             targets.reshape(-1));
    }
    return absl::OkStatus();
  });
  HIMOE_RETURN_IF_ERROR(status);
  return out;
}

std::vector<at::Tensor> TransformerLM::DecayedParameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters()) {
    if (p.dim() >= 2) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> TransformerLM::UndecayedParameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters()) {
    if (p.dim() < 2) out.push_back(p);
  }
  return out;
}

}  // namespace himoe::model
