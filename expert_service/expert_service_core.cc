#include "expert_service/expert_service_core.h"

#include <chrono>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <openssl/evp.h>
#include <torch/csrc/autograd/autograd.h>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/all_finite.h"
#include "common/expert_shape.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_rows.h"

namespace himoe::expert {
namespace {

std::optional<uint32_t> GradPosition(const v1::ExpertBackwardRequest& request) {
  if (!request.has_grad_position()) return std::nullopt;
  return request.grad_position().value();
}

// The experts' outputs `y` of rows `x` are finite, or an error saying so.
absl::Status CheckFiniteOutputs(const at::Tensor& y, const at::Tensor& x, int layer, int group) {
  if (AllFinite(y)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "layer ", layer, ", group ", group,
      ": the experts' outputs are not finite (NaN or Inf); the input rows (max |x| = ",
      x.detach().abs().max().item<double>(), ") or their weights overflow them"));
}

}  // namespace

ExpertServiceCore::ExpertServiceCore(const ExpertServiceOptions& options,
                                     c10::ScalarType dtype)
    : options_(options),
      dtype_(dtype),
      experts_per_group_(options.shape.num_experts() / options.shape.num_groups()),
      saved_(options.saved_state_ttl) {}

std::string ExpertServiceCore::weights_fingerprint() const {
  if (steps_since_digest_ == 0) return weights_digest_;
  return absl::StrCat(weights_digest_, "+", steps_since_digest_);
}

absl::StatusOr<std::string> ExpertServiceCore::DigestWeights() const {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> sha(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (sha == nullptr || EVP_DigestInit_ex(sha.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("weights digest: cannot start SHA-256");
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    for (const auto& [name, tensor] : parameters_) {  // in name order
      const at::Tensor bytes = tensor.detach().to(at::kCPU).contiguous();
      EVP_DigestUpdate(sha.get(), name.data(), name.size() + 1);
      EVP_DigestUpdate(sha.get(), bytes.data_ptr(), bytes.nbytes());
    }
    return absl::OkStatus();
  }));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(sha.get(), digest, &length);
  std::string hex;
  for (unsigned int i = 0; i < 8 && i < length; ++i) {
    absl::StrAppend(&hex, absl::Hex(digest[i], absl::kZeroPad2));
  }
  return hex;
}

absl::StatusOr<std::unique_ptr<ExpertServiceCore>> ExpertServiceCore::Create(
    const ExpertServiceOptions& o) {
  HIMOE_RETURN_IF_ERROR(ValidateExpertShape(o.shape));
  if (o.max_tokens_per_request < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens_per_request: ", o.max_tokens_per_request, "; expected >= 1"));
  }
  if (o.saved_state_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "saved_state_ttl: ", absl::FormatDuration(o.saved_state_ttl), "; expected >= 0"));
  }
  std::vector<std::unique_ptr<ExpertGroup>> groups;
  for (int layer = 0; layer < o.shape.num_layers(); ++layer) {
    HIMOE_ASSIGN_OR_RETURN(auto group, ExpertGroup::Create(o.shape, o.group_id, layer, o.device));
    groups.push_back(std::move(group));
  }
  if (o.max_shared_regions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_shared_regions: ", o.max_shared_regions, "; expected >= 1"));
  }
  std::unique_ptr<ExpertServiceCore> core(new ExpertServiceCore(o, groups[0]->dtype()));
  core->groups_ = std::move(groups);
  if (o.shared_memory) {
    core->shared_ = std::make_unique<SharedMemoryAttachments>(o.max_shared_regions);
  }
  std::vector<ExpertGroup*> optimized;
  for (const auto& group : core->groups_) {
    for (const auto& [name, tensor] : group->named_parameters()) {
      core->parameters_.emplace(absl::StrCat("layer", group->layer(), ".", name), tensor);
      core->grad_params_.push_back(tensor);
    }
    optimized.push_back(group.get());
  }
  HIMOE_ASSIGN_OR_RETURN(core->optimizer_, ExpertOptimizer::Create(std::move(optimized)));
  HIMOE_ASSIGN_OR_RETURN(core->seed_digest_, core->DigestWeights());
  core->weights_digest_ = core->seed_digest_;
  const int slots = o.shape.num_layers() * core->experts_per_group_;
  core->tokens_.reset(new std::atomic<int64_t>[slots]);
  for (int i = 0; i < slots; ++i) core->tokens_[i] = 0;
  return core;
}

const ExpertGroup* ExpertServiceCore::group(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(groups_.size())) return nullptr;
  return groups_[layer].get();
}

