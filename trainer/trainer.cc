#include "trainer/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <random>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/compute_pool.h"
#include "common/profile_scope.h"
#include "common/squared_norm.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "model/checkpoint_reader.h"

namespace himoe::trainer {

std::string NewRunId() {
  char host[64] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  return absl::StrCat(host[0] != '\0' ? host : "host", "-", getpid(), "-", absl::Hex(bits));
}

double CosineLearningRate(const TrainerOptions& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * (step + 1) / static_cast<double>(o.warmup_steps + 1);
  if (step >= o.steps || o.steps <= o.warmup_steps) return o.min_lr;
  const double ratio =
      static_cast<double>(step - o.warmup_steps) / static_cast<double>(o.steps - o.warmup_steps);
  return o.min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (o.lr - o.min_lr);
}

v1::RunConfig RunConfigFor(const TrainerOptions& o, int64_t step) {
  const model::ModelOptions& m = o.model;
  const router::RoutingConfig& r = m.routing;
  v1::RunConfig c;
  c.set_format(model::kCheckpointFormat);
  c.set_step(step);
  *c.mutable_model() = model::ModelConfigToProto(m);
  v1::TrainingConfig& t = *c.mutable_training();
  t.set_steps(o.steps);
  t.set_batch_size(o.batch_size);
  t.set_grad_accum(o.grad_accum);
  t.set_lr(o.lr);
  t.set_min_lr(o.min_lr);
  t.set_warmup_steps(o.warmup_steps);
  t.set_weight_decay(o.weight_decay);
  t.set_beta1(o.beta1);
  t.set_beta2(o.beta2);
  t.set_grad_clip(o.grad_clip);
  t.set_eval_every(o.eval_every);
  t.set_eval_windows(o.eval_windows);
  t.set_seed(o.seed);
  t.set_experts(!o.experts_mode.empty() ? o.experts_mode
                                         : (o.remote_experts ? "remote" : "inprocess"));
  t.set_wire_dtype(o.wire_dtype == c10::kBFloat16 ? "bfloat16" : "float32");
  c.set_description(absl::StrCat(
      router::RoutingMethodName(r.method), " MoE LM at step ", step, ": ", m.n_layer,
      " layers, d_model ", m.d_model, ", ", m.n_head, " heads, N=", r.num_experts,
      " experts in M=", r.num_groups, " groups (top_k ", r.top_k, "), d_ff ", m.d_ff,
      ", vocab ", m.vocab_size, ", block ", m.block_size));
  return c;
}

Trainer::Trainer(const TrainerOptions& options) : options_(options) {}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainerOptions& o) {
  if (o.steps < 1 || o.batch_size < 1 || o.grad_accum < 1 || o.lr < 0 || o.min_lr < 0 ||
      o.warmup_steps < 0 || o.weight_decay < 0 || o.grad_clip < 0 ||
      o.micro_batches_in_flight < 1) {
    return absl::InvalidArgumentError(
        "trainer: steps, batch_size, grad_accum, micro_batches_in_flight >= 1; lr, min_lr, "
        "warmup_steps, weight_decay, grad_clip >= 0");
  }
  std::unique_ptr<Trainer> t(new Trainer(o));
  t->data_parallel_ = o.data_parallel;
  HIMOE_ASSIGN_OR_RETURN(t->corpus_, Corpus::Create(o.data));
  TrainerOptions& opts = t->options_;
  opts.model.vocab_size = t->corpus_->vocab_size();
  t->flops_per_token_ = model::TrainingFlopsPerToken(opts.model);
  BatchSamplerOptions so;
  so.batch_size = o.batch_size;
  so.block_size = o.model.block_size;
  so.seed = o.seed;
  HIMOE_ASSIGN_OR_RETURN(t->sampler_, BatchSampler::Create(t->corpus_->train(), so));
  EvalOptions eo;
  eo.batch_size = o.batch_size;
  eo.block_size = o.model.block_size;
  eo.max_windows = o.eval_windows;
  HIMOE_ASSIGN_OR_RETURN(t->eval_, EvalWindows::Create(t->corpus_->val(), eo));

  HIMOE_RETURN_IF_ERROR(model::ValidateModelOptions(opts.model));
  ExpertBackendOptions bo;
  bo.shape = model::ExpertShapeFor(o.model);
  bo.addresses = o.expert_addresses;
  bo.tls = o.tls;
  bo.keepalive = o.group_keepalive;
  bo.wire_dtype = o.wire_dtype;
  bo.shared_memory = o.shared_memory;
  bo.on_rpc = o.on_rpc;
  if (opts.run_id.empty()) opts.run_id = NewRunId();
  if (t->data_parallel_ != nullptr) {
    // Rank 0's run on every rank.
    HIMOE_ASSIGN_OR_RETURN(opts.run_id, t->data_parallel_->Broadcast(opts.run_id));
    bo.rank = t->rank();
    bo.world_size = t->world_size();
    bo.begin_run = t->rank() == 0;
  }
  bo.run_id = opts.run_id;
  bo.take_over_served = o.take_over_served_experts;
  const int in_flight = std::min(o.micro_batches_in_flight, o.grad_accum);
  if (o.remote_experts && in_flight > 1) {
    t->turns_ = std::make_unique<MicroBatchTurns>(model::NumMoeLayers(opts.model));
    ComputePoolOptions lanes;
    lanes.workers = in_flight - 1;
    lanes.max_queue = in_flight;
    HIMOE_ASSIGN_OR_RETURN(t->lanes_, ComputePool::Create(lanes));
    t->lanes_in_flight_ = in_flight;
  }
  if (o.remote_experts) {
    // Rank 0 begins the run on the groups before any rank calls them.
    if (t->rank() == 0) {
      HIMOE_ASSIGN_OR_RETURN(t->experts_, CreateRemoteBackend(bo));
    }
    if (t->world_size() > 1) HIMOE_RETURN_IF_ERROR(t->data_parallel_->Barrier());
    if (t->rank() > 0) {
      HIMOE_ASSIGN_OR_RETURN(t->experts_, CreateRemoteBackend(bo));
    }
  } else {
    HIMOE_ASSIGN_OR_RETURN(t->experts_, CreateInProcessBackend(bo));
  }
  HIMOE_ASSIGN_OR_RETURN(
      t->moe_, BackendMoE::Create(opts.model, t->experts_.get(), t->turns_.get(), o.data_parallel,
                                  std::max(1, t->lanes_in_flight_)));
  HIMOE_ASSIGN_OR_RETURN(t->model_, model::TransformerLM::Create(opts.model, t->moe_.get()));
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto decayed = std::make_unique<torch::optim::AdamWOptions>(o.lr);
    decayed->betas({o.beta1, o.beta2}).weight_decay(o.weight_decay);
    auto undecayed = std::make_unique<torch::optim::AdamWOptions>(o.lr);
    undecayed->betas({o.beta1, o.beta2}).weight_decay(0.0);
    groups.emplace_back(t->model_->DecayedParameters(), std::move(decayed));
    groups.emplace_back(t->model_->UndecayedParameters(), std::move(undecayed));
    t->optimizer_ = std::make_unique<torch::optim::AdamW>(
        groups, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}));
    return absl::OkStatus();
  }));
  return t;
}

