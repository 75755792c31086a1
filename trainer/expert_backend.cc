#include "trainer/expert_backend.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <glog/logging.h>
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/expert_shape.h"
#include "common/profile_scope.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_client.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_optimizer.h"
#include "expert_service/expert_rows.h"
#include "expert_service/shared_regions.h"

namespace himoe::trainer {
namespace {

expert::StepOptions ToStepOptions(uint64_t step, const AdamWHyper& h, double scale) {
  expert::StepOptions s;
  s.step = step;
  s.lr = h.lr;
  s.grad_scale = scale;
  s.weight_decay = h.weight_decay;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.eps = h.eps;
  return s;
}

absl::Status ValidateWireDtype(c10::ScalarType wire) {
  if (wire != c10::kFloat && wire != c10::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trainer: wire dtype must be float32 or bfloat16, got ", c10::toString(wire)));
  }
  return absl::OkStatus();
}

absl::Status LastAppliedIs(size_t group, uint64_t applied, uint64_t step) {
  if (applied == step) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "expert group ", group, " last applied step ", applied, ", the trainer's last step is ", step,
      " (a group restarted on a run state file older than that step)"));
}

std::string LayerName(int layer, const std::string& name) {
  return absl::StrCat("layer", layer, ".", name);
}

// ---- In-process: the same ExpertGroup and ExpertOptimizer as the service.

class InProcessBackend final : public ExpertBackend {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertBackend>> Create(const ExpertBackendOptions& o) {
    HIMOE_RETURN_IF_ERROR(ValidateExpertShape(o.shape));
    HIMOE_RETURN_IF_ERROR(ValidateWireDtype(o.wire_dtype));
    std::unique_ptr<InProcessBackend> b(new InProcessBackend());
    b->wire_dtype_ = o.wire_dtype;
    b->groups_.resize(o.shape.num_groups());
    for (int g = 0; g < o.shape.num_groups(); ++g) {
      std::vector<expert::ExpertGroup*> all_layers;
      for (int layer = 0; layer < o.shape.num_layers(); ++layer) {
        HIMOE_ASSIGN_OR_RETURN(auto group,
                               expert::ExpertGroup::Create(o.shape, g, layer, o.device));
        all_layers.push_back(group.get());
        b->groups_[g].push_back(std::move(group));
      }
      HIMOE_ASSIGN_OR_RETURN(auto optimizer, expert::ExpertOptimizer::Create(all_layers));
      b->optimizers_.push_back(std::move(optimizer));
    }
    return std::unique_ptr<ExpertBackend>(std::move(b));
  }

  absl::StatusOr<std::vector<at::Tensor>> Forward(int layer, uint64_t, uint32_t,
                                                  const std::vector<GroupRows>& groups,
                                                  bool) override {
    // With a bf16 wire, the roundings of the remote path: the rows and the
    // combined outputs here, and (autograd's backward of each cast) their
    // gradients.
    const auto wire = [&](const at::Tensor& t) {
      return wire_dtype_ == at::kFloat ? t : t.to(wire_dtype_).to(at::kFloat);
    };
    std::vector<at::Tensor> out(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      const GroupRows& in = groups[g];
      if (!in.rows.defined() || in.rows.size(0) == 0) continue;
      HIMOE_ASSIGN_OR_RETURN(out[g],
                             groups_[g][layer]->CombinedForward(wire(in.rows), in.assignment_rows,
                                                                in.expert_ids, in.weights));
      out[g] = wire(out[g]);
    }
    return out;
  }

  std::vector<at::Tensor> LocalParameters() const override {
    std::vector<at::Tensor> params;
    for (const auto& layers : groups_) {
      for (const auto& group : layers) {
        for (const auto& [name, t] : group->named_parameters()) params.push_back(t);
      }
    }
    return params;
  }

  absl::StatusOr<double> GradNormSquared() override {
    double total = 0;
    for (const auto& o : optimizers_) total += o->GradNormSquared();
    return total;
  }

  absl::Status Step(uint64_t step, const AdamWHyper& hyper, double scale) override {
    for (const auto& o : optimizers_) {
      HIMOE_RETURN_IF_ERROR(o->Step(ToStepOptions(step, hyper, scale)).status());
    }
    return absl::OkStatus();
  }

  absl::Status Abort(uint64_t) override {
    for (const auto& o : optimizers_) o->ZeroGrad();
    return absl::OkStatus();
  }