ExpertServiceInfo ExpertServiceCore::Info() const {
  saved_.SweepExpired();
  const v1::ExpertShape& shape = options_.shape;
  ExpertServiceInfo info;
  info.shape = shape;
  info.group_id = options_.group_id;
  for (int s = 0; s < experts_per_group_; ++s) info.expert_ids.push_back(first_expert() + s);
  for (int l = 0; l < num_layers(); ++l) info.layers.push_back(l);
  info.device = options_.device.str();
  info.version = kExpertServiceVersion;
  info.pending_saved = pending_saved();
  info.last_applied_step = last_applied_step();
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  info.run_id = run_id_;
  info.weights_fingerprint = weights_fingerprint();
  info.served = served_;
  return info;
}

void ExpertServiceCore::FillInfo(v1::ExpertInfoResponse* response) const {
  const ExpertServiceInfo info = Info();
  response->Clear();
  response->set_group_id(info.group_id);
  for (const int e : info.expert_ids) response->add_expert_ids(e);
  for (const int l : info.layers) response->add_layers(l);
  // The fields from before `shape` existed, for older clients.
  response->set_d_model(info.shape.d_model());
  response->set_d_ff(info.shape.d_ff());
  response->set_dtype(info.shape.dtype());
  response->set_device(info.device);
  response->set_version(info.version);
  response->set_num_experts(info.shape.num_experts());
  response->set_num_groups(info.shape.num_groups());
  response->set_pending_saved(info.pending_saved);
  response->set_last_applied_step(info.last_applied_step);
  *response->mutable_shape() = info.shape;
  response->set_run_id(info.run_id);
  response->set_weights_fingerprint(info.weights_fingerprint);
  response->set_served(info.served);
}

int64_t ExpertServiceCore::pending_saved() const { return saved_.size(); }

absl::Status ExpertServiceCore::Forward(const v1::ExpertForwardRequest& request,
                                        v1::ExpertForwardResponse* response) {
  v1::ExpertForwardRequest copy = request;
  return Forward(&copy, response);
}

