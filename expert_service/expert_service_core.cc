#include "expert_service/expert_service_core.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/util/delimited_message_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"

namespace himoe::expert {
namespace {

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsFloatingWireType(c10::ScalarType type) {
  return type == c10::kFloat || type == c10::kBFloat16 || type == c10::kHalf;
}

// Byte count of a (dtype, shape) as declared in a StateChunk.
absl::StatusOr<int64_t> DeclaredBytes(const std::string& name,
                                      c10::ScalarType type,
                                      at::IntArrayRef shape) {
  int64_t bytes = c10::elementSize(type);
  for (const int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(bytes, s, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state '", name, "': shape ", ShapeString(shape),
          " is invalid (negative or overflowing)"));
    }
  }
  return bytes;
}

}  // namespace

ExpertServiceCore::ExpertServiceCore(const ExpertServiceOptions& options)
    : options_(options),
      experts_per_group_(options.num_experts / options.num_groups) {}

absl::StatusOr<std::unique_ptr<ExpertServiceCore>> ExpertServiceCore::Create(
    const ExpertServiceOptions& o) {
  if (o.num_groups < 1 || o.num_experts < 1 || o.num_experts % o.num_groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_experts: ", o.num_experts, " must be a positive multiple of num_groups (",
        o.num_groups, ")"));
  }
  if (o.group_id < 0 || o.group_id >= o.num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group_id: ", o.group_id, " is outside [0, ", o.num_groups, ")"));
  }
  if (o.num_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers: ", o.num_layers, "; expected >= 1"));
  }
  if (o.d_model < 1 || o.d_ff < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "d_model, d_ff: expected >= 1, got ", o.d_model, ", ", o.d_ff));
  }
  if (o.dtype != c10::kFloat && o.dtype != c10::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype: ", c10::toString(o.dtype), "; expected float32 or bfloat16"));
  }
  if (o.max_tokens_per_request < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens_per_request: ", o.max_tokens_per_request, "; expected >= 1"));
  }
  if (o.saved_state_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "saved_state_ttl: ", absl::FormatDuration(o.saved_state_ttl), "; expected >= 0"));
  }
  std::unique_ptr<ExpertServiceCore> core(new ExpertServiceCore(o));
  const int s = core->experts_per_group_;
  for (int layer = 0; layer < o.num_layers; ++layer) {
    // Must match router_service/local_moe.cc's GroupOptionsFor.
    ExpertGroupOptions g;
    g.group_id = o.group_id;
    g.experts_per_group = s;
    g.d_model = o.d_model;
    g.d_ff = o.d_ff;
    g.layer = layer;
    g.seed = o.seed;
    g.device = o.device;
    g.dtype = o.dtype;
    ASSIGN_OR_RETURN(auto group, ExpertGroup::Create(g));
    for (const auto& [name, tensor] : group->named_parameters()) {
      core->parameters_.emplace(absl::StrCat("layer", layer, ".", name), tensor);
    }
    core->groups_.push_back(std::move(group));
  }
  std::vector<ExpertGroup*> groups;
  for (const auto& g : core->groups_) groups.push_back(g.get());
  ASSIGN_OR_RETURN(core->optimizer_, ExpertOptimizer::Create(std::move(groups)));
  core->tokens_.reset(new std::atomic<int64_t>[o.num_layers * s]);
  for (int i = 0; i < o.num_layers * s; ++i) core->tokens_[i] = 0;
  return core;
}

const ExpertGroup* ExpertServiceCore::group(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(groups_.size())) return nullptr;
  return groups_[layer].get();
}

ExpertServiceInfo ExpertServiceCore::Info() const {
  SweepExpiredSaved();
  ExpertServiceInfo info;
  info.group_id = options_.group_id;
  info.num_groups = options_.num_groups;
  info.num_experts = options_.num_experts;
  for (int s = 0; s < experts_per_group_; ++s) info.expert_ids.push_back(first_expert() + s);
  for (int l = 0; l < options_.num_layers; ++l) info.layers.push_back(l);
  info.d_model = options_.d_model;
  info.d_ff = options_.d_ff;
  info.dtype = options_.dtype;
  info.device = options_.device.str();
  info.version = kExpertServiceVersion;
  info.pending_saved = pending_saved();
  info.last_applied_step = last_applied_step();
  return info;
}

