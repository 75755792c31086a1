#include "model/generator.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::model {

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(const CheckpointContents& contents,
                                                             MoELayers* moe,
                                                             const GeneratorOptions& options) {
  if (options.max_new_tokens_limit < 1) {
    return absl::InvalidArgumentError("generator: max_new_tokens_limit must be >= 1");
  }
  if (options.max_streams < 1) {
    return absl::InvalidArgumentError("generator: max_streams must be >= 1");
  }
  const int num_groups = contents.model.routing.num_groups;
  if (moe == nullptr || moe->num_groups() != num_groups ||
      static_cast<int>(contents.experts.size()) != num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generator: checkpoint ", contents.dir, " has ", contents.experts.size(),
        " expert groups of ", num_groups, "; the MoE layers have ",
        moe == nullptr ? 0 : moe->num_groups()));
  }
  std::unique_ptr<Generator> g(new Generator());
  g->options_ = options;
  g->model_options_ = contents.model;
  g->checkpoint_step_ = contents.step;
  g->checkpoint_dir_ = contents.dir;
  if (options.load_expert_state) {
    for (int group = 0; group < num_groups; ++group) {
      if (absl::Status s = moe->LoadExpertState(group, contents.experts[group]); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("generator: loading expert group ", group,
                                                   " from ", contents.dir, ": ", s.message()));
      }
    }
  }
  absl::StatusOr<std::shared_ptr<TransformerLM>> model = TransformerLM::Create(contents.model, moe);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("generator: checkpoint ", contents.dir, ": ",
                                     model.status().message()));
  }
  g->model_ = *std::move(model);
  HIMOE_RETURN_IF_ERROR(RestoreDenseState(contents, *g->model_));
  g->model_->eval();
  g->kv_pool_ = g->model_->NewKvCachePool();
  return g;
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogits(const std::vector<int64_t>& context) {
  std::lock_guard<std::mutex> lock(model_mu_);
  return NextTokenLogitsLocked(context);
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogitsLocked(const std::vector<int64_t>& context) {
  if (context.empty()) return absl::InvalidArgumentError("generator: empty context");
  const int64_t keep = std::min<int64_t>(context.size(), model_options_.block_size);
  at::Tensor idx;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    idx = at::tensor(std::vector<int64_t>(context.end() - keep, context.end()), at::kLong)
              .view({1, keep});
    return absl::OkStatus();
  }));
  c10::InferenceMode inference;
  // Inference keeps no state on the groups, so the step / micro-batch keys
  // are irrelevant.
  HIMOE_ASSIGN_OR_RETURN(ModelOutput out,
                         model_->Forward(idx, at::Tensor(), 0, 0, /*training=*/false));
  return out.logits[0][keep - 1].to(at::kFloat);
}

namespace {

// Nucleus sampling (Holtzman et al., 2020): of the tokens with scaled logit
// >= `kth`, the most likely ones whose probability first reaches top_p stay
// in; returns the least scaled logit kept (its ties stay in too).
double NucleusThreshold(const std::vector<double>& scaled, double kth, double top_p) {
  std::vector<double> kept;
  for (const double v : scaled) {
    if (v >= kth) kept.push_back(v);
  }
  std::sort(kept.begin(), kept.end(), std::greater<double>());
  double total = 0;
  for (const double v : kept) total += std::exp(v);
  double mass = 0;
  for (const double v : kept) {
    mass += std::exp(v);
    if (mass >= top_p * total) return v;
  }
  return kept.empty() ? kth : kept.back();
}

}  // namespace

absl::StatusOr<int64_t> SampleToken(const at::Tensor& logits, const GenerateParams& params,
                                    at::Generator& rng) {
  at::Tensor row;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    row = logits.to(at::kCPU, at::kFloat).contiguous();
    return absl::OkStatus();
  }));
  const int64_t n = row.numel();
  if (n < 1) return absl::InvalidArgumentError("sample: no logits");
  const float* l = row.data_ptr<float>();
  const int64_t argmax = std::max_element(l, l + n) - l;  // the first of equal maxima
  if (params.temperature == 0) return argmax;
  // Shifted first, so that a tiny temperature overflows to -inf (weight 0)
  // rather than to inf - inf = NaN: the limit is greedy.
  std::vector<double> scaled(n);
  for (int64_t j = 0; j < n; ++j) {
    scaled[j] = (static_cast<double>(l[j]) - l[argmax]) / params.temperature;
  }
  double kth = -std::numeric_limits<double>::infinity();
  if (params.top_k > 0 && params.top_k < n) {
    std::vector<double> sorted = scaled;
    std::nth_element(sorted.begin(), sorted.begin() + (params.top_k - 1), sorted.end(),
                     std::greater<double>());
    kth = sorted[params.top_k - 1];  // ties with the k-th stay in
  }
  if (params.top_p < 1) kth = NucleusThreshold(scaled, kth, params.top_p);
  std::vector<double> cumulative(n);
  double total = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (scaled[j] >= kth) total += std::exp(scaled[j]);
    cumulative[j] = total;
  }
  // One uniform draw in [0, 1) (53 bits) from the stream's generator, then
  // the inverse of the cumulative weights.
  uint64_t bits = 0;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    auto* gen = at::check_generator<at::CPUGeneratorImpl>(rng);
    std::lock_guard<std::mutex> lock(gen->mutex_);
    bits = gen->random64();
    return absl::OkStatus();
  }));
  const double target = static_cast<double>(bits >> 11) * 0x1.0p-53 * total;
  const int64_t token =
      std::upper_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin();
  // target < total, so a token is found; rounding aside, the argmax has weight 1.
  return token < n ? token : argmax;
}

