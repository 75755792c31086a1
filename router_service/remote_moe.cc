#include "router_service/remote_moe.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/expert_shape.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_rows.h"
#include "router_service/routing/dispatch_combine.h"

namespace himoe::router {

// One Forward message: a contiguous slice of a group's dispatch rows.
struct RemoteMoE::ChunkCall {
  int group = 0;
  v1::ExpertForwardRequest request;
  v1::ExpertForwardResponse response;
  absl::Status status;
  bool finished = false;  // guarded by InFlight::mu
  expert::RegionLease lease;  // empty: the bytes go inline
};

// The calls of one Forward: sent as they are built, collected in call order.
struct RemoteMoE::InFlight {
  using Clock = std::chrono::steady_clock;
  explicit InFlight(size_t groups) : group_done(groups, start) {}
  ChunkCalls calls;
  std::mutex mu;
  std::condition_variable finished;
  Clock::time_point start = Clock::now();
  std::vector<Clock::time_point> group_done;  // guarded by mu
  const ChunkCall* awaited = nullptr;         // guarded by mu: CollectOutputs waits for it
};

absl::StatusOr<std::unique_ptr<RemoteMoE>> RemoteMoE::Create(const RemoteMoEOptions& options) {
  HIMOE_RETURN_IF_ERROR(ValidateRoutingConfig(options.routing));
  HIMOE_RETURN_IF_ERROR(ValidateExpertShape(options.shape));
  const v1::ExpertShape& shape = options.shape;
  HIMOE_RETURN_IF_ERROR(CheckExpertsMatchRouting(shape, options.routing, "router"));
  if (static_cast<int>(options.groups.size()) != shape.num_groups()) {
    return absl::InvalidArgumentError(absl::StrCat("router: ", options.groups.size(),
                                                   " group addresses given, num_groups is ",
                                                   shape.num_groups()));
  }
  if (options.wire_dtype != c10::kFloat && options.wire_dtype != c10::kBFloat16) {
    return absl::InvalidArgumentError("router: wire dtype must be float32 or bfloat16");
  }
  if (options.chunk_bytes < 1) {
    return absl::InvalidArgumentError("router: chunk_bytes must be >= 1");
  }
  std::unique_ptr<RemoteMoE> moe(new RemoteMoE(options));
  for (int layer = 0; layer < shape.num_layers(); ++layer) {
    RouterLayerOptions ro;
    ro.config = options.routing;
    ro.d_model = shape.d_model();
    ro.seed = RouterSeedFor(shape.seed(), layer);
    ro.init = shape.init();
    ro.serving = true;
    HIMOE_ASSIGN_OR_RETURN(auto router, RouterLayer::Create(ro));
    moe->routers_.push_back(std::move(router));
  }
  RemoteMoE* self = moe.get();
  for (int g = 0; g < shape.num_groups(); ++g) {
    expert::ExpertGroupClientOptions go = options.groups[g];
    go.group_id = g;
    go.pin_weights = options.pin_weights;
    HIMOE_ASSIGN_OR_RETURN(auto client, expert::ExpertGroupClient::Create(go));
    client->set_on_weights_changed([self, g](size_t replica, const std::string& served) {
      LOG_EVERY_N(WARNING, 100) << "expert group " << g << " at "
                                << self->groups_[g]->addresses()[replica] << " serves weights "
                                << served << ", not the " << self->groups_[g]->pinned_weights(replica)
                                << " pinned; its answers are refused (" << google::COUNTER
                                << " so far)";
      {
        std::lock_guard<std::mutex> lock(self->changed_mu_);
        self->changed_.emplace_back(g, replica);
      }
      if (self->observer_ != nullptr) self->observer_->OnWeightsChanged(g);
    });
    moe->groups_.push_back(std::move(client));
  }
  moe->loaded_.resize(shape.num_groups());
  if (options.shared_memory) {
    moe->regions_ =
        std::make_unique<expert::SharedRegionPool>(shape.num_groups(), kSharedRegionsPerGroup);
  }
  return moe;
}

absl::StatusOr<MoEOutput> RemoteMoE::Forward(int layer, const at::Tensor& x,
                                             const model::MoECall& call) {
  if (call.training) {
    return absl::FailedPreconditionError(
        "RemoteMoE serves inference only; training goes through the trainer's expert backend");
  }
  return Forward(layer, x);
}

absl::StatusOr<MoEOutput> RemoteMoE::Forward(int layer, const at::Tensor& x,
                                             expert::ExpertGroupClient::Deadline deadline,
                                             const std::vector<int64_t>& segments) {
  if (layer < 0 || layer >= num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", layer, " is not served; layers are [0, ", num_layers(), ")"));
  }
  MoEOutput out;
  HIMOE_ASSIGN_OR_RETURN(out.routing, routers_[layer]->Route(x, /*training=*/false, segments));
  if (observer_ != nullptr) observer_->OnRouted(layer, out.routing.stats);
  InFlight flight(groups_.size());
  // Each call goes out as soon as it is built and is decoded as soon as it
  // (and every call before it) is back: the experts compute while the rows of
  // later calls are gathered and encoded, and while earlier answers decode.
  const absl::Status sent = BuildAndSend(layer, x, out.routing, deadline, &flight);
  absl::StatusOr<std::vector<at::Tensor>> outputs = CollectOutputs(&flight);
  if (observer_ != nullptr) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int64_t rows = out.routing.groups[g].token_rows.numel();
      if (rows == 0) continue;
      observer_->OnGroupDispatch(
          static_cast<int>(g),
          std::chrono::duration<double>(flight.group_done[g] - flight.start).count(), rows);
    }
  }
  const bool reloaded = options_.reload_changed_experts &&
                        absl::IsFailedPrecondition(outputs.status()) && ReloadChanged();
  HIMOE_RETURN_IF_ERROR(sent);
  if (reloaded) {
    // The group serves the loaded model again: a retry gets its answer.
    return absl::UnavailableError(absl::StrCat(
        outputs.status().message(), "; the loaded experts were pushed to it again: retry"));
  }
  HIMOE_RETURN_IF_ERROR(outputs.status());
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out.output = CombineGroupOutputs(x.size(0), x.size(1), out.routing.groups, *outputs);
    return absl::OkStatus();
  }));
  return out;
}