void ExpertServiceCore::FillInfo(v1::ExpertInfoResponse* response) const {
  const ExpertServiceInfo info = Info();
  response->Clear();
  response->set_group_id(info.group_id);
  for (const int e : info.expert_ids) response->add_expert_ids(e);
  for (const int l : info.layers) response->add_layers(l);
  response->set_d_model(info.d_model);
  response->set_d_ff(info.d_ff);
  // The options only admit float32 and bfloat16, which both have an encoding.
  response->set_dtype(DTypeToProto(info.dtype).value_or(v1::DTYPE_UNSPECIFIED));
  response->set_device(info.device);
  response->set_version(info.version);
  response->set_num_experts(info.num_experts);
  response->set_num_groups(info.num_groups);
  response->set_pending_saved(info.pending_saved);
  response->set_last_applied_step(info.last_applied_step);
}

bool ExpertServiceCore::SavedKey::operator<(const SavedKey& o) const {
  return std::tie(step, micro_batch, layer, request_id) <
         std::tie(o.step, o.micro_batch, o.layer, o.request_id);
}

std::string ExpertServiceCore::SavedKey::DebugString() const {
  return absl::StrCat("(step=", step, ", micro_batch=", micro_batch, ", layer=", layer,
                      ", request_id=", request_id, ")");
}

int64_t ExpertServiceCore::pending_saved() const {
  std::lock_guard<std::mutex> lock(saved_mutex_);
  return static_cast<int64_t>(saved_.size());
}

void ExpertServiceCore::SweepExpiredSaved() const {
  const auto now = std::chrono::steady_clock::now();
  const auto ttl = absl::ToChronoNanoseconds(options_.saved_state_ttl);
  std::vector<SavedForward> expired;  // graphs are freed outside the lock
  {
    std::lock_guard<std::mutex> lock(saved_mutex_);
    for (auto it = saved_.begin(); it != saved_.end();) {
      if (now - it->second.created >= ttl) {
        expired.push_back(std::move(it->second));
        it = saved_.erase(it);
      } else {
        ++it;
      }
    }
  }
  saved_expired_.fetch_add(static_cast<int64_t>(expired.size()), std::memory_order_relaxed);
}