absl::Status ExpertServiceCore::Forward(v1::ExpertForwardRequest* request,
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

absl::Status ExpertServiceCore::CheckForwardRequest(
    const v1::ExpertForwardRequest& request) const {
  if (group(request.layer()) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", request.layer(), " is not served; layers are [0, ", num_layers(), ")"));
  }
  const int64_t max_tokens = options_.max_tokens_per_request;
  if (request.has_tokens()) {
    if (request.inputs_size() > 0) {
      return absl::InvalidArgumentError("inputs: set together with tokens; expected one of them");
    }
    if (request.tokens().row_size() > max_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: ", request.tokens().row_size(),
                       " assignments exceed max_tokens_per_request=", max_tokens));
    }
    return absl::OkStatus();
  }
  if (request.inputs_size() == 0) {
    return absl::InvalidArgumentError(
        "inputs: the request is empty; expected at least one ExpertRows or tokens");
  }
  // Cheap size check on the declared shapes before decoding anything.
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
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::ForwardImpl(v1::ExpertForwardRequest* request_ptr,
                                            v1::ExpertForwardResponse* response) {
  const v1::ExpertForwardRequest& request = *request_ptr;
  response->Clear();
  saved_.SweepExpired();
  bytes_in_.fetch_add(RowBytes(request), std::memory_order_relaxed);
  HIMOE_RETURN_IF_ERROR(CheckForwardRequest(request));
  const int first = first_expert();
  const int end = first + experts_per_group_;
  const bool save = request.save_for_backward();
  const SavedKey key{request.step(), request.micro_batch(), request.layer(), request.request_id()};
  if (request.has_tokens()) {
    HIMOE_ASSIGN_OR_RETURN(
        const DecodedTokens tokens,
        DecodeTokenAssignments(request_ptr->mutable_tokens(), "tokens", options_.shape.d_model(),
                               first, end, shared_.get()));
    if (save) HIMOE_RETURN_IF_ERROR(saved_.CheckUnused(key));
    SavedForward saved;
    HIMOE_RETURN_IF_ERROR(ComputeCombined(request, tokens, save ? &saved : nullptr, response));
    if (save) HIMOE_RETURN_IF_ERROR(saved_.Insert(key, std::move(saved)));
    for (const int32_t id : request.tokens().expert_id()) {
      tokens_[request.layer() * experts_per_group_ + id - first].fetch_add(
          1, std::memory_order_relaxed);
    }
    bytes_out_.fetch_add(RowBytes(*response), std::memory_order_relaxed);
    return absl::OkStatus();
  }
  HIMOE_ASSIGN_OR_RETURN(
      const std::vector<at::Tensor> rows,
      DecodeRequestRows(request_ptr->mutable_inputs(), "inputs", options_.shape.d_model(),
                        [&](int, const std::string& field, int32_t id) -> absl::Status {
                          if (id >= first && id < end) return absl::OkStatus();
                          return absl::InvalidArgumentError(absl::StrCat(
                              field, ".expert_id: ", id, " is outside group ",
                              options_.group_id, "; expected an expert id in [", first,
                              ", ", end, ")"));
                        },
                        {}, shared_.get()));
  int64_t total_rows = 0;
  for (const at::Tensor& x : rows) total_rows += x.size(0);
  if (total_rows == 0) {
    return absl::InvalidArgumentError(
        "inputs: the request has no rows; expected at least one row");
  }

  if (save) HIMOE_RETURN_IF_ERROR(saved_.CheckUnused(key));
  SavedForward saved;
  HIMOE_RETURN_IF_ERROR(ComputeForward(request, rows, save ? &saved : nullptr, response));
  if (save) HIMOE_RETURN_IF_ERROR(saved_.Insert(key, std::move(saved)));

  for (size_t i = 0; i < rows.size(); ++i) {
    const int local = request.inputs(i).expert_id() - first;
    tokens_[request.layer() * experts_per_group_ + local].fetch_add(rows[i].size(0),
                                                                    std::memory_order_relaxed);
  }
  bytes_out_.fetch_add(RowBytes(*response), std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::ComputeCombined(const v1::ExpertForwardRequest& request,
                                                const DecodedTokens& tokens, SavedForward* saved,
                                                v1::ExpertForwardResponse* response) {
  const bool save = saved != nullptr;
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  if (save) {
    HIMOE_RETURN_IF_ERROR(CheckRanks("Forward", request.step(), request.run_id(),
                                     request.world_size(), request.rank()));
  }
  response->set_weights_fingerprint(weights_fingerprint());
  return CatchTorchErrors([&]() -> absl::Status {
    at::AutoGradMode grad_mode(save);
    std::optional<c10::InferenceMode> inference;
    if (!save) inference.emplace();
    at::Tensor x = tokens.rows.to(options_.device, dtype_);
    at::Tensor w = tokens.weights.to(options_.device);
    if (save) {
      x = x.detach().requires_grad_(true);
      w = w.detach().requires_grad_(true);
    }
    HIMOE_ASSIGN_OR_RETURN(
        const at::Tensor y,
        group(request.layer())->CombinedForward(x, tokens.assignment_rows, tokens.expert_ids, w));
    HIMOE_RETURN_IF_ERROR(CheckFiniteOutputs(y, x, request.layer(), options_.group_id));
    if (save) {
      saved->input = x;
      saved->output = y;
      saved->weights = w;
      saved->weights_version = weights_version_.load(std::memory_order_relaxed);
      saved->rows.push_back(x.size(0));
    }
    HIMOE_ASSIGN_OR_RETURN(
        TensorSink sink,
        TensorSink::Create(request.has_output_slice() ? &request.output_slice() : nullptr,
                           shared_.get(), "output_slice"));
    return sink.Encode(y.detach().to(tokens.rows.scalar_type()), response->mutable_combined());
  });
}

absl::Status ExpertServiceCore::ComputeForward(const v1::ExpertForwardRequest& request,
                                               const std::vector<at::Tensor>& rows,
                                               SavedForward* saved,
                                               v1::ExpertForwardResponse* response) {
  const bool save = saved != nullptr;
  const int n_inputs = static_cast<int>(rows.size());
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  if (save) {
    HIMOE_RETURN_IF_ERROR(CheckRanks("Forward", request.step(), request.run_id(),
                                     request.world_size(), request.rank()));
  }
  // Under the lock: the weights that compute these outputs.
  response->set_weights_fingerprint(weights_fingerprint());
  return CatchTorchErrors([&]() -> absl::Status {
    // With grad for a later Backward (the rows become one leaf); otherwise
    // inference mode: no autograd metadata on the views and no version
    // counters, a fair share of a one-row request's LibTorch time.
    at::AutoGradMode grad_mode(save);
    std::optional<c10::InferenceMode> inference;
    if (!save) inference.emplace();
    std::vector<at::Tensor> xs, ids;
    xs.reserve(n_inputs);
    ids.reserve(n_inputs);
    for (int i = 0; i < n_inputs; ++i) {
      xs.push_back(rows[i].to(options_.device, dtype_));
      ids.push_back(at::full({rows[i].size(0)}, request.inputs(i).expert_id(),
                             at::dtype(at::kLong).device(options_.device)));
    }
    at::Tensor x = at::cat(xs);
    if (save) x = x.detach().requires_grad_(true);
    HIMOE_ASSIGN_OR_RETURN(const at::Tensor y, group(request.layer())->Forward(x, at::cat(ids)));
    HIMOE_RETURN_IF_ERROR(CheckFiniteOutputs(y, x, request.layer(), options_.group_id));
    if (save) {
      saved->input = x;
      saved->output = y;
      saved->weights_version = weights_version_.load(std::memory_order_relaxed);
      for (int i = 0; i < n_inputs; ++i) {
        saved->expert_ids.push_back(request.inputs(i).expert_id());
        saved->rows.push_back(rows[i].size(0));
      }
    }
    HIMOE_ASSIGN_OR_RETURN(
        TensorSink sink,
        TensorSink::Create(request.has_output_slice() ? &request.output_slice() : nullptr,
                           shared_.get(), "output_slice"));
    int64_t offset = 0;
    for (int i = 0; i < n_inputs; ++i) {
      const int64_t n = rows[i].size(0);
      v1::ExpertRows* out = response->add_outputs();
      out->set_expert_id(request.inputs(i).expert_id());
      HIMOE_RETURN_IF_ERROR(
          sink.Encode(y.detach().narrow(0, offset, n).to(rows[i].scalar_type()),
                      out->mutable_rows()));
      offset += n;
    }
    return absl::OkStatus();
  });
}

absl::Status ExpertServiceCore::Backward(const v1::ExpertBackwardRequest& request,
                                         v1::ExpertBackwardResponse* response) {
  v1::ExpertBackwardRequest copy = request;
  return Backward(&copy, response);
}

absl::Status ExpertServiceCore::Backward(v1::ExpertBackwardRequest* request_ptr,
                                         v1::ExpertBackwardResponse* response) {
  const v1::ExpertBackwardRequest& request = *request_ptr;
  response->Clear();
  const SavedKey key{request.step(), request.micro_batch(), request.layer(),
                     request.request_id()};
  {
    // Before Take: another run's Backward must not consume this run's state.
    // A BeginRun after this check changes weights_version, which RunBackward
    // checks.
    std::shared_lock<std::shared_mutex> lock(state_mutex_);
    HIMOE_RETURN_IF_ERROR(CheckRanks("Backward", request.step(), request.run_id(),
                                     request.world_size(), request.rank()));
  }
  HIMOE_ASSIGN_OR_RETURN(SavedForward saved, saved_.Take(key));
  // `saved` (and its graph) is freed on every path out of here.
  absl::Status status = BackwardImpl(key, saved, request_ptr, response);
  if (!status.ok()) response->Clear();
  return status;
}

absl::Status ExpertServiceCore::BackwardImpl(const SavedKey& key, SavedForward& saved,
                                             v1::ExpertBackwardRequest* request,
                                             v1::ExpertBackwardResponse* response) {
  if (saved.weights.defined() || request->has_combined_grad()) {
    return CombinedBackward(key, saved, request, response);
  }
  const int n = request->output_grads_size();
  if (n != static_cast<int>(saved.expert_ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output_grads: ", n, " entries; the saved Forward ", key.DebugString(), " has ",
        saved.expert_ids.size(), " outputs"));
  }
  HIMOE_ASSIGN_OR_RETURN(
      const std::vector<at::Tensor> grads,
      DecodeRequestRows(
          request->mutable_output_grads(), "output_grads", options_.shape.d_model(),
          [&](int i, const std::string& field, int32_t id) -> absl::Status {
            if (id == saved.expert_ids[i]) return absl::OkStatus();
            return absl::InvalidArgumentError(
                absl::StrCat(field, ".expert_id: ", id, "; expected ", saved.expert_ids[i],
                             " (outputs[", i, "] of the saved Forward)"));
          },
          saved.rows, shared_.get()));
  HIMOE_ASSIGN_OR_RETURN(
      const at::Tensor input_grad,
      RunBackward(key, saved, static_cast<int>(request->rank()), GradPosition(*request), grads));
  HIMOE_ASSIGN_OR_RETURN(
      TensorSink sink,
      TensorSink::Create(request->has_output_slice() ? &request->output_slice() : nullptr,
                         shared_.get(), "output_slice"));
  return CatchTorchErrors([&]() -> absl::Status {
    int64_t offset = 0;
    for (int i = 0; i < n; ++i) {
      v1::ExpertRows* out = response->add_input_grads();
      out->set_expert_id(saved.expert_ids[i]);
      HIMOE_RETURN_IF_ERROR(sink.Encode(
          input_grad.narrow(0, offset, saved.rows[i]).to(grads[i].scalar_type()),
          out->mutable_rows()));
      offset += saved.rows[i];
    }
    return absl::OkStatus();
  });
}

absl::Status ExpertServiceCore::CombinedBackward(const SavedKey& key, SavedForward& saved,
                                                 v1::ExpertBackwardRequest* request,
                                                 v1::ExpertBackwardResponse* response) {
  if (!saved.weights.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("combined_grad: set for the saved Forward ",
                                                   key.DebugString(),
                                                   ", which was of inputs; expected output_grads"));
  }
  if (!request->has_combined_grad() || request->output_grads_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "combined_grad: the saved Forward ", key.DebugString(), " was of tokens; expected ",
        "combined_grad [", saved.rows[0], ", ", options_.shape.d_model(), "] and no output_grads"));
  }
  HIMOE_ASSIGN_OR_RETURN(const at::Tensor grad,
                         DecodeRowTensor(request->mutable_combined_grad(), "combined_grad",
                                         options_.shape.d_model(), saved.rows[0], shared_.get()));
  HIMOE_ASSIGN_OR_RETURN(
      const at::Tensor input_grad,
      RunBackward(key, saved, static_cast<int>(request->rank()), GradPosition(*request), {grad}));
  HIMOE_ASSIGN_OR_RETURN(
      TensorSink sink,
      TensorSink::Create(request->has_output_slice() ? &request->output_slice() : nullptr,
                         shared_.get(), "output_slice"));
  return CatchTorchErrors([&]() -> absl::Status {
    HIMOE_RETURN_IF_ERROR(
        sink.Encode(input_grad.to(grad.scalar_type()), response->mutable_token_grads()));
    const at::Tensor w_grad = saved.weights.grad().defined()
                                  ? saved.weights.grad().to(at::kCPU, at::kFloat).contiguous()
                                  : at::zeros({saved.weights.numel()}, at::kFloat);
    const float* g = w_grad.data_ptr<float>();
    response->mutable_weight_grads()->Add(g, g + w_grad.numel());
    return absl::OkStatus();
  });
}