struct Generator::Stream {
  const GenerateParams* params;
  const std::function<bool(int64_t)>* on_token;
  at::Generator rng;
  std::vector<int64_t> context;
  KvCache cache;  // holds context[0 .. cache.length) once decoding started
  int generated = 0;
  bool ended = false;  // set by the decoder (under mu_) once removed
  absl::Status status;
};

absl::Status Generator::Generate(const GenerateParams& params,
                                 const std::function<bool(int64_t)>& on_token) {
  HIMOE_RETURN_IF_ERROR(ValidateGenerateParams(params, *this));
  Stream stream;
  stream.params = &params;
  stream.on_token = &on_token;
  stream.context = params.prompt;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    stream.rng = at::make_generator<at::CPUGeneratorImpl>(params.seed);
    return absl::OkStatus();
  }));
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return absl::UnavailableError("generator: shutting down");
  if (static_cast<int>(streams_.size()) >= options_.max_streams) {
    ++stats_.rejected;
    return absl::ResourceExhaustedError(absl::StrCat(
        "generate: ", streams_.size(), " streams are decoding (max_streams = ",
        options_.max_streams, "); retry later"));
  }
  if (!decoder_.joinable()) decoder_ = std::thread([this] { DecodeLoop(); });
  streams_.push_back(&stream);
  stats_.active_streams = static_cast<int64_t>(streams_.size());
  cv_.notify_all();
  cv_.wait(lock, [&] { return stream.ended; });
  return stream.status;
}

Generator::~Generator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (decoder_.joinable()) decoder_.join();
}

GeneratorStats Generator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Generator::DecodeLoop() {
  // Every tensor of a decoding step lives on this thread, the KV cache too.
  c10::InferenceMode inference;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !streams_.empty(); });
    if (stopping_) {
      for (Stream* s : streams_) {
        s->status = absl::UnavailableError("generator: shutting down");
        s->cache = KvCache();
        s->ended = true;
      }
      streams_.clear();
      cv_.notify_all();
      return;
    }
    // The streams joined so far; later ones join the next step.
    const std::vector<Stream*> step = streams_;
    lock.unlock();
    const int sampled = Step(step);
    lock.lock();
    ++stats_.steps;
    stats_.tokens += sampled;
    std::vector<Stream*> running;
    for (Stream* s : streams_) {
      const bool done = !s->status.ok() || s->generated == s->params->max_new_tokens;
      if (done) {
        s->cache = KvCache();  // freed now, not when the caller wakes
        s->ended = true;
      } else {
        running.push_back(s);
      }
    }
    streams_ = std::move(running);
    stats_.active_streams = static_cast<int64_t>(streams_.size());
    stats_.kv_cache_slots = kv_pool_->slots_in_use();
    cv_.notify_all();
  }
}

absl::StatusOr<at::Tensor> Generator::StepLogits(const std::vector<Stream*>& streams) {
  std::lock_guard<std::mutex> lock(model_mu_);
  if (!options_.kv_cache) {
    std::vector<at::Tensor> rows;
    for (Stream* s : streams) {
      HIMOE_ASSIGN_OR_RETURN(at::Tensor row, NextTokenLogitsLocked(s->context));
      rows.push_back(row);
    }
    at::Tensor logits;
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      logits = at::stack(rows);
      return absl::OkStatus();
    }));
    return logits;
  }
  const size_t block = static_cast<size_t>(model_options_.block_size);
  std::vector<std::vector<int64_t>> tokens;
  std::vector<KvCache*> caches;
  for (Stream* s : streams) {
    const std::vector<int64_t>& c = s->context;
    if (s->cache.pool() == nullptr) s->cache = kv_pool_->Acquire();
    if (c.size() > block) {
      // Past block_size the window's positions shift: recompute it.
      s->cache.length = 0;
      tokens.emplace_back(c.end() - block, c.end());
    } else if (s->cache.length == 0) {
      tokens.push_back(c);  // the prompt
    } else {
      tokens.emplace_back(c.begin() + s->cache.length, c.end());  // the last token
    }
    caches.push_back(&s->cache);
  }
  return model_->DecodeStep(tokens, caches);
}

int Generator::Step(const std::vector<Stream*>& streams) {
  int sampled = 0;
  absl::StatusOr<at::Tensor> logits = StepLogits(streams);
  for (size_t i = 0; i < streams.size(); ++i) {
    Stream* s = streams[i];
    if (!logits.ok()) {
      s->status = logits.status();
      continue;
    }
    absl::StatusOr<int64_t> token = SampleToken((*logits)[i], *s->params, s->rng);
    if (!token.ok()) {
      s->status = token.status();
      continue;
    }
    s->context.push_back(*token);
    ++s->generated;
    ++sampled;
    if (!(*s->on_token)(*token)) {
      s->status = absl::CancelledError(
          absl::StrCat("generation cancelled after ", s->generated, " tokens"));
    }
  }
  return sampled;
}

}  // namespace himoe::model