absl::Status ExpertServiceCore::Forward(const v1::ExpertForwardRequest& request,
                                        v1::ExpertForwardResponse* response) {
  forward_requests_.fetch_add(1, std::memory_order_relaxed);
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = ForwardImpl(request, response);
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  if (forward_observer_) {
    forward_observer_(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  if (!status.ok()) {
    forward_failures_.fetch_add(1, std::memory_order_relaxed);
    response->Clear();
  }
  return status;
}

absl::Status ExpertServiceCore::ForwardImpl(const v1::ExpertForwardRequest& request,
                                              v1::ExpertForwardResponse* response) {
  response->Clear();
  SweepExpiredSaved();
  for (const v1::ExpertRows& in : request.inputs()) {
    bytes_in_.fetch_add(static_cast<int64_t>(in.rows().data().size()),
                        std::memory_order_relaxed);
  }
  const int layer = request.layer();
  const ExpertGroup* group = this->group(layer);
  if (group == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", layer, " is not served; layers are [0, ", options_.num_layers, ")"));
  }
  const int n_inputs = request.inputs_size();
  if (n_inputs == 0) {
    return absl::InvalidArgumentError(
        "inputs: the request is empty; expected at least one ExpertRows");
  }

  // Cheap size check on the declared shapes before decoding anything.
  const int64_t max_tokens = options_.max_tokens_per_request;
  int64_t declared_rows = 0;
  for (const v1::ExpertRows& in : request.inputs()) {
    if (in.rows().shape_size() != 2 || in.rows().shape(0) < 0) continue;
    if (__builtin_add_overflow(declared_rows, in.rows().shape(0), &declared_rows)) {
      declared_rows = INT64_MAX;
    }
  }
  if (declared_rows > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: ", declared_rows, " rows in total exceed max_tokens_per_request=",
        max_tokens));
  }

  const int first = first_expert();
  const int end = first + experts_per_group_;
  std::vector<at::Tensor> rows(n_inputs);
  int64_t total_rows = 0;
  for (int i = 0; i < n_inputs; ++i) {
    const v1::ExpertRows& in = request.inputs(i);
    const std::string field = absl::StrCat("inputs[", i, "]");
    if (in.expert_id() < first || in.expert_id() >= end) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".expert_id: ", in.expert_id(), " is outside group ",
          options_.group_id, "; expected an expert id in [", first, ", ", end, ")"));
    }
    ASSIGN_OR_RETURN(rows[i], DecodeTensor(in.rows(), field + ".rows"));
    const at::Tensor& x = rows[i];
    if (!IsFloatingWireType(x.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".rows.dtype: ", c10::toString(x.scalar_type()),
          " is not a floating type; expected FLOAT32 or BFLOAT16"));
    }
    if (x.dim() != 2 || x.size(1) != options_.d_model) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".rows: expected shape [n, ", options_.d_model,
          "] (2-D, d_model=", options_.d_model, "), got ", ShapeString(x.sizes())));
    }
    bool finite = true;
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      finite = x.numel() == 0 || at::isfinite(x).all().item<bool>();
      return absl::OkStatus();
    }));
    if (!finite) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".rows contains NaN or Inf"));
    }
    total_rows += x.size(0);
  }
  if (total_rows == 0) {
    return absl::InvalidArgumentError(
        "inputs: the request has no rows; expected at least one row");
  }

  const bool save = request.save_for_backward();
  const SavedKey key{request.step(), request.micro_batch(), layer, request.request_id()};
  const auto already_saved = [&] {
    return absl::AlreadyExistsError(absl::StrCat(
        "save_for_backward: a saved Forward ", key.DebugString(),
        " exists already; each key is used once per step"));
  };
  if (save) {
    std::lock_guard<std::mutex> saved_lock(saved_mutex_);
    if (saved_.count(key) > 0) return already_saved();
  }

  SavedForward saved;
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    // With grad for a later Backward; the rows become one leaf.
    at::AutoGradMode grad_mode(save);
    std::vector<at::Tensor> xs, ids;
    xs.reserve(n_inputs);
    ids.reserve(n_inputs);
    for (int i = 0; i < n_inputs; ++i) {
      xs.push_back(rows[i].to(options_.device, options_.dtype));
      ids.push_back(at::full({rows[i].size(0)}, request.inputs(i).expert_id(),
                             at::dtype(at::kLong).device(options_.device)));
    }
    at::Tensor x = at::cat(xs);
    if (save) x = x.detach().requires_grad_(true);
    ASSIGN_OR_RETURN(const at::Tensor y, group->Forward(x, at::cat(ids)));
    if (save) {
      saved.input = x;
      saved.output = y;
      saved.weights_version = weights_version_.load(std::memory_order_relaxed);
      for (int i = 0; i < n_inputs; ++i) {
        saved.expert_ids.push_back(request.inputs(i).expert_id());
        saved.rows.push_back(rows[i].size(0));
      }
    }
    int64_t offset = 0;
    for (int i = 0; i < n_inputs; ++i) {
      const int64_t n = rows[i].size(0);
      v1::ExpertRows* out = response->add_outputs();
      out->set_expert_id(request.inputs(i).expert_id());
      RETURN_IF_ERROR(EncodeTensor(y.detach().narrow(0, offset, n).to(rows[i].scalar_type()),
                                   out->mutable_rows()));
      offset += n;
    }
    return absl::OkStatus();
  }));
  lock.unlock();
  if (save) {
    saved.created = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> saved_lock(saved_mutex_);
    if (!saved_.emplace(key, std::move(saved)).second) return already_saved();
  }

  int64_t out_bytes = 0;
  for (int i = 0; i < n_inputs; ++i) {
    const int local = request.inputs(i).expert_id() - first;
    tokens_[layer * experts_per_group_ + local].fetch_add(
        rows[i].size(0), std::memory_order_relaxed);
    out_bytes += static_cast<int64_t>(response->outputs(i).rows().data().size());
  }
  bytes_out_.fetch_add(out_bytes, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::Backward(const v1::ExpertBackwardRequest& request,
                                         v1::ExpertBackwardResponse* response) {
  response->Clear();
  const SavedKey key{request.step(), request.micro_batch(), request.layer(),
                     request.request_id()};
  SavedForward saved;
  {
    std::lock_guard<std::mutex> lock(saved_mutex_);
    auto node = saved_.extract(key);
    if (node.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "Backward: no saved Forward ", key.DebugString(),
          "; it was never saved with save_for_backward, already consumed, aborted or "
          "expired"));
    }
    saved = std::move(node.mapped());
  }
  // `saved` (and its graph) is freed on every path out of here.
  absl::Status status = BackwardImpl(key, saved, request, response);
  if (!status.ok()) response->Clear();
  return status;
}