absl::StatusOr<at::Tensor> ExpertServiceCore::RunBackward(const SavedKey& key, SavedForward& saved,
                                                          int rank,
                                                          std::optional<uint32_t> position,
                                                          const std::vector<at::Tensor>& grads) {
  at::Tensor input_grad;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    std::vector<at::Tensor> gs;
    gs.reserve(grads.size());
    for (const at::Tensor& g : grads) {
      gs.push_back(g.to(options_.device, saved.output.scalar_type()));
    }
    const at::Tensor grad_output = at::cat(gs);
    std::shared_lock<std::shared_mutex> state_lock(state_mutex_);
    if (saved.weights_version != weights_version_.load(std::memory_order_relaxed)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Backward: the weights changed (Step or SetState) since the saved Forward ",
          key.DebugString(), "; abort the step and redo it"));
    }
    std::lock_guard<std::mutex> grad_lock(grad_mutex_);
    if (position.has_value()) {
      const auto order = grad_orders_.find({rank, key.layer});
      if (order != grad_orders_.end() &&
          (*position < order->second.next || order->second.waiting.count(*position) > 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "grad_position: ", *position, " of layer ", key.layer, ", rank ", rank,
            " came already this step; expected ", order->second.next, " or later, once each"));
      }
    }
    // Earlier Backwards' weight gradients first: the grads sum in call order
    // (positioned ones in position order).
    HIMOE_RETURN_IF_ERROR(RunPendingWeightGradsLocked());
    UseRankGradsLocked(rank);
    DeferredWeightGrads work;
    {
      DeferWeightGradsScope defer(&work);
      torch::autograd::backward({saved.output}, {grad_output});
    }
    if (position.has_value()) {
      QueueInOrderLocked(rank, key.layer, *position, std::move(work));
    } else {
      for (auto& w : work) pending_weight_grads_.push_back(std::move(w));
      pending_ranks_.resize(pending_weight_grads_.size(), rank);
    }
    if (!options_.defer_weight_grads) HIMOE_RETURN_IF_ERROR(RunPendingWeightGradsLocked());
    input_grad = saved.input.grad();
    return absl::OkStatus();
  }));
  if (input_grad.defined()) return input_grad;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    input_grad = at::zeros_like(saved.input);
    return absl::OkStatus();
  }));
  return input_grad;
}