namespace {

// A non-finite loss or gradient (divergence, a bad batch) would write NaN into
// every weight, and later checkpoints would push the good ones out: the step
// fails before the optimizers run, naming what is not finite.
absl::Status CheckFinite(const StepResult& r, double dense_norm2, double expert_norm2) {
  if (std::isfinite(r.loss) && std::isfinite(r.grad_norm)) return absl::OkStatus();
  std::string what;
  if (!std::isfinite(r.loss)) {
    what = absl::StrFormat(
        "the loss is %g (task %g, load %g, intra %g, inter %g, z %g, balance %g)", r.loss, r.task,
        r.load, r.intra, r.inter, r.z, r.balance);
  }
  if (!std::isfinite(r.grad_norm)) {
    absl::StrAppend(&what, what.empty() ? "" : "; ",
                    absl::StrFormat("the gradient norm is %g (dense parameters %g, expert "
                                    "groups %g)",
                                    r.grad_norm, std::sqrt(dense_norm2), std::sqrt(expert_norm2)));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", r.step, ": ", what, "; no update applied, the weights are those after step ",
      r.step - 1, " (lower --lr or --grad_clip, or check the data)"));
}

// Adds a micro-batch's losses (`loss` is its total), tokens and routing
// statistics to the step's (means over `accum` micro-batches).
void AddMicroBatch(model::ModelOutput out, const at::Tensor& loss, int64_t tokens, double accum,
                   StepResult& r) {
  r.loss += loss.item<double>() / accum;
  r.task += out.task_loss.item<double>() / accum;
  r.load += out.aux.load.item<double>() / accum;
  r.intra += out.aux.intra.item<double>() / accum;
  r.inter += out.aux.inter.item<double>() / accum;
  r.z += out.aux.z.item<double>() / accum;
  r.balance += out.aux.balance.item<double>() / accum;
  r.tokens += tokens;
  r.layers = std::move(out.stats);
}