  void AbortWhereReachable(uint64_t step) override { Abort(step).IgnoreError(); }

  absl::Status CheckLastApplied(uint64_t step) override {
    for (size_t g = 0; g < optimizers_.size(); ++g) {
      HIMOE_RETURN_IF_ERROR(LastAppliedIs(g, optimizers_[g]->last_applied_step(), step));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<NamedTensor>> GetState(int g) override {
    std::vector<NamedTensor> state;
    for (size_t layer = 0; layer < groups_[g].size(); ++layer) {
      for (const auto& [name, t] : groups_[g][layer]->named_parameters()) {
        state.push_back({LayerName(layer, name), t.detach().cpu().clone()});
      }
    }
    for (auto& entry : optimizers_[g]->State()) state.push_back(std::move(entry));
    return state;
  }

  absl::Status SetState(int g, const std::vector<NamedTensor>& state) override {
    std::map<std::string, at::Tensor> params;
    for (size_t layer = 0; layer < groups_[g].size(); ++layer) {
      for (const auto& [name, t] : groups_[g][layer]->named_parameters()) {
        params[LayerName(layer, name)] = t;
      }
    }
    std::vector<NamedTensor> optimizer_state;
    for (const auto& [name, t] : state) {
      auto it = params.find(name);
      if (it == params.end()) {
        optimizer_state.push_back({name, t});
        continue;
      }
      if (!it->second.sizes().equals(t.sizes())) {
        return absl::InvalidArgumentError(absl::StrCat("expert state ", name, ": wrong shape"));
      }
      at::NoGradGuard no_grad;
      it->second.copy_(t);
    }
    return optimizers_[g]->SetState(optimizer_state);
  }

  absl::StatusOr<int64_t> PendingSaved() override { return 0; }
  int num_groups() const override { return static_cast<int>(groups_.size()); }

 private:
  InProcessBackend() = default;
  std::vector<std::vector<std::unique_ptr<expert::ExpertGroup>>> groups_;  // [group][layer]
  c10::ScalarType wire_dtype_ = c10::kFloat;
  std::vector<std::unique_ptr<expert::ExpertOptimizer>> optimizers_;
};

// ---- Remote: himoe-expert services over gRPC.

class RemoteBackend;

// One MoE layer's expert call of one micro-batch, kept until its Backward.
struct RemoteCall {
  RemoteBackend* backend = nullptr;
  int layer = 0;
  uint64_t step = 0;
  uint32_t micro_batch = 0;       // this rank's (MicroBatchTurns)
  uint32_t wire_micro_batch = 0;  // over every rank (the groups' key)
  std::vector<int> groups;  // groups that got rows, in order
  std::vector<GroupRows> sent;  // their assignment rows and expert ids (the rows and
                                // weights are the autograd function's inputs)
  std::vector<v1::ExpertForwardRequest> requests;  // row data dropped after sending
};

// Regions per group at most; a call that finds them all leased sends its
// bytes in the messages.
constexpr size_t kMaxRegionsPerGroup = 4;

class RemoteBackend final : public ExpertBackend {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertBackend>> Create(const ExpertBackendOptions& o) {
    HIMOE_RETURN_IF_ERROR(ValidateExpertShape(o.shape));
    HIMOE_RETURN_IF_ERROR(ValidateWireDtype(o.wire_dtype));
    const int num_groups = o.shape.num_groups();
    if (static_cast<int>(o.addresses.size()) != num_groups) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer: ", o.addresses.size(), " expert addresses for ", num_groups, " groups"));
    }
    std::unique_ptr<RemoteBackend> b(new RemoteBackend(o));
    std::vector<std::string> served;  // groups serving a router's model
    for (int g = 0; g < num_groups; ++g) {
      expert::ExpertGroupClientOptions go;
      go.group_id = g;
      go.addresses = {o.addresses[g]};
      go.deadline = o.deadline;
      go.keepalive = o.keepalive;
      go.liveness_check = o.keepalive;
      go.tls = o.tls;
      HIMOE_ASSIGN_OR_RETURN(auto client, expert::ExpertGroupClient::Create(go));
      v1::ExpertInfoResponse info;
      HIMOE_RETURN_IF_ERROR(client->CheckInfo(o.shape, &info));
      if (info.served()) {
        served.push_back(
            absl::StrCat(g, " (", o.addresses[g], ", weights ", info.weights_fingerprint(), ")"));
      }
      b->clients_.push_back(std::move(client));
    }
    if (!o.run_id.empty() && !served.empty() && !o.take_over_served) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert groups ", absl::StrJoin(served, ", "),
          " serve a model a router loaded; beginning a run would replace it under the router. "
          "Train on other groups, or pass --take_over_served_experts (the router then refuses "
          "the groups' answers)"));
    }
    if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("trainer: rank ", o.rank, " of world size ", o.world_size));
    }
    if (!o.run_id.empty() && o.begin_run) {
      for (const auto& client : b->clients_) {
        HIMOE_ASSIGN_OR_RETURN(const v1::BeginRunResponse begun,
                               client->BeginRun(o.run_id, o.take_over_served, o.world_size));
        if (!begun.previous_run_id().empty() || begun.freed() > 0) {
          LOG(INFO) << "expert group " << client->group_id() << ": run " << o.run_id
                    << " replaces run '" << begun.previous_run_id() << "' (last applied step "
                    << begun.previous_last_applied_step() << ", " << begun.freed()
                    << " saved Forwards dropped); experts back to their seed weights";
        }
      }
    }
    return std::unique_ptr<ExpertBackend>(std::move(b));
  }

  absl::StatusOr<std::vector<at::Tensor>> Forward(int layer, uint64_t step, uint32_t micro_batch,
                                                  const std::vector<GroupRows>& groups,
                                                  bool training) override;

  // Sends the call's Forward: call.sent's assignments with `rows` and
  // `weights` (one per call group); returns each group's combined rows.
  absl::StatusOr<std::vector<at::Tensor>> SendForward(RemoteCall& call,
                                                      const std::vector<at::Tensor>& rows,
                                                      const std::vector<at::Tensor>& weights,
                                                      bool save);
  // dL/d(rows) per call group, then dL/d(weights) per call group.
  absl::StatusOr<std::vector<at::Tensor>> SendBackward(const RemoteCall& call,
                                                       const std::vector<at::Tensor>& grads);

  ForwardWaits Waits() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return waits_;
  }

  // One call's per-group times to the answer.
  void AddForwardWait(const std::vector<double>& took) {
    if (took.empty()) return;
    double slowest = 0, sum = 0;
    for (const double t : took) {
      slowest = std::max(slowest, t);
      sum += t;
    }
    std::lock_guard<std::mutex> lock(mu_);
    waits_.calls += 1;
    waits_.slowest_seconds += slowest;
    waits_.straggler_seconds += slowest - sum / took.size();
  }

  std::vector<RowTraffic> Traffic() const override {
    std::vector<RowTraffic> out;
    for (const auto& c : clients_) {
      const auto t = c->row_traffic();
      out.push_back({t.sent, t.received});
    }
    return out;
  }

  absl::StatusOr<double> GradNormSquared() override {
    std::vector<v1::ExpertStepRequest> requests(clients_.size());
    for (v1::ExpertStepRequest& r : requests) r.set_norm_only(true);
    std::vector<v1::ExpertStepResponse> responses(clients_.size());
    HIMOE_RETURN_IF_ERROR(SendSteps(requests, &responses));
    double total = 0;
    for (const auto& r : responses) total += r.grad_norm_squared();
    return total;
  }

  absl::Status Step(uint64_t step, const AdamWHyper& h, double scale) override {
    std::vector<v1::ExpertStepRequest> requests(clients_.size());
    for (v1::ExpertStepRequest& r : requests) {
      r.set_step(step);
      r.set_learning_rate(h.lr);
      r.set_grad_scale(scale);
      r.set_weight_decay(h.weight_decay);
      r.set_beta1(h.beta1);
      r.set_beta2(h.beta2);
      r.set_eps(h.eps);
      r.set_run_id(options_.run_id);
      r.set_world_size(static_cast<uint32_t>(options_.world_size));
    }
    std::vector<v1::ExpertStepResponse> responses(clients_.size());
    HIMOE_RETURN_IF_ERROR(SendSteps(requests, &responses));
    for (size_t g = 0; g < responses.size(); ++g) {
      const v1::ExpertStepResponse& r = responses[g];
      // Not applied now is fine only for a retry of a step already applied.
      if (!r.applied() && r.last_applied_step() != step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "expert group ", g, " did not apply step ", step, " (its last applied step is ",
            r.last_applied_step(), ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Abort(uint64_t step) override { return AbortOn(step, /*reachable_only=*/false); }

  void AbortWhereReachable(uint64_t step) override {
    AbortOn(step, /*reachable_only=*/true).IgnoreError();
  }

  absl::Status AbortOn(uint64_t step, bool reachable_only) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = calls_.begin(); it != calls_.end();) {
        it = it->second->step == step ? calls_.erase(it) : std::next(it);
      }
    }
    // The clean-up goes to every connected group at once (not to one whose
    // health check went unanswered), each with a short deadline: a group that
    // stalls with its connection up would answer no sooner than its
    // keepalive fails.
    constexpr std::chrono::milliseconds kCleanupDeadline(250);
    const std::chrono::milliseconds deadline =
        reachable_only ? kCleanupDeadline : std::chrono::milliseconds(0);
    std::vector<absl::Status> statuses(clients_.size());
    std::vector<std::thread> threads;
    for (size_t g = 0; g < clients_.size(); ++g) {
      if (reachable_only && !clients_[g]->Connected()) continue;
      threads.emplace_back([this, g, step, deadline, &statuses] {
        statuses[g] = clients_[g]->Abort(step, options_.run_id, deadline).status();
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : statuses) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status CheckLastApplied(uint64_t step) override {
    for (size_t g = 0; g < clients_.size(); ++g) {
      HIMOE_ASSIGN_OR_RETURN(const v1::ExpertInfoResponse info, clients_[g]->Info());
      if (info.run_id() != options_.run_id) {
        return absl::FailedPreconditionError(absl::StrCat("expert group ", g, " serves run '",
                                                          info.run_id(), "', not run '",
                                                          options_.run_id, "'"));
      }
      HIMOE_RETURN_IF_ERROR(LastAppliedIs(g, info.last_applied_step(), step));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<NamedTensor>> GetState(int g) override {
    return clients_[g]->GetState(/*include_optimizer=*/true);
  }

  absl::Status SetState(int g, const std::vector<NamedTensor>& state) override {
    return clients_[g]->SetState(state);
  }

  absl::StatusOr<int64_t> PendingSaved() override {
    int64_t total = 0;
    for (const auto& c : clients_) {
      HIMOE_ASSIGN_OR_RETURN(const v1::ExpertInfoResponse info, c->Info());
      total += info.pending_saved();
    }
    return total;
  }

  int num_groups() const override { return static_cast<int>(clients_.size()); }
  int64_t d_model() const { return options_.shape.d_model(); }

  uint64_t Register(std::shared_ptr<RemoteCall> call) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t handle = next_handle_++;
    calls_[handle] = std::move(call);
    return handle;
  }
  std::shared_ptr<RemoteCall> Take(uint64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(handle);
    if (it == calls_.end()) return nullptr;
    auto call = std::move(it->second);
    calls_.erase(it);
    return call;
  }

  // A lease of a region of `group` with room for `bytes`; empty when shared
  // memory is off or the group's regions are all leased.
  expert::RegionLease LeaseRegion(int group, uint64_t bytes) {
    return regions_ == nullptr ? expert::RegionLease() : regions_->Lease(group, bytes);
  }

 private:
  explicit RemoteBackend(const ExpertBackendOptions& o)
      : options_(o),
        regions_(o.shared_memory ? std::make_unique<expert::SharedRegionPool>(
                                       o.shape.num_groups(), kMaxRegionsPerGroup)
                                 : nullptr) {}

  // Every group's Step call at once; the first error wins.
  absl::Status SendSteps(const std::vector<v1::ExpertStepRequest>& requests,
                         std::vector<v1::ExpertStepResponse>* responses) {
    return GroupFailureIfRunLost(
        expert::FanOut(clients_.size(), [&](size_t g, expert::ExpertGroupClient::Done done) {
          clients_[g]->StepAsync(&requests[g], &(*responses)[g], Timed(g, "Step", std::move(done)));
        }));
  }

  // A training call is refused (FAILED_PRECONDITION) by a group serving
  // another run than this one: replaced by another trainer, or a new process
  // that serves none (restarted without a run state file). The latter is a
  // group failure, recovered from the last checkpoint.
  absl::Status GroupFailureIfRunLost(absl::Status s) {
    if (!absl::IsFailedPrecondition(s) || options_.run_id.empty()) return s;
    for (size_t g = 0; g < clients_.size(); ++g) {
      const absl::StatusOr<v1::ExpertInfoResponse> info = clients_[g]->Info();
      if (info.ok() && info->run_id().empty()) {
        return absl::UnavailableError(absl::StrCat(s.message(), " (expert group ", g,
                                                   " serves no run: restarted without its run)"));
      }
    }
    return s;
  }

  // Wraps `done` to report the call's latency to options_.on_rpc.
  expert::ExpertGroupClient::Done Timed(int group, const char* rpc,
                                        expert::ExpertGroupClient::Done done) {
    if (!options_.on_rpc) return done;
    const auto start = std::chrono::steady_clock::now();
    return [this, group, rpc, start, done = std::move(done)](absl::Status s) {
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      options_.on_rpc(group, rpc, took.count());
      done(std::move(s));
    };
  }

  ExpertBackendOptions options_;
  std::vector<std::unique_ptr<expert::ExpertGroupClient>> clients_;
  std::unique_ptr<expert::SharedRegionPool> regions_;  // null: shared memory off
  std::atomic<uint64_t> next_request_id_{1};
  mutable std::mutex mu_;
  ForwardWaits waits_;  // guarded by mu_
  uint64_t next_handle_ = 1;
  std::map<uint64_t, std::shared_ptr<RemoteCall>> calls_;
};

// Connects the remote experts to LibTorch autograd: forward sends Forward
// (saving state on the services), backward sends Backward with dL/dy and
// returns dL/d(rows). Errors are thrown as StatusException, so that they
// keep their code (an unreachable group stays UNAVAILABLE) through autograd.
class RemoteExpertsFunction : public torch::autograd::Function<RemoteExpertsFunction> {
 public:
  // `rows_then_weights`: each call group's rows, then each one's weights.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                std::shared_ptr<RemoteCall> call,
                                                at::TensorList rows_then_weights) {
    const size_t n = call->groups.size();
    const std::vector<at::Tensor> all = rows_then_weights.vec();
    auto outputs = call->backend->SendForward(
        *call, std::vector<at::Tensor>(all.begin(), all.begin() + n),
        std::vector<at::Tensor>(all.begin() + n, all.end()), /*save=*/true);
    if (!outputs.ok()) throw StatusException(outputs.status());
    ctx->saved_data["backend"] = reinterpret_cast<int64_t>(call->backend);
    ctx->saved_data["handle"] = static_cast<int64_t>(call->backend->Register(call));
    return *outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const uint64_t handle = static_cast<uint64_t>(ctx->saved_data["handle"].toInt());
    std::shared_ptr<RemoteCall> call = RemoteBackendOf(ctx)->Take(handle);
    if (call == nullptr) {
      throw StatusException(absl::FailedPreconditionError(
          absl::StrCat("remote expert call ", handle, " was aborted before its backward")));
    }
    auto input_grads = call->backend->SendBackward(*call, grads);
    if (!input_grads.ok()) throw StatusException(input_grads.status());
    torch::autograd::variable_list out = {at::Tensor()};  // for `call`
    for (auto& g : *input_grads) out.push_back(std::move(g));
    return out;
  }

 private:
  static RemoteBackend* RemoteBackendOf(torch::autograd::AutogradContext* ctx) {
    return reinterpret_cast<RemoteBackend*>(ctx->saved_data["backend"].toInt());
  }
};

absl::StatusOr<std::vector<at::Tensor>> RemoteBackend::Forward(int layer, uint64_t step,
                                                               uint32_t micro_batch,
                                                               const std::vector<GroupRows>& groups,
                                                               bool training) {
  auto call = std::make_shared<RemoteCall>();
  call->backend = this;
  call->layer = layer;
  call->step = step;
  call->micro_batch = micro_batch;
  call->wire_micro_batch = static_cast<uint32_t>(micro_batch * options_.world_size + options_.rank);
  std::vector<at::Tensor> rows, weights;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].rows.defined() || groups[g].rows.size(0) == 0) continue;
    call->groups.push_back(static_cast<int>(g));
    GroupRows kept;
    kept.assignment_rows = groups[g].assignment_rows;
    kept.expert_ids = groups[g].expert_ids;
    kept.grad_position = groups[g].grad_position;
    call->sent.push_back(std::move(kept));
    rows.push_back(groups[g].rows);
    weights.push_back(groups[g].weights);
  }
  std::vector<at::Tensor> outputs;
  if (!training) {
    at::NoGradGuard no_grad;
    HIMOE_ASSIGN_OR_RETURN(outputs, SendForward(*call, rows, weights, /*save=*/false));
  } else {
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      std::vector<at::Tensor> inputs = rows;
      inputs.insert(inputs.end(), weights.begin(), weights.end());
      // As a TensorList, so that autograd sees the rows and weights as inputs.
      outputs = RemoteExpertsFunction::apply(call, at::TensorList(inputs));
      return absl::OkStatus();
    }));
  }
  std::vector<at::Tensor> by_group(groups.size());
  for (size_t i = 0; i < call->groups.size(); ++i) by_group[call->groups[i]] = outputs[i];
  return by_group;
}

