#include "trainer/step_profiler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <unordered_set>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/torch_runtime.h"

namespace himoe::trainer {
namespace {

constexpr char kPrefix[] = "himoe::";
constexpr char kOther[] = "other";
std::atomic<StepProfiler*> active{nullptr};

// Marks a record whose end the profiler must see.
struct Tracked : at::ObserverContext {};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction& fn) {
  StepProfiler* p = active.load();
  if (p == nullptr || !p->owns_this_thread()) return nullptr;
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    if (absl::StartsWith(fn.name(), kPrefix)) {
      p->OnScopeStart(fn.name() + sizeof(kPrefix) - 1);
      return std::make_unique<Tracked>();
    }
  } else if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    p->OnBackwardStart(fn.seqNr());
    if (p->with_ops()) p->OnOpStart(fn.name());
    return std::make_unique<Tracked>();
  } else {
    p->OnOpStart(fn.name());
    return std::make_unique<Tracked>();
  }
  return nullptr;
}

void OnEnd(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  StepProfiler* p = active.load();
  if (p == nullptr || ctx == nullptr || !p->owns_this_thread()) return;
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    p->OnScopeEnd();
  } else if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (p->with_ops()) p->OnOpEnd();
    p->OnBackwardEnd();
  } else {
    p->OnOpEnd();
  }
}

}  // namespace

StepProfiler::StepProfiler() : owner_(std::this_thread::get_id()), last_(Now()) {}

absl::StatusOr<std::unique_ptr<StepProfiler>> StepProfiler::Start(bool with_ops) {
  std::unique_ptr<StepProfiler> p(new StepProfiler());
  p->with_ops_ = with_ops;
  StepProfiler* expected = nullptr;
  if (!active.compare_exchange_strong(expected, p.get())) {
    return absl::FailedPreconditionError("a step profiler is already running");
  }
  absl::Status status = CatchTorchErrors([&] {
    std::unordered_set<at::RecordScope, std::hash<at::RecordScope>> scopes = {
        at::RecordScope::USER_SCOPE, at::RecordScope::BACKWARD_FUNCTION};
    if (with_ops) scopes.insert(at::RecordScope::FUNCTION);
    p->handle_ =
        at::addGlobalCallback(at::RecordFunctionCallback(&OnStart, &OnEnd).scopes(scopes));
    return absl::OkStatus();
  });
  if (!status.ok()) {
    active.store(nullptr);
    return status;
  }
  return p;
}

StepProfiler::~StepProfiler() {
  at::removeCallback(handle_);
  active.store(nullptr);
}

void StepProfiler::BeginStep() {
  last_ = Now();
  charging_ = true;
}

void StepProfiler::EndStep() {
  Charge();
  charging_ = false;
}

void StepProfiler::Charge() {
  const double now = Now();
  if (!charging_) {
    last_ = now;
    return;
  }
  const Open top = open_.empty() ? Open{kOther, backward_depth_ > 0} : open_.back();
  Row& row = rows_[top.category];
  row.category = top.category;
  (top.backward ? row.backward_seconds : row.forward_seconds) += now - last_;
  last_ = now;
}

void StepProfiler::OnScopeStart(const std::string& category) {
  Charge();
  open_.push_back({category, backward_depth_ > 0});
  if (backward_depth_ == 0) {
    categories_by_sequence_[static_cast<int64_t>(at::sequence_number::peek())] = category;
  }
}

void StepProfiler::OnScopeEnd() {
  Charge();
  if (!open_.empty()) open_.pop_back();
  if (backward_depth_ == 0) {
    categories_by_sequence_[static_cast<int64_t>(at::sequence_number::peek())] =
        open_.empty() ? kOther : open_.back().category;
  }
}

std::string StepProfiler::CategoryOf(int64_t sequence_nr) const {
  if (sequence_nr < 0) return kOther;
  auto it = categories_by_sequence_.upper_bound(sequence_nr);
  if (it == categories_by_sequence_.begin()) return kOther;
  return std::prev(it)->second;
}

void StepProfiler::OnBackwardStart(int64_t sequence_nr) {
  Charge();
  ++backward_depth_;
  open_.push_back({CategoryOf(sequence_nr), true});
}

void StepProfiler::OnBackwardEnd() {
  Charge();
  --backward_depth_;
  if (!open_.empty()) open_.pop_back();
}

void StepProfiler::OnOpStart(const char* name) {
  // The engine's wrapper around each node is not an op of its own: the node
  // inside it (BACKWARD_FUNCTION) is.
  const bool outermost =
      !absl::StartsWith(name, "autograd::engine::evaluate_function") &&
      std::none_of(ops_open_.begin(), ops_open_.end(),
                   [](const auto& op) { return !op.first.empty(); });
  // Only the outermost op is timed; nested ones are pushed as empty names.
  ops_open_.emplace_back(outermost ? name : "", Now());
}

void StepProfiler::OnOpEnd() {
  if (ops_open_.empty()) return;
  const auto [name, start] = ops_open_.back();
  ops_open_.pop_back();
  if (name.empty() || !charging_) return;
  const std::string category = open_.empty() ? kOther : open_.back().category;
  const bool backward = backward_depth_ > 0 || (!open_.empty() && open_.back().backward);
  op_seconds_[absl::StrCat(category, backward ? " (backward)" : "", ": ", name)] +=
      Now() - start;
}

std::string StepProfiler::TopOperations(int64_t steps, int top) const {
  std::vector<std::pair<double, std::string>> sorted;
  for (const auto& [name, seconds] : op_seconds_) sorted.emplace_back(seconds, name);
  std::sort(sorted.rbegin(), sorted.rend());
  const double per = 1e3 / std::max<int64_t>(steps, 1);
  std::string out = "| operation (category: op) | ms per step |\n|---|---:|\n";
  for (int i = 0; i < top && i < static_cast<int>(sorted.size()); ++i) {
    absl::StrAppendFormat(&out, "| %s | %.2f |\n", sorted[i].second, sorted[i].first * per);
  }
  return out;
}

std::vector<StepProfiler::Row> StepProfiler::Rows() const {
  std::vector<Row> rows;
  for (const auto& [name, row] : rows_) rows.push_back(row);
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.forward_seconds + a.backward_seconds > b.forward_seconds + b.backward_seconds;
  });
  return rows;
}

std::string StepProfiler::Table(int64_t steps) const {
  const std::vector<Row> rows = Rows();
  double total = 0;
  for (const Row& r : rows) total += r.forward_seconds + r.backward_seconds;
  const double per = 1e3 / std::max<int64_t>(steps, 1);
  std::string out =
      "| category | forward ms | backward ms | total ms | share |\n|---|---:|---:|---:|---:|\n";
  for (const Row& r : rows) {
    const double sum = r.forward_seconds + r.backward_seconds;
    absl::StrAppendFormat(&out, "| %s | %.2f | %.2f | %.2f | %.1f%% |\n", r.category,
                          r.forward_seconds * per, r.backward_seconds * per, sum * per,
                          total > 0 ? 100 * sum / total : 0.0);
  }
  absl::StrAppendFormat(&out, "| **step** | | | **%.2f** | 100%% |\n", total * per);
  return out;
}

}  // namespace himoe::trainer