absl::Status RemoteMoE::BuildAndSend(int layer, const at::Tensor& x, const RoutingOutput& routing,
                                     expert::ExpertGroupClient::Deadline deadline,
                                     InFlight* flight) {
  const uint64_t request_id = next_request_id_.fetch_add(1);
  return CatchTorchErrors([&]() -> absl::Status {
    const int64_t row_bytes = options_.shape.d_model() * c10::elementSize(options_.wire_dtype);
    const int64_t rows_per_chunk = std::max<int64_t>(1, options_.chunk_bytes / row_bytes);
    for (size_t g = 0; g < routing.groups.size(); ++g) {
      const GroupDispatch& d = routing.groups[g];
      const int64_t n = d.token_rows.numel();
      if (n == 0) continue;
      const at::Tensor rows =
          x.detach().index_select(0, d.token_rows).to(options_.wire_dtype).contiguous();
      const at::Tensor ids = d.expert_ids.to(at::kCPU).contiguous();
      const std::vector<int64_t> experts(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
      for (int64_t begin = 0; begin < n; begin += rows_per_chunk) {
        const int64_t end = std::min(n, begin + rows_per_chunk);
        auto owned = std::make_unique<ChunkCall>();
        ChunkCall* call = owned.get();
        call->group = static_cast<int>(g);
        call->request.set_layer(layer);
        call->request.set_request_id(request_id);
        if (regions_ != nullptr) {
          call->lease = regions_->Lease(
              call->group, expert::SharedBytesFor(expert::RunLengths(experts, begin, end),
                                                  row_bytes));
        }
        expert::TensorSink sink(call->lease.region());
        HIMOE_RETURN_IF_ERROR(expert::AppendExpertRuns(rows, experts, begin, end,
                                                       call->request.mutable_inputs(), &sink));
        sink.NameRest(&call->request);
        flight->calls.push_back(std::move(owned));
        groups_[g]->ForwardAsync(
            &call->request, &call->response,
            [flight, call](absl::Status s) {
              // Notified under the lock: the waiter may return and destroy
              // `flight` as soon as it can take the lock after this. Only
              // the call it waits for wakes it (answers out of call order
              // cost no wake-up; it finds them done when it gets there).
              std::lock_guard<std::mutex> lock(flight->mu);
              flight->group_done[call->group] =
                  std::max(flight->group_done[call->group], InFlight::Clock::now());
              call->status = std::move(s);
              call->finished = true;
              if (flight->awaited == call) flight->finished.notify_one();
            },
            deadline);
      }
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<at::Tensor>> RemoteMoE::CollectOutputs(InFlight* flight) {
  std::vector<std::vector<at::Tensor>> pieces(groups_.size());
  absl::Status first;  // the first failure in call order
  // Waits for every call sent, even after a failure: they write into `flight`.
  for (const auto& call : flight->calls) {
    {
      std::unique_lock<std::mutex> lock(flight->mu);
      flight->awaited = call.get();
      flight->finished.wait(lock, [&] { return call->finished; });
      flight->awaited = nullptr;
    }
    if (!first.ok()) continue;
    if (!call->status.ok()) {
      first = call->status;
      continue;
    }
    OwnSharedMemory own(call->lease.region());
    absl::StatusOr<at::Tensor> y =
        expert::ConcatExpertRows(call->response.mutable_outputs(), call->request.inputs(),
                                 options_.shape.d_model(),
                                 absl::StrCat("expert group ", call->group, " outputs"), &own);
    if (!y.ok()) {
      first = y.status();
      continue;
    }
    call->lease.Succeeded();
    pieces[call->group].push_back(*std::move(y));
  }
  HIMOE_RETURN_IF_ERROR(first);
  std::vector<at::Tensor> outputs(groups_.size());
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (pieces[g].size() == 1) {
        outputs[g] = pieces[g][0];
      } else if (!pieces[g].empty()) {
        outputs[g] = at::cat(pieces[g]);
      }
    }
    return absl::OkStatus();
  }));
  return outputs;
}

absl::Status RemoteMoE::VerifyGroups(std::chrono::milliseconds timeout) {
  for (int g = 0; g < num_groups(); ++g) {
    const std::vector<std::string>& addresses = options_.groups[g].addresses;
    for (size_t r = 0; r < addresses.size(); ++r) {
      expert::ExpertGroupClientOptions o = options_.groups[g];
      o.group_id = g;
      o.addresses = {addresses[r]};
      o.deadline = std::min(o.deadline, timeout);
      HIMOE_ASSIGN_OR_RETURN(auto client, expert::ExpertGroupClient::Create(o));
      v1::ExpertInfoResponse info;
      const absl::Status s = client->CheckInfo(options_.shape, &info);
      if (absl::IsFailedPrecondition(s)) return s;
      if (s.ok() && options_.pin_weights) groups_[g]->PinWeights(r, info.weights_fingerprint());
    }
  }
  return absl::OkStatus();
}

bool RemoteMoE::ReloadChanged() {
  std::lock_guard<std::mutex> reload(reload_mu_);
  std::vector<std::pair<int, size_t>> changed;
  {
    std::lock_guard<std::mutex> lock(changed_mu_);
    changed.swap(changed_);
  }
  std::sort(changed.begin(), changed.end());
  changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
  if (changed.empty()) return last_reload_ok_;  // reloaded by the call before
  bool ok = true;
  for (const auto& [g, replica] : changed) {
    if (loaded_[g].empty()) {  // nothing was pushed: nothing to reload
      ok = false;
      continue;
    }
    expert::ExpertGroupClient& client = *groups_[g];
    const absl::StatusOr<std::string> fingerprint = client.ServeState(loaded_[g], replica);
    if (fingerprint.ok()) {
      client.PinWeights(replica, *fingerprint);
      LOG(WARNING) << "expert group " << g << " at " << client.addresses()[replica]
                   << " served other weights: the loaded experts are pushed again (weights "
                   << *fingerprint << ")";
    } else {
      ok = false;
      LOG(ERROR) << "expert group " << g
                 << ": reloading its experts failed: " << fingerprint.status();
    }
    if (observer_ != nullptr) observer_->OnExpertsReloaded(g, fingerprint.ok());
  }
  last_reload_ok_ = ok;
  return ok;
}

absl::Status RemoteMoE::LoadExpertState(int group, const std::vector<NamedTensor>& state) {
  if (group < 0 || group >= num_groups()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group: ", group, " is outside [0, ", num_groups(), ")"));
  }
  // Every replica gets the weights; each is pinned to them. A replica that
  // cannot take them now is pinned to none it could serve, so its answers
  // are refused (and, with reload_changed_experts, it gets them then: so
  // even a group that no replica of which is up yet is no error).
  expert::ExpertGroupClient& client = *groups_[group];
  absl::Status first_error;
  int loaded = 0;
  for (size_t r = 0; r < client.addresses().size(); ++r) {
    const absl::StatusOr<std::string> fingerprint = client.ServeState(state, r);
    if (fingerprint.ok()) {
      client.PinWeights(r, *fingerprint);
      ++loaded;
      continue;
    }
    if (!absl::IsUnavailable(fingerprint.status()) &&
        !absl::IsDeadlineExceeded(fingerprint.status())) {
      return fingerprint.status();
    }
    client.PinWeights(r, absl::StrCat("(not loaded: ", fingerprint.status().message(), ")"));
    LOG(WARNING) << "expert group " << group << " at " << client.addresses()[r]
                 << ": experts not loaded: " << fingerprint.status();
    if (first_error.ok()) first_error = fingerprint.status();
  }
  // Unreachable now, it gets them when it answers again, if reloading.
  if (loaded == 0 && !options_.reload_changed_experts) return first_error;
  std::lock_guard<std::mutex> lock(reload_mu_);
  loaded_[group] = state;
  return absl::OkStatus();
}

}  // namespace himoe::router