absl::Status ExpertServiceCore::RunPendingWeightGradsLocked() {
  DeferredWeightGrads pending;
  pending.swap(pending_weight_grads_);
  std::vector<int> ranks;
  ranks.swap(pending_ranks_);
  for (size_t k = 0; k < pending.size(); ++k) {
    if (!weight_grads_error_.ok()) break;
    weight_grads_error_ = CatchTorchErrors([&] {
      UseRankGradsLocked(k < ranks.size() ? ranks[k] : 0);
      pending[k]();
      return absl::OkStatus();
    });
  }
  if (weight_grads_error_.ok()) return absl::OkStatus();
  return absl::Status(weight_grads_error_.code(),
                      absl::StrCat("a Backward's weight gradients failed (abort the step): ",
                                   weight_grads_error_.message()));
}

void ExpertServiceCore::QueueInOrderLocked(int rank, int layer, uint32_t position,
                                           DeferredWeightGrads work) {
  GradOrder& order = grad_orders_[{rank, layer}];
  order.waiting[position] = std::move(work);
  for (auto it = order.waiting.begin(); it != order.waiting.end() && it->first == order.next;
       it = order.waiting.erase(it), ++order.next) {
    for (auto& w : it->second) {
      pending_weight_grads_.push_back(std::move(w));
      pending_ranks_.push_back(rank);
    }
  }
}

