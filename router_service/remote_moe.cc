#include "router_service/remote_moe.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"

namespace himoe::router {
namespace {

// One Forward message: a contiguous slice of a group's dispatch rows.
struct ChunkCall {
  int group = 0;
  v1::ExpertForwardRequest request;
  v1::ExpertForwardResponse response;
  absl::Status status;
};

}  // namespace

absl::Status AppendExpertRuns(const at::Tensor& rows, const std::vector<int64_t>& experts,
                              int64_t begin, int64_t end,
                              google::protobuf::RepeatedPtrField<v1::ExpertRows>* out) {
  int64_t run = begin;
  for (int64_t i = begin + 1; i <= end; ++i) {
    if (i < end && experts[i] == experts[run]) continue;
    v1::ExpertRows* er = out->Add();
    er->set_expert_id(static_cast<int32_t>(experts[run]));
    RETURN_IF_ERROR(EncodeTensor(rows.slice(0, run, i), er->mutable_rows()));
    run = i;
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> ConcatExpertRows(
    const google::protobuf::RepeatedPtrField<v1::ExpertRows>& parts,
    const google::protobuf::RepeatedPtrField<v1::ExpertRows>& expected, int64_t d_model,
    absl::string_view what) {
  if (parts.size() != expected.size()) {
    return absl::InternalError(absl::StrCat(what, ": ", parts.size(), " row blocks for ",
                                            expected.size(), " sent"));
  }
  std::vector<at::Tensor> pieces;
  for (int i = 0; i < parts.size(); ++i) {
    ASSIGN_OR_RETURN(at::Tensor y, DecodeTensor(parts.Get(i).rows(), what));
    if (y.dim() != 2 || y.size(0) != expected.Get(i).rows().shape(0) || y.size(1) != d_model) {
      return absl::InternalError(absl::StrCat(what, ": block ", i, " has the wrong shape"));
    }
    pieces.push_back(std::move(y));
  }
  at::Tensor out;
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    out = pieces.empty() ? at::zeros({0, d_model}) : at::cat(pieces).to(at::kFloat);
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<std::unique_ptr<RemoteMoE>> RemoteMoE::Create(
    const RemoteMoEOptions& options) {
  RETURN_IF_ERROR(ValidateRoutingConfig(options.routing));
  if (static_cast<int>(options.groups.size()) != options.routing.num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router: ", options.groups.size(), " group addresses given, num_groups is ",
        options.routing.num_groups));
  }
  if (options.wire_dtype != c10::kFloat && options.wire_dtype != c10::kBFloat16) {
    return absl::InvalidArgumentError("router: wire dtype must be float32 or bfloat16");
  }
  if (options.num_layers < 1 || options.chunk_bytes < 1) {
    return absl::InvalidArgumentError("router: num_layers and chunk_bytes must be >= 1");
  }
  std::unique_ptr<RemoteMoE> moe(new RemoteMoE(options));
  for (int layer = 0; layer < options.num_layers; ++layer) {
    RouterLayerOptions ro;
    ro.config = options.routing;
    ro.d_model = options.d_model;
    ro.seed = RouterSeedFor(options.seed, layer);
    ASSIGN_OR_RETURN(auto router, RouterLayer::Create(ro));
    moe->routers_.push_back(std::move(router));
  }
  for (int g = 0; g < options.routing.num_groups; ++g) {
    GroupClientOptions go = options.groups[g];
    go.group_id = g;
    ASSIGN_OR_RETURN(auto client, GroupClient::Create(go));
    moe->groups_.push_back(std::move(client));
  }
  return moe;
}

absl::StatusOr<MoEOutput> RemoteMoE::Forward(int layer, const at::Tensor& x) {
  if (layer < 0 || layer >= num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", layer, " is not served; layers are [0, ", num_layers(), ")"));
  }
  MoEOutput out;
  ASSIGN_OR_RETURN(out.routing, routers_[layer]->Route(x, /*training=*/false));
  if (observer_ != nullptr) observer_->OnRouted(layer, out.routing.stats);
  const uint64_t request_id = next_request_id_.fetch_add(1);

  std::vector<std::unique_ptr<ChunkCall>> calls;
  RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const int64_t row_bytes = options_.d_model * c10::elementSize(options_.wire_dtype);
    const int64_t rows_per_chunk = std::max<int64_t>(1, options_.chunk_bytes / row_bytes);
    for (size_t g = 0; g < out.routing.groups.size(); ++g) {
      const GroupDispatch& d = out.routing.groups[g];
      const int64_t n = d.token_rows.numel();
      if (n == 0) continue;
      const at::Tensor rows =
          x.detach().index_select(0, d.token_rows).to(options_.wire_dtype).contiguous();
      const at::Tensor ids = d.expert_ids.to(at::kCPU).contiguous();
      const std::vector<int64_t> experts(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
      for (int64_t begin = 0; begin < n; begin += rows_per_chunk) {
        auto call = std::make_unique<ChunkCall>();
        call->group = static_cast<int>(g);
        call->request.set_layer(layer);
        call->request.set_request_id(request_id);
        RETURN_IF_ERROR(AppendExpertRuns(rows, experts, begin,
                                         std::min(n, begin + rows_per_chunk),
                                         call->request.mutable_inputs()));
        calls.push_back(std::move(call));
      }
    }
    return absl::OkStatus();
  }));

  // Every chunk of every group in flight at once.
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = calls.size();
  const Clock::time_point start = Clock::now();
  std::vector<Clock::time_point> group_done(groups_.size(), start);
  for (auto& call : calls) {
    ChunkCall* c = call.get();
    groups_[c->group]->ForwardAsync(&c->request, &c->response, [&, c](absl::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      c->status = std::move(s);
      group_done[c->group] = std::max(group_done[c->group], Clock::now());
      if (--pending == 0) cv.notify_one();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
  }
  if (observer_ != nullptr) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int64_t rows = out.routing.groups[g].token_rows.numel();
      if (rows == 0) continue;
      observer_->OnGroupDispatch(
          static_cast<int>(g), std::chrono::duration<double>(group_done[g] - start).count(),
          rows);
    }
  }

  std::vector<std::vector<at::Tensor>> pieces(groups_.size());
  for (const auto& call : calls) {
    RETURN_IF_ERROR(call->status);
    ASSIGN_OR_RETURN(at::Tensor y,
                     ConcatExpertRows(call->response.outputs(), call->request.inputs(),
                                      options_.d_model,
                                      absl::StrCat("expert group ", call->group, " outputs")));
    pieces[call->group].push_back(std::move(y));
  }
  std::vector<at::Tensor> outputs(groups_.size());
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!pieces[g].empty()) outputs[g] = at::cat(pieces[g]);
    }
    out.output = CombineGroupOutputs(x.size(0), x.size(1), out.routing.groups, outputs);
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace himoe::router