// Adds `grads` to the parameters' .grad as backward() would have (the
// first one taken as it is, in the parameter's layout and not a view, since
// zero_grad detaches in place).
void AccumulateGradients(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].defined()) continue;
    at::Tensor& grad = params[i].mutable_grad();
    if (grad.defined()) {
      grad.add_(grads[i]);
    } else if (!grads[i].is_view() && grads[i].strides() == params[i].strides()) {
      grad = grads[i];
    } else {
      grad = at::empty_like(params[i]).copy_(grads[i]);
    }
  }
}

}  // namespace

Batch Trainer::NextBatch() {
  Batch mine;
  for (int q = 0; q < world_size(); ++q) {
    if (q == rank()) {
      mine = sampler_->Next();
    } else {
      sampler_->Skip();
    }
  }
  return mine;
}

absl::Status Trainer::SumOverRanks(StepResult& r) {
  if (world_size() == 1) return absl::OkStatus();
  HIMOE_PROFILE_SCOPE("all-reduce");
  std::vector<at::Tensor> params;
  for (const auto& p : model_->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  for (const at::Tensor& p : experts_->LocalParameters()) params.push_back(p);
  std::vector<at::Tensor> sums;
  std::vector<float> defined(params.size(), 0.0f);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    if (grad.defined()) defined[i] = 1.0f;
    sums.push_back(!grad.defined()        ? at::zeros_like(params[i])
                   : grad.is_contiguous() ? grad
                                          : grad.contiguous());
  }
  const at::Tensor defined_anywhere = at::tensor(defined);
  sums.push_back(defined_anywhere);
  const auto start = std::chrono::steady_clock::now();
  HIMOE_RETURN_IF_ERROR(data_parallel_->AllReduceSum(sums));
  r.ranks = world_size();
  r.allreduce_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const at::Tensor& t : sums) r.allreduce_bytes += static_cast<int64_t>(t.nbytes());
  {
    at::NoGradGuard no_grad;
    const float* anywhere = defined_anywhere.data_ptr<float>();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].mutable_grad();
      if (anywhere[i] == 0.0f) {
        grad.reset();
      } else if (!grad.defined()) {
        grad = sums[i];
      } else if (!sums[i].is_same(grad)) {
        grad.copy_(sums[i]);
      }
    }
  }
  // The step's means and tokens over every rank's micro-batches.
  const at::Tensor totals = at::tensor(std::vector<double>{
      r.loss, r.task, r.load, r.intra, r.inter, r.z, r.balance, static_cast<double>(r.tokens)});
  HIMOE_RETURN_IF_ERROR(data_parallel_->AllReduceSum({totals}));
  const double* t = totals.data_ptr<double>();
  r.loss = t[0];
  r.task = t[1];
  r.load = t[2];
  r.intra = t[3];
  r.inter = t[4];
  r.z = t[5];
  r.balance = t[6];
  r.tokens = static_cast<int64_t>(t[7]);
  return absl::OkStatus();
}