absl::Status ExpertServiceCore::CheckNoneWaitingLocked(const char* rpc) const {
  for (const auto& [rank_layer, order] : grad_orders_) {
    if (order.waiting.empty()) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        rpc, ": the weight gradients of layer ", rank_layer.second, "'s Backward at grad_position ",
        order.waiting.begin()->first, " (rank ", rank_layer.first, ") wait for position ",
        order.next, ", which never came; abort the step"));
  }
  return absl::OkStatus();
}

void ExpertServiceCore::DropPendingWeightGrads() {
  std::lock_guard<std::mutex> grad_lock(grad_mutex_);
  pending_weight_grads_.clear();
  pending_ranks_.clear();
  grad_orders_.clear();
  weight_grads_error_ = absl::OkStatus();
  // The grads the parameters hold are zeroed next; they are rank 0's then.
  parked_grads_.clear();
  grads_rank_ = 0;
}

void ExpertServiceCore::UseRankGradsLocked(int rank) {
  if (rank == grads_rank_) return;
  const size_t ranks = static_cast<size_t>(std::max(rank, grads_rank_)) + 1;
  if (parked_grads_.size() < ranks) parked_grads_.resize(ranks);
  std::vector<at::Tensor>& park = parked_grads_[grads_rank_];
  std::vector<at::Tensor>& take = parked_grads_[rank];
  park.resize(grad_params_.size());
  take.resize(grad_params_.size());
  for (size_t i = 0; i < grad_params_.size(); ++i) {
    park[i] = grad_params_[i].grad();
    grad_params_[i].mutable_grad() = std::move(take[i]);
    take[i] = at::Tensor();
  }
  grads_rank_ = rank;
}

void ExpertServiceCore::FoldRankGradsLocked() {
  if (parked_grads_.empty()) return;
  UseRankGradsLocked(0);
  at::NoGradGuard no_grad;
  for (size_t r = 1; r < parked_grads_.size(); ++r) {
    for (size_t i = 0; i < parked_grads_[r].size(); ++i) {
      const at::Tensor& g = parked_grads_[r][i];
      if (!g.defined()) continue;
      at::Tensor& grad = grad_params_[i].mutable_grad();
      if (grad.defined()) {
        grad.add_(g);
      } else {
        grad = g;
      }
    }
  }
  parked_grads_.clear();
}

absl::Status ExpertServiceCore::RunPendingWeightGrads() {
  std::shared_lock<std::shared_mutex> state_lock(state_mutex_);
  std::lock_guard<std::mutex> grad_lock(grad_mutex_);
  return RunPendingWeightGradsLocked();
}

int64_t ExpertServiceCore::pending_weight_grads() const {
  std::lock_guard<std::mutex> grad_lock(grad_mutex_);
  return static_cast<int64_t>(pending_weight_grads_.size());
}