absl::StatusOr<std::vector<at::Tensor>> RemoteBackend::SendForward(
    RemoteCall& call, const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& weights,
    bool save) {
  const size_t n = call.groups.size();
  call.requests.assign(n, v1::ExpertForwardRequest());
  std::vector<v1::ExpertForwardResponse> responses(n);
  std::vector<expert::RegionLease> leases(n);
  {
    HIMOE_PROFILE_SCOPE("expert RPC: encode");
    for (size_t i = 0; i < n; ++i) {
      v1::ExpertForwardRequest& r = call.requests[i];
      r.set_layer(call.layer);
      r.set_step(call.step);
      r.set_micro_batch(call.wire_micro_batch);
      r.set_request_id(next_request_id_.fetch_add(1));
      r.set_save_for_backward(save);
      if (save) {
        r.set_run_id(options_.run_id);
        r.set_rank(static_cast<uint32_t>(options_.rank));
        r.set_world_size(static_cast<uint32_t>(options_.world_size));
      }
      v1::TokenAssignments* tokens = r.mutable_tokens();
      const at::Tensor a_rows = call.sent[i].assignment_rows.to(at::kCPU, at::kLong).contiguous();
      const at::Tensor ids = call.sent[i].expert_ids.to(at::kCPU, at::kLong).contiguous();
      const at::Tensor w = weights[i].detach().to(at::kCPU, at::kFloat).contiguous();
      const int64_t assignments = a_rows.numel();
      tokens->mutable_row()->Reserve(assignments);
      tokens->mutable_expert_id()->Reserve(assignments);
      for (int64_t a = 0; a < assignments; ++a) {
        tokens->add_row(static_cast<int32_t>(a_rows.data_ptr<int64_t>()[a]));
        tokens->add_expert_id(static_cast<int32_t>(ids.data_ptr<int64_t>()[a]));
      }
      tokens->mutable_weight()->Add(w.data_ptr<float>(), w.data_ptr<float>() + assignments);
      const at::Tensor wire = rows[i].detach().to(options_.wire_dtype).contiguous();
      leases[i] =
          LeaseRegion(call.groups[i],
                      expert::SharedBytesFor({wire.size(0)}, wire.size(1) * wire.element_size()));
      expert::TensorSink sink(leases[i].region());
      HIMOE_RETURN_IF_ERROR(sink.Encode(wire, tokens->mutable_rows()));
      sink.NameRest(&r);
    }
  }
  {
    HIMOE_PROFILE_SCOPE("expert RPC: wait");
    const auto start = std::chrono::steady_clock::now();
    std::vector<double> took(n);
    HIMOE_RETURN_IF_ERROR(GroupFailureIfRunLost(
        expert::FanOut(n, [&](size_t i, expert::ExpertGroupClient::Done done) {
          const int group = call.groups[i];
          clients_[group]->ForwardAsync(
              &call.requests[i], &responses[i],
              Timed(group, "Forward", [&took, i, start, done = std::move(done)](absl::Status s) {
                took[i] =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                done(std::move(s));
              }));
        })));
    AddForwardWait(took);
  }
  HIMOE_PROFILE_SCOPE("expert RPC: decode");
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < n; ++i) {
    OwnSharedMemory own(leases[i].region());
    v1::TokenAssignments* tokens = call.requests[i].mutable_tokens();
    HIMOE_ASSIGN_OR_RETURN(
        at::Tensor y,
        expert::TakeAnswerRows(responses[i].mutable_combined(), tokens->rows().shape(0), d_model(),
                               absl::StrCat("expert group ", call.groups[i]), &own));
    outputs.push_back(std::move(y));  // float32, whatever the wire's dtype
    // Backward needs only the row count: drop the bytes and the assignments.
    tokens->mutable_rows()->clear_data();
    tokens->mutable_rows()->clear_shared();
    tokens->clear_row();
    tokens->clear_expert_id();
    tokens->clear_weight();
    call.requests[i].clear_output_slice();
  }
  for (expert::RegionLease& lease : leases) lease.Succeeded();
  return outputs;
}