absl::Status ExpertServiceCore::BackwardImpl(const SavedKey& key, SavedForward& saved,
                                             const v1::ExpertBackwardRequest& request,
                                             v1::ExpertBackwardResponse* response) {
  const int n = request.output_grads_size();
  if (n != static_cast<int>(saved.expert_ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output_grads: ", n, " entries; the saved Forward ", key.DebugString(), " has ",
        saved.expert_ids.size(), " outputs"));
  }
  std::vector<at::Tensor> grads(n);
  for (int i = 0; i < n; ++i) {
    const v1::ExpertRows& g = request.output_grads(i);
    const std::string field = absl::StrCat("output_grads[", i, "]");
    if (g.expert_id() != saved.expert_ids[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".expert_id: ", g.expert_id(), "; expected ", saved.expert_ids[i],
          " (outputs[", i, "] of the saved Forward)"));
    }
    ASSIGN_OR_RETURN(grads[i], DecodeTensor(g.rows(), field + ".rows"));
    const at::Tensor& t = grads[i];
    if (!IsFloatingWireType(t.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".rows.dtype: ", c10::toString(t.scalar_type()),
          " is not a floating type; expected FLOAT32 or BFLOAT16"));
    }
    if (t.dim() != 2 || t.size(0) != saved.rows[i] || t.size(1) != options_.d_model) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".rows: expected shape [", saved.rows[i], ", ", options_.d_model,
          "] (the saved output's), got ", ShapeString(t.sizes())));
    }
    bool finite = true;
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      finite = t.numel() == 0 || at::isfinite(t).all().item<bool>();
      return absl::OkStatus();
    }));
    if (!finite) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".rows contains NaN or Inf"));
    }
  }

  at::Tensor input_grad;
  RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    std::vector<at::Tensor> gs;
    gs.reserve(n);
    for (const at::Tensor& g : grads) gs.push_back(g.to(options_.device, options_.dtype));
    const at::Tensor grad_output = at::cat(gs);
    std::shared_lock<std::shared_mutex> state_lock(state_mutex_);
    if (saved.weights_version != weights_version_.load(std::memory_order_relaxed)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Backward: the weights changed (Step or SetState) since the saved Forward ",
          key.DebugString(), "; abort the step and redo it"));
    }
    std::lock_guard<std::mutex> grad_lock(grad_mutex_);
    torch::autograd::backward({saved.output}, {grad_output});
    input_grad = saved.input.grad();
    return absl::OkStatus();
  }));
  return CatchTorchErrors([&]() -> absl::Status {
    if (!input_grad.defined()) input_grad = at::zeros_like(saved.input);
    int64_t offset = 0;
    for (int i = 0; i < n; ++i) {
      v1::ExpertRows* out = response->add_input_grads();
      out->set_expert_id(saved.expert_ids[i]);
      RETURN_IF_ERROR(EncodeTensor(
          input_grad.narrow(0, offset, saved.rows[i]).to(grads[i].scalar_type()),
          out->mutable_rows()));
      offset += saved.rows[i];
    }
    return absl::OkStatus();
  });
}

