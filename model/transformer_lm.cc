#include "model/transformer_lm.h"

#include <cmath>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/profile_scope.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::model {

TransformerLM::TransformerLM(const ModelOptions& o, MoELayers* moe) : options_(o), moe_(moe) {
  torch::manual_seed(o.seed);
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
  // nanoGPT init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer).
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& t = item.value();
    if (name.find("ln") != std::string::npos) continue;  // LayerNorm keeps 1 / 0
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      t.zero_();
    } else {
      const bool residual = name.find("proj.weight") != std::string::npos ||
                            name.find("fc_out.weight") != std::string::npos;
      t.normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * o.n_layer) : 0.02);
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
      model->register_buffer(p + "route_calls", r.route_calls());
      if (r.router_scale().defined()) model->register_parameter(p + "router_scale", r.router_scale());
    }
    return absl::OkStatus();
  }));
  return model;
}

at::Tensor TransformerLM::Attention(Block& b, const at::Tensor& x) {
  HIMOE_PROFILE_SCOPE("attention");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = options_.n_head;
  const auto qkv = b.qkv->forward(x).split(C, 2);
  const auto heads = [&](const at::Tensor& t) {
    return t.view({B, T, H, C / H}).transpose(1, 2);
  };
  const at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C / H));
  const at::Tensor mask = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  const at::Tensor y = at::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
  return b.proj->forward(y);
}

at::Tensor TransformerLM::CachedAttention(size_t index, const at::Tensor& qkv, KvCache& cache) {
  const int64_t n = qkv.size(0), C = options_.d_model, H = options_.n_head;
  const int64_t past = cache.length;
  const auto parts = qkv.split(C, 1);
  const auto heads = [&](const at::Tensor& t) {
    return t.view({1, n, H, C / H}).transpose(1, 2);
  };
  const at::Tensor q = heads(parts[0]);
  at::Tensor& k = cache.k[index];
  at::Tensor& v = cache.v[index];
  k = k.defined() ? at::cat({k, heads(parts[1])}, 2) : heads(parts[1]).contiguous();
  v = v.defined() ? at::cat({v, heads(parts[2])}, 2) : heads(parts[2]).contiguous();
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C / H));
  // Query i sits at position past + i: it sees keys 0 .. past + i.
  const at::Tensor mask = at::ones({n, past + n}, qkv.options().dtype(at::kBool)).triu(past + 1);
  att = at::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  return at::matmul(att, v).transpose(1, 2).contiguous().view({n, C});
}

absl::StatusOr<at::Tensor> TransformerLM::DecodeStep(
    const std::vector<std::vector<int64_t>>& tokens, const std::vector<KvCache*>& caches) {
  if (tokens.empty() || tokens.size() != caches.size()) {
    return absl::InvalidArgumentError("model: DecodeStep needs one cache per sequence");
  }
  MoECall call;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const int64_t n = static_cast<int64_t>(tokens[s].size());
    if (n < 1 || caches[s] == nullptr || caches[s]->length + n > options_.block_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model: sequence ", s, " needs 1 to ", options_.block_size,
          " tokens in all (cache ", caches[s] == nullptr ? 0 : caches[s]->length, " + ", n, ")"));
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
  torch::NoGradGuard no_grad;
  ModelOutput unused;
  const at::Tensor zero = at::zeros({});
  unused.aux = {zero, zero, zero, zero, zero};
  // Row-wise work (embeddings, norms, projections, FFNs) runs once over every
  // sequence's new rows; only the attention core is per sequence.
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    std::vector<int64_t> ids, positions, last;
    int64_t rows = 0;
    for (size_t s = 0; s < S; ++s) {
      const int64_t past = caches[s]->length;
      for (size_t i = 0; i < tokens[s].size(); ++i) {
        ids.push_back(tokens[s][i]);
        positions.push_back(past + static_cast<int64_t>(i));
      }
      rows += call.segments[s];
      last.push_back(rows - 1);
      caches[s]->k.resize(blocks_.size());
      caches[s]->v.resize(blocks_.size());
    }
    at::Tensor x = wte_->forward(at::tensor(ids, at::kLong)) +
                   wpe_->forward(at::tensor(positions, at::kLong));  // [R, C]
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& b = blocks_[i];
      const at::Tensor qkv = b.qkv->forward(b.ln1->forward(x));  // [R, 3C]
      std::vector<at::Tensor> attended;
      int64_t offset = 0;
      for (size_t s = 0; s < S; ++s) {
        attended.push_back(CachedAttention(i, qkv.narrow(0, offset, call.segments[s]),
                                           *caches[s]));
        offset += call.segments[s];
      }
      x = x + b.proj->forward(S == 1 ? attended[0] : at::cat(attended));
      const at::Tensor n = b.ln2->forward(x);
      if (b.moe >= 0) {
        HIMOE_ASSIGN_OR_RETURN(at::Tensor y, MoeFfn(b.moe, n, call, &unused));
        x = x + y;
      } else {
        x = x + b.fc_out->forward(at::gelu(b.fc->forward(n)));
      }
    }
    for (size_t s = 0; s < S; ++s) caches[s]->length += call.segments[s];
    const at::Tensor tail = x.index_select(0, at::tensor(last, at::kLong));  // [S, C]
    logits = at::linear(ln_f_->forward(tail), wte_->weight).to(at::kFloat);
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
  const MoECall call{step, micro_batch, training};
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
        x = x + b.fc_out->forward(at::gelu(b.fc->forward(n)));
      }
    }
    HIMOE_PROFILE_SCOPE("LM head, loss");
    out.logits = at::linear(ln_f_->forward(x), wte_->weight);  // tied head
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