absl::StatusOr<std::vector<at::Tensor>> RemoteBackend::SendBackward(
    const RemoteCall& call, const std::vector<at::Tensor>& grads) {
  const size_t n = call.groups.size();
  std::vector<v1::ExpertBackwardRequest> requests(n);
  std::vector<v1::ExpertBackwardResponse> responses(n);
  std::vector<expert::RegionLease> leases(n);
  {
    HIMOE_PROFILE_SCOPE("expert RPC: encode");
    const int64_t row_bytes = d_model() * c10::elementSize(options_.wire_dtype);
    for (size_t i = 0; i < n; ++i) {
      const v1::ExpertForwardRequest& f = call.requests[i];
      v1::ExpertBackwardRequest& r = requests[i];
      r.set_layer(f.layer());
      r.set_step(f.step());
      r.set_micro_batch(f.micro_batch());
      r.set_request_id(f.request_id());
      r.set_run_id(f.run_id());
      r.set_rank(f.rank());
      r.set_world_size(f.world_size());
      if (call.sent[i].grad_position >= 0) {
        r.mutable_grad_position()->set_value(static_cast<uint32_t>(call.sent[i].grad_position));
      }
      const int64_t u = f.tokens().rows().shape(0);
      const at::Tensor g = grads[i].defined() ? grads[i].to(options_.wire_dtype).contiguous()
                                              : at::zeros({u, d_model()}, options_.wire_dtype);
      leases[i] = LeaseRegion(call.groups[i], expert::SharedBytesFor({u}, row_bytes));
      expert::TensorSink sink(leases[i].region());
      HIMOE_RETURN_IF_ERROR(sink.Encode(g, r.mutable_combined_grad()));
      sink.NameRest(&r);
    }
  }
  {
    HIMOE_PROFILE_SCOPE("expert RPC: wait");
    const absl::Status sent =
        expert::FanOut(n, [&](size_t i, expert::ExpertGroupClient::Done done) {
          const int group = call.groups[i];
          clients_[group]->BackwardAsync(&requests[i], &responses[i],
                                         Timed(group, "Backward", std::move(done)));
        });
    // The group no longer holds the Forward: it restarted since (serving the
    // run again from its run state file) or dropped it after its TTL. Nothing
    // was applied, so the step can run again: a group failure.
    if (absl::IsNotFound(sent)) {
      return absl::UnavailableError(
          absl::StrCat(sent.message(),
                       " (the group lost the step's saved Forward: restarted since, or "
                       "kept past --saved_state_ttl_s; the step can run again)"));
    }
    HIMOE_RETURN_IF_ERROR(GroupFailureIfRunLost(sent));
  }
  HIMOE_PROFILE_SCOPE("expert RPC: decode");
  std::vector<at::Tensor> row_grads, weight_grads;
  for (size_t i = 0; i < n; ++i) {
    OwnSharedMemory own(leases[i].region());
    const std::string what = absl::StrCat("expert group ", call.groups[i], " grads");
    HIMOE_ASSIGN_OR_RETURN(
        at::Tensor g,
        expert::TakeAnswerRows(responses[i].mutable_token_grads(),
                               call.requests[i].tokens().rows().shape(0), d_model(), what, &own));
    row_grads.push_back(std::move(g));  // float32, whatever the wire's dtype
    const auto& wg = responses[i].weight_grads();
    const int64_t assignments = call.sent[i].assignment_rows.numel();
    if (wg.size() != assignments) {
      return absl::InternalError(absl::StrCat(what, ": ", wg.size(), " weight gradients for ",
                                              assignments, " assignments"));
    }
    weight_grads.push_back(at::tensor(std::vector<float>(wg.begin(), wg.end()), at::kFloat));
  }
  for (expert::RegionLease& lease : leases) lease.Succeeded();
  row_grads.insert(row_grads.end(), weight_grads.begin(), weight_grads.end());
  return row_grads;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateInProcessBackend(
    const ExpertBackendOptions& options) {
  return InProcessBackend::Create(options);
}

absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateRemoteBackend(
    const ExpertBackendOptions& options) {
  return RemoteBackend::Create(options);
}

}  // namespace himoe::trainer