absl::Status ExpertServiceCore::Step(const v1::ExpertStepRequest& request,
                                     v1::ExpertStepResponse* response) {
  response->Clear();
  if (request.norm_only()) {
    double norm = 0;
    {
      std::shared_lock<std::shared_mutex> state_lock(state_mutex_);
      std::lock_guard<std::mutex> grad_lock(grad_mutex_);
      RETURN_IF_ERROR(CatchTorchErrors([&] {
        norm = optimizer_->GradNormSquared();
        return absl::OkStatus();
      }));
    }
    response->set_grad_norm_squared(norm);
    response->set_last_applied_step(last_applied_step());
    return absl::OkStatus();
  }
  StepOptions options;
  options.step = request.step();
  options.lr = request.learning_rate();
  options.grad_scale = request.grad_scale();
  options.weight_decay = request.weight_decay();
  options.beta1 = request.beta1();
  options.beta2 = request.beta2();
  options.eps = request.eps();
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  ASSIGN_OR_RETURN(const StepResult result, optimizer_->Step(options));
  last_applied_step_.store(result.last_applied_step, std::memory_order_relaxed);
  if (result.applied) weights_version_.fetch_add(1, std::memory_order_relaxed);
  lock.unlock();
  response->set_grad_norm_squared(result.grad_norm_squared);
  response->set_applied(result.applied);
  response->set_last_applied_step(result.last_applied_step);
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::Abort(const v1::ExpertAbortRequest& request,
                                      v1::ExpertAbortResponse* response) {
  response->Clear();
  SweepExpiredSaved();
  std::vector<SavedForward> dropped;  // graphs are freed outside the lock
  {
    std::lock_guard<std::mutex> lock(saved_mutex_);
    for (auto it = saved_.begin(); it != saved_.end();) {
      if (request.step() == 0 || it->first.step == request.step()) {
        dropped.push_back(std::move(it->second));
        it = saved_.erase(it);
      } else {
        ++it;
      }
    }
  }
  response->set_freed(static_cast<int64_t>(dropped.size()));
  // The failed step's finished Backwards left gradients; a retry starts clean.
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  optimizer_->ZeroGrad();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> ExpertServiceCore::GetState(
    bool include_optimizer) const {
  std::vector<NamedTensor> state;
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    for (int layer = 0; layer < options_.num_layers; ++layer) {
      for (const auto& [name, tensor] : groups_[layer]->named_parameters()) {
        const at::Tensor t = tensor.detach();
        state.emplace_back(absl::StrCat("layer", layer, ".", name),
                           t.is_cpu() ? t.clone(at::MemoryFormat::Contiguous)
                                      : t.to(at::kCPU).contiguous());
      }
    }
    if (include_optimizer) {
      for (NamedTensor& entry : optimizer_->State()) state.push_back(std::move(entry));
    }
    return absl::OkStatus();
  }));
  return state;
}

absl::Status ExpertServiceCore::ValidateStateTensor(const std::string& name,
                                                    c10::ScalarType dtype,
                                                    at::IntArrayRef shape) const {
  const auto it = parameters_.find(name);
  if (it == parameters_.end()) {
    if (ExpertOptimizer::IsStateName(name)) {
      return optimizer_->ValidateStateTensor(name, dtype, shape);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "state: unknown tensor name '", name,
        "'; expected layer<L>.<w1|b1|w2|b2> with L in [0, ", options_.num_layers,
        "), or an optimizer state name"));
  }
  const at::Tensor& param = it->second;
  if (!param.sizes().equals(shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state '", name, "': shape ", ShapeString(shape),
        " does not match the parameter's ", ShapeString(param.sizes())));
  }
  if (param.scalar_type() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state '", name, "': dtype ", c10::toString(dtype),
        " does not match the parameter's ", c10::toString(param.scalar_type())));
  }
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::SetState(absl::Span<const NamedTensor> tensors) {
  std::vector<NamedTensor> optimizer_state;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state '", name, "': undefined tensor"));
    }
    RETURN_IF_ERROR(ValidateStateTensor(name, tensor.scalar_type(), tensor.sizes()));
    if (parameters_.count(name) == 0) optimizer_state.emplace_back(name, tensor);
  }
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  // The optimizer validates the rest (complete per-parameter entries) before
  // changing anything; the parameter copies below cannot fail validation.
  if (!optimizer_state.empty()) {
    RETURN_IF_ERROR(optimizer_->SetState(optimizer_state));
    last_applied_step_.store(optimizer_->last_applied_step(), std::memory_order_relaxed);
  }
  weights_version_.fetch_add(1, std::memory_order_relaxed);
  return CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    for (const auto& [name, tensor] : tensors) {
      const auto it = parameters_.find(name);
      if (it != parameters_.end()) it->second.copy_(tensor);
    }
    return absl::OkStatus();
  });
}