absl::StatusOr<double> Trainer::ExpertGradNormSquared() {
  if (!SharedGroups()) return experts_->GradNormSquared();
  // Every rank's Backwards are in: each rank's all-reduce followed them.
  const absl::StatusOr<double> norm2 = rank() == 0 ? experts_->GradNormSquared() : 0.0;
  const at::Tensor shared =
      at::tensor(std::vector<double>{norm2.ok() ? *norm2 : 0.0, norm2.ok() ? 0.0 : 1.0});
  HIMOE_RETURN_IF_ERROR(data_parallel_->AllReduceSum({shared}));
  if (!norm2.ok()) return norm2.status();
  if (shared[1].item<double>() != 0) {
    return absl::UnavailableError(
        "rank 0 could not read the expert groups' gradient norm (its log says why)");
  }
  return shared[0].item<double>();
}

absl::Status Trainer::StepExperts(uint64_t step, const AdamWHyper& hyper, double scale) {
  if (!SharedGroups()) return experts_->Step(step, hyper, scale);
  // Rank 0 steps the groups once; no rank goes on before they have.
  const absl::Status stepped = rank() == 0 ? experts_->Step(step, hyper, scale) : absl::OkStatus();
  const at::Tensor failed = at::tensor(std::vector<double>{stepped.ok() ? 0.0 : 1.0});
  HIMOE_RETURN_IF_ERROR(data_parallel_->AllReduceSum({failed}));
  HIMOE_RETURN_IF_ERROR(stepped);
  if (failed.item<double>() != 0) {
    return absl::UnavailableError(absl::StrCat("rank 0 could not apply step ", step,
                                               " on the expert groups (its log says why)"));
  }
  return absl::OkStatus();
}