absl::Status ExpertServiceCore::Step(const v1::ExpertStepRequest& request,
                                     v1::ExpertStepResponse* response) {
  response->Clear();
  if (request.norm_only()) {
    double norm = 0;
    {
      std::shared_lock<std::shared_mutex> state_lock(state_mutex_);
      std::lock_guard<std::mutex> grad_lock(grad_mutex_);
      HIMOE_RETURN_IF_ERROR(CheckNoneWaitingLocked("Step (norm_only)"));
      HIMOE_RETURN_IF_ERROR(RunPendingWeightGradsLocked());
      HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
        FoldRankGradsLocked();
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
  HIMOE_RETURN_IF_ERROR(
      CheckRanks("Step", request.step(), request.run_id(), request.world_size(), 0));
  {
    std::lock_guard<std::mutex> grad_lock(grad_mutex_);
    HIMOE_RETURN_IF_ERROR(CheckNoneWaitingLocked("Step"));
    HIMOE_RETURN_IF_ERROR(RunPendingWeightGradsLocked());
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      FoldRankGradsLocked();
      return absl::OkStatus();
    }));
    // The next step's positions count from 0 again.
    grad_orders_.clear();
  }
  HIMOE_ASSIGN_OR_RETURN(const OptimizerStepResult result, optimizer_->Step(options));
  last_applied_step_.store(result.last_applied_step, std::memory_order_relaxed);
  if (result.applied) {
    weights_version_.fetch_add(1, std::memory_order_relaxed);
    ++steps_since_digest_;
    if (run_snapshot_sink_) {
      // Copied under the writer lock: exactly the state this step left.
      absl::StatusOr<std::vector<NamedTensor>> state = GetStateLocked(/*include_optimizer=*/true);
      if (state.ok()) {
        run_snapshot_sink_(RunSnapshot{run_id_, run_world_size_, result.last_applied_step,
                                       std::move(state).value()});
      } else {
        LOG(WARNING) << "no run state of step " << result.last_applied_step << ": "
                     << state.status();
      }
    }
  }
  lock.unlock();
  response->set_grad_norm_squared(result.grad_norm_squared);
  response->set_applied(result.applied);
  response->set_last_applied_step(result.last_applied_step);
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::Abort(const v1::ExpertAbortRequest& request,
                                      v1::ExpertAbortResponse* response) {
  response->Clear();
  saved_.SweepExpired();
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  HIMOE_RETURN_IF_ERROR(CheckRun("Abort", request.step(), request.run_id()));
  response->set_freed(saved_.Abort(request.step()));
  // The failed step's finished Backwards left gradients; a retry starts clean.
  DropPendingWeightGrads();
  optimizer_->ZeroGrad();
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::CheckRun(const char* rpc, uint64_t step,
                                         const std::string& run_id) const {
  if (run_id == run_id_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "run_id: ", rpc, " of step ", step, " belongs to run '", run_id,
      "', but this group serves run '", run_id_,
      "' (begun since by another trainer, or never begun)"));
}

absl::Status ExpertServiceCore::CheckRanks(const char* rpc, uint64_t step,
                                           const std::string& run_id, uint32_t world_size,
                                           uint32_t rank) const {
  HIMOE_RETURN_IF_ERROR(CheckRun(rpc, step, run_id));
  const uint32_t world = std::max<uint32_t>(world_size, 1);
  if (world != run_world_size_) {
    return absl::FailedPreconditionError(
        absl::StrCat("world_size: ", rpc, " of step ", step, " comes from ", world,
                     " trainer rank(s), but run '", run_id_, "' on this group was begun for ",
                     run_world_size_, " (every rank of a run needs the same world size)"));
  }
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, "; expected below world_size ", world));
  }
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::BeginRun(const v1::BeginRunRequest& request,
                                         v1::BeginRunResponse* response) {
  response->Clear();
  constexpr size_t kMaxRunId = 128;
  if (request.run_id().empty() || request.run_id().size() > kMaxRunId) {
    return absl::InvalidArgumentError(absl::StrCat("run_id: ", request.run_id().size(),
                                                   " bytes; expected 1 to ", kMaxRunId));
  }
  constexpr uint32_t kMaxWorldSize = 4096;
  if (request.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world_size: ", request.world_size(), " trainer ranks; expected 0 to ", kMaxWorldSize));
  }
  // The seed's weights, built before taking the lock.
  std::vector<std::unique_ptr<ExpertGroup>> fresh;
  for (int layer = 0; layer < num_layers(); ++layer) {
    HIMOE_ASSIGN_OR_RETURN(auto group, ExpertGroup::Create(options_.shape, options_.group_id,
                                                           layer, options_.device));
    fresh.push_back(std::move(group));
  }
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  if (served_ && !request.take_over()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "take_over: group ", options_.group_id, " serves a model a router loaded (weights ",
        weights_fingerprint(),
        "); a BeginRun replaces it only with take_over set (the trainer's "
        "--take_over_served_experts), and the router then refuses the changed weights"));
  }
  response->set_previous_run_id(run_id_);
  response->set_previous_last_applied_step(last_applied_step());
  response->set_freed(saved_.Abort(0));
  DropPendingWeightGrads();
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    for (int layer = 0; layer < num_layers(); ++layer) {
      for (const auto& [name, tensor] : fresh[layer]->named_parameters()) {
        parameters_.at(absl::StrCat("layer", layer, ".", name)).copy_(tensor);
      }
    }
    optimizer_->Reset();
    return absl::OkStatus();
  }));
  last_applied_step_.store(0, std::memory_order_relaxed);
  weights_version_.fetch_add(1, std::memory_order_relaxed);
  weights_digest_ = seed_digest_;
  steps_since_digest_ = 0;
  run_id_ = request.run_id();
  run_world_size_ = std::max<uint32_t>(request.world_size(), 1);
  served_ = false;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> ExpertServiceCore::GetState(bool include_optimizer) const {
  std::shared_lock<std::shared_mutex> lock(state_mutex_);
  return GetStateLocked(include_optimizer);
}