absl::Status ExpertServiceCore::SetState(const std::string& name,
                                         const at::Tensor& tensor) {
  const NamedTensor one(name, tensor);
  return SetState(absl::MakeConstSpan(&one, 1));
}

ExpertServiceCounters ExpertServiceCore::counters() const {
  ExpertServiceCounters c;
  const int s = experts_per_group_;
  c.tokens_per_expert.assign(s, 0);
  c.tokens_per_layer_expert.assign(options_.num_layers, std::vector<int64_t>(s, 0));
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < s; ++e) {
      const int64_t v = tokens_[l * s + e].load(std::memory_order_relaxed);
      c.tokens_per_layer_expert[l][e] = v;
      c.tokens_per_expert[e] += v;
    }
  }
  c.forward_requests = forward_requests_.load(std::memory_order_relaxed);
  c.forward_failures = forward_failures_.load(std::memory_order_relaxed);
  c.bytes_in = bytes_in_.load(std::memory_order_relaxed);
  c.bytes_out = bytes_out_.load(std::memory_order_relaxed);
  c.in_flight = in_flight_.load(std::memory_order_relaxed);
  c.pending_saved = pending_saved();
  c.saved_expired = saved_expired_.load(std::memory_order_relaxed);
  return c;
}

// --- StateChunker -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<StateChunker>> StateChunker::Create(
    std::vector<NamedTensor> tensors, int64_t chunk_bytes) {
  if (chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: ", chunk_bytes, "; expected >= 1"));
  }
  std::vector<Entry> entries;
  entries.reserve(tensors.size());
  for (auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state '", name, "': undefined tensor"));
    }
    ASSIGN_OR_RETURN(const v1::DType dtype, DTypeToProto(tensor.scalar_type()));
    Entry e;
    e.name = std::move(name);
    e.dtype = dtype;
    e.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      e.tensor = tensor.detach().to(at::kCPU).contiguous();
      return absl::OkStatus();
    }));
    entries.push_back(std::move(e));
  }
  return std::unique_ptr<StateChunker>(new StateChunker(std::move(entries), chunk_bytes));
}

bool StateChunker::Next(v1::StateChunk* chunk) {
  if (index_ >= entries_.size()) return false;
  Entry& e = entries_[index_];
  const int64_t total = static_cast<int64_t>(e.tensor.nbytes());
  const int64_t n = std::min(chunk_bytes_, total - offset_);
  chunk->Clear();
  chunk->set_name(e.name);
  chunk->set_dtype(e.dtype);
  for (const int64_t s : e.shape) chunk->add_shape(s);
  chunk->set_offset(offset_);
  if (n > 0) {
    chunk->set_data(static_cast<const char*>(e.tensor.data_ptr()) + offset_, n);
  }
  offset_ += n;
  const bool last = offset_ == total;
  chunk->set_last(last);
  if (last) {
    e.tensor.reset();
    ++index_;
    offset_ = 0;
  }
  return true;
}

// --- StateAssembler ---------------------------------------------------------