absl::Status Trainer::MicroBatchesAtOnce(uint64_t step, StepResult& r) {
  const int n = options_.grad_accum;
  const double accum = n * world_size();
  std::vector<Batch> batches(n);
  {
    HIMOE_PROFILE_SCOPE("data");
    for (Batch& batch : batches) batch = NextBatch();
  }
  std::vector<at::Tensor> params;
  for (const auto& p : model_->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  turns_->Begin();
  const int lanes = lanes_in_flight_;
  // Lane k runs micro-batches k, k + lanes, ... one after the other; the
  // turns keep every lane's routing in micro-batch order (and with it each
  // Backward's grad position, so Backward calls need no turn).
  // Each micro-batch's dense gradients are its own until its turn to add
  // them, in order, as backward() into .grad would.
  auto run_lane = [&](int lane) -> absl::Status {
    for (int mb = lane; mb < n; mb += lanes) {
      const uint32_t id = static_cast<uint32_t>(mb);
      const absl::Status s = CatchTorchErrors([&]() -> absl::Status {
        HIMOE_ASSIGN_OR_RETURN(model::ModelOutput out,
                               model_->Forward(batches[mb].x, batches[mb].y, step, id, true));
        const at::Tensor loss = out.task_loss + out.aux.Total();
        const std::vector<at::Tensor> grads =
            torch::autograd::grad({loss / accum}, params, /*grad_outputs=*/{},
                                  /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
        HIMOE_RETURN_IF_ERROR(turns_->Wait(Turn::kGradientSum, 0, id));
        AccumulateGradients(params, grads);
        AddMicroBatch(std::move(out), loss, batches[mb].x.numel(), accum, r);
        turns_->Pass(Turn::kGradientSum, 0, id);
        return absl::OkStatus();
      });
      turns_->Finish(id);
      if (!s.ok()) {
        turns_->Cancel(s);
        return s;
      }
    }
    return absl::OkStatus();
  };
  std::vector<std::promise<absl::Status>> others(lanes - 1);
  std::vector<std::future<absl::Status>> done;
  absl::Status status;
  const at::ThreadLocalState thread_state;  // grad mode and LibTorch's other thread settings
  for (int lane = 1; lane < lanes; ++lane) {
    std::promise<absl::Status>& promise = others[lane - 1];
    const absl::Status submitted = lanes_->Submit([&, lane, thread_state] {
      at::ThreadLocalStateGuard guard(thread_state);
      promise.set_value(run_lane(lane));
    });
    if (!submitted.ok()) {
      turns_->Cancel(submitted);
      status = submitted;
      break;
    }
    done.push_back(promise.get_future());
  }
  const absl::Status first = status.ok() ? run_lane(0) : status;
  if (status.ok()) status = first;
  for (auto& f : done) {
    const absl::Status s = f.get();
    if (status.ok()) status = s;
  }
  turns_->End();
  return status;
}

absl::StatusOr<StepResult> Trainer::Step() {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t step = static_cast<uint64_t>(step_ + 1);
  StepResult r;
  r.step = step_ + 1;
  r.lr = CosineLearningRate(options_, step_);
  const double accum = options_.grad_accum * world_size();
  retry_.reset();
  Retry retry{step, sampler_->SerializeState()};
  bool updated = false;  // whether the dense or expert weights changed
  const std::vector<RowTraffic> traffic_before = experts_->Traffic();
  const ForwardWaits waits_before = experts_->Waits();
  // Route() moves the routers' state in training (the EMA, the controller,
  // loss_free's counts): a step that fails puts it back, so that it applies
  // nothing (the batches it drew stay drawn).
  std::vector<std::pair<at::Tensor, at::Tensor>> router_state;  // live, as it was
  absl::Status status = CatchTorchErrors([&] {
    for (const auto& b : model_->named_buffers()) {
      router_state.emplace_back(b.value(), b.value().clone());
    }
    for (int m = 0; m < model_->num_moe_layers(); ++m) {
      const at::Tensor& counts = model_->router(m).pending_counts();
      router_state.emplace_back(counts, counts.clone());
    }
    return absl::OkStatus();
  });
  if (status.ok()) status = CatchTorchErrors([&]() -> absl::Status {
    model_->train();
    optimizer_->zero_grad();
    if (lanes_ != nullptr) {
      HIMOE_RETURN_IF_ERROR(MicroBatchesAtOnce(step, r));
    } else {
      for (int mb = 0; mb < options_.grad_accum; ++mb) {
        Batch batch;
        {
          HIMOE_PROFILE_SCOPE("data");
          batch = NextBatch();
        }
        HIMOE_ASSIGN_OR_RETURN(
            model::ModelOutput out,
            model_->Forward(batch.x, batch.y, step, static_cast<uint32_t>(mb), true));
        const at::Tensor loss = out.task_loss + out.aux.Total();
        (loss / accum).backward();
        AddMicroBatch(std::move(out), loss, batch.x.numel(), accum, r);
      }
    }
    HIMOE_RETURN_IF_ERROR(SumOverRanks(r));
    // One clip scale over every shard: dense here, experts on the groups.
    HIMOE_PROFILE_SCOPE("grad norm, optimizer");
    double norm2 = 0;
    for (const auto& p : model_->parameters()) {
      if (p.grad().defined()) norm2 += SquaredNorm(p.grad());
    }
    HIMOE_ASSIGN_OR_RETURN(const double expert_norm2, ExpertGradNormSquared());
    r.grad_norm = std::sqrt(norm2 + expert_norm2);
    HIMOE_RETURN_IF_ERROR(CheckFinite(r, norm2, expert_norm2));
    const double scale = options_.grad_clip > 0 && r.grad_norm > options_.grad_clip
                             ? options_.grad_clip / (r.grad_norm + 1e-6)
                             : 1.0;
    {
      at::NoGradGuard no_grad;
      for (const auto& p : model_->parameters()) {
        if (p.grad().defined()) p.grad().mul_(scale);
      }
    }
    for (auto& group : optimizer_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(r.lr);
    }
    updated = true;
    optimizer_->step();
    AdamWHyper hyper;
    hyper.lr = r.lr;
    hyper.weight_decay = options_.weight_decay;
    hyper.beta1 = options_.beta1;
    hyper.beta2 = options_.beta2;
    HIMOE_RETURN_IF_ERROR(StepExperts(step, hyper, scale));
    for (int m = 0; m < model_->num_moe_layers(); ++m) model_->router(m).ApplyBiasUpdates();
    return absl::OkStatus();
  });
  if (!status.ok()) {
    // Free whatever the services saved for this step; keep the first error.
    experts_->AbortWhereReachable(step);
    CatchTorchErrors([&] {
      at::NoGradGuard no_grad;
      for (auto& [live, saved] : router_state) live.copy_(saved);
      return absl::OkStatus();
    }).IgnoreError();
    if (!updated) retry_ = std::move(retry);
    return status;
  }
  ++step_;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.flops = flops_per_token_ * static_cast<double>(r.tokens);
  r.machine_gflops = options_.machine_gflops;
  r.traffic = experts_->Traffic();
  for (size_t g = 0; g < r.traffic.size() && g < traffic_before.size(); ++g) {
    r.traffic[g].sent -= traffic_before[g].sent;
    r.traffic[g].received -= traffic_before[g].received;
  }
  r.waits = experts_->Waits();
  r.waits.calls -= waits_before.calls;
  r.waits.slowest_seconds -= waits_before.slowest_seconds;
  r.waits.straggler_seconds -= waits_before.straggler_seconds;
  return r;
}

absl::Status Trainer::RetryFailedStep() {
  if (!retry_.has_value()) {
    return absl::FailedPreconditionError("no failed step to run again");
  }
  // Abort is refused by a group that serves another run or none (restarted
  // since, its weights lost); one restarted on its run state file serves
  // this run again, but must be at the trainer's last step.
  absl::Status kept = experts_->Abort(retry_->step);
  if (kept.ok()) kept = experts_->CheckLastApplied(static_cast<uint64_t>(step_));
  if (!kept.ok()) {
    if (!absl::IsUnavailable(kept) && !absl::IsDeadlineExceeded(kept)) retry_.reset();
    return kept;
  }
  const std::string sampler_state = std::move(retry_->sampler_state);
  retry_.reset();
  return sampler_->RestoreState(sampler_state);
}

absl::StatusOr<EvalResult> Trainer::Evaluate() {
  double total = 0;
  int64_t batches = 0;
  std::vector<std::vector<router::RoutingStats>> per_layer(model_->num_moe_layers());
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    model_->eval();
    for (int64_t i = 0; i < eval_->num_batches(); ++i) {
      const Batch batch = eval_->GetBatch(i);
      HIMOE_ASSIGN_OR_RETURN(model::ModelOutput out,
                             model_->Forward(batch.x, batch.y, 0, 0, false));
      total += out.task_loss.item<double>();
      for (size_t l = 0; l < out.stats.size() && l < per_layer.size(); ++l) {
        per_layer[l].push_back(std::move(out.stats[l]));
      }
      ++batches;
    }
    return absl::OkStatus();
  }));
  if (batches == 0) return absl::FailedPreconditionError("no validation windows");
  EvalResult r;
  r.loss = total / batches;
  for (const auto& layer : per_layer) {
    r.layers.push_back(router::MergeRoutingStats(options_.model.routing, layer));
  }
  return r;
}

}  // namespace himoe::trainer