absl::StatusOr<std::vector<NamedTensor>> ExpertServiceCore::GetStateLocked(
    bool include_optimizer) const {
  std::vector<NamedTensor> state;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    for (int layer = 0; layer < num_layers(); ++layer) {
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
        "'; expected layer<L>.<w1|b1|w2|b2> with L in [0, ", num_layers(),
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

absl::Status ExpertServiceCore::SetState(absl::Span<const NamedTensor> tensors, bool served,
                                         std::string* fingerprint) {
  std::vector<NamedTensor> optimizer_state;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state '", name, "': undefined tensor"));
    }
    HIMOE_RETURN_IF_ERROR(ValidateStateTensor(name, tensor.scalar_type(), tensor.sizes()));
    if (parameters_.count(name) == 0) optimizer_state.emplace_back(name, tensor);
  }
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  {
    // Computed from the activations of the weights they belong to.
    std::lock_guard<std::mutex> grad_lock(grad_mutex_);
    HIMOE_RETURN_IF_ERROR(RunPendingWeightGradsLocked());
  }
  // The optimizer validates the rest (complete per-parameter entries) before
  // changing anything; the parameter copies below cannot fail validation.
  if (!optimizer_state.empty()) {
    HIMOE_RETURN_IF_ERROR(optimizer_->SetState(optimizer_state));
    last_applied_step_.store(optimizer_->last_applied_step(), std::memory_order_relaxed);
  }
  weights_version_.fetch_add(1, std::memory_order_relaxed);
  served_ = served;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    for (const auto& [name, tensor] : tensors) {
      const auto it = parameters_.find(name);
      if (it != parameters_.end()) it->second.copy_(tensor);
    }
    return absl::OkStatus();
  }));
  HIMOE_ASSIGN_OR_RETURN(weights_digest_, DigestWeights());
  steps_since_digest_ = 0;
  if (fingerprint != nullptr) *fingerprint = weights_fingerprint();
  return absl::OkStatus();
}

absl::Status ExpertServiceCore::RestoreRun(const RunSnapshot& snapshot) {
  constexpr uint32_t kMaxWorldSize = 4096;
  if (snapshot.run_id.empty() || snapshot.world_size < 1 || snapshot.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("run state: run_id '", snapshot.run_id,
                                                   "', world_size ", snapshot.world_size,
                                                   "; expected a run id and 1 to ", kMaxWorldSize));
  }
  HIMOE_RETURN_IF_ERROR(SetState(snapshot.state));
  std::unique_lock<std::shared_mutex> lock(state_mutex_);
  if (optimizer_->last_applied_step() != snapshot.last_applied_step) {
    return absl::DataLossError(absl::StrCat("run state: the optimizer state is of step ",
                                            optimizer_->last_applied_step(),
                                            ", the header says step ", snapshot.last_applied_step));
  }
  run_id_ = snapshot.run_id;
  run_world_size_ = snapshot.world_size;
  return absl::OkStatus();
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
  c.tokens_per_layer_expert.assign(num_layers(), std::vector<int64_t>(s, 0));
  for (int l = 0; l < num_layers(); ++l) {
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
  c.saved_expired = saved_.expired();
  return c;
}

}  // namespace himoe::expert