absl::Status StateAssembler::Add(const v1::StateChunk& chunk) {
  ++chunks_;
  const std::string& name = chunk.name();
  if (!open_) {
    if (name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state chunk ", chunks_ - 1, ": name is empty"));
    }
    if (seen_.count(name) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state chunk for '", name, "': the tensor was already received"));
    }
    auto type = ScalarTypeFromProto(chunk.dtype());
    if (!type.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state '", name, "'.", type.status().message()));
    }
    const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
    ASSIGN_OR_RETURN(current_bytes_, DeclaredBytes(name, *type, shape));
    if (validator_) RETURN_IF_ERROR(validator_(name, *type, shape));
    current_.Clear();
    current_.set_dtype(chunk.dtype());
    *current_.mutable_shape() = chunk.shape();
    current_name_ = name;
    open_ = true;
  } else {
    if (name != current_name_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state chunk for '", name, "' arrived before '", current_name_,
          "' was complete (", current_.data().size(), " of ", current_bytes_,
          " bytes)"));
    }
    if (chunk.dtype() != current_.dtype() ||
        !std::equal(chunk.shape().begin(), chunk.shape().end(),
                    current_.shape().begin(), current_.shape().end())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state chunk for '", name, "' at offset ", chunk.offset(),
          ": dtype or shape differ from the tensor's first chunk"));
    }
  }
  const int64_t received = static_cast<int64_t>(current_.data().size());
  const int64_t size = static_cast<int64_t>(chunk.data().size());
  if (chunk.offset() != received) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "': offset ", chunk.offset(), "; expected ",
        received, " (chunks must be contiguous and in order)"));
  }
  if (size > current_bytes_ - received) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "': bytes [", received, ", ", received + size,
        ") run past the tensor's ", current_bytes_, " bytes"));
  }
  const bool complete = received + size == current_bytes_;
  if (chunk.last() != complete) {
    return absl::InvalidArgumentError(
        chunk.last()
            ? absl::StrCat("state chunk for '", name, "': marked last at ",
                           received + size, " of ", current_bytes_, " bytes")
            : absl::StrCat("state chunk for '", name, "': all ", current_bytes_,
                           " bytes received but the chunk is not marked last"));
  }
  current_.mutable_data()->append(chunk.data());
  if (!complete) return absl::OkStatus();
  ASSIGN_OR_RETURN(at::Tensor tensor, DecodeTensor(current_, absl::StrCat("state '", name, "'")));
  done_.emplace_back(name, std::move(tensor));
  seen_.insert(name);
  current_.Clear();
  open_ = false;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> StateAssembler::Finish() {
  if (open_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state stream ended with '", current_name_, "' incomplete (",
        current_.data().size(), " of ", current_bytes_, " bytes)"));
  }
  return std::move(done_);
}

// --- State files ------------------------------------------------------------

absl::Status SaveStateToFile(const ExpertServiceCore& core, const std::string& path,
                             int64_t chunk_bytes, bool include_optimizer) {
  ASSIGN_OR_RETURN(auto state, core.GetState(include_optimizer));
  ASSIGN_OR_RETURN(auto chunker, StateChunker::Create(std::move(state), chunk_bytes));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write '", tmp, "'"));
    v1::StateChunk chunk;
    while (chunker->Next(&chunk)) {
      if (!google::protobuf::util::SerializeDelimitedToOstream(chunk, &out)) {
        return absl::DataLossError(absl::StrCat("writing '", tmp, "' failed"));
      }
    }
    out.close();
    if (!out) return absl::DataLossError(absl::StrCat("writing '", tmp, "' failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

absl::Status LoadStateFromFile(const std::string& path, ExpertServiceCore* core) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("state file '", path, "' cannot be read"));
  google::protobuf::io::IstreamInputStream stream(&in);
  StateAssembler assembler(
      [core](const std::string& name, c10::ScalarType dtype, at::IntArrayRef shape) {
        return core->ValidateStateTensor(name, dtype, shape);
      });
  v1::StateChunk chunk;
  for (;;) {
    bool clean_eof = false;
    chunk.Clear();  // parsing merges into the message
    if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&chunk, &stream,
                                                                   &clean_eof)) {
      if (clean_eof) break;
      return absl::DataLossError(absl::StrCat(
          "state file '", path, "': truncated or corrupt after ", assembler.chunks(),
          " chunks"));
    }
    absl::Status status = assembler.Add(chunk);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("state file '", path, "': ", status.message()));
    }
  }
  ASSIGN_OR_RETURN(auto tensors, assembler.Finish());
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state file '", path, "' holds no tensors"));
  }
  return core->SetState(tensors);
}

}  // namespace himoe::expert
