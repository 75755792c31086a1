#ifndef HIMOE_TRAINER_STEP_PROFILER_H_
#define HIMOE_TRAINER_STEP_PROFILER_H_

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace himoe::trainer {

// Where a training step's wall time goes, by category: the innermost
// HIMOE_PROFILE_SCOPE open on the training thread (attention, routing,
// experts, ...; "other" outside every scope). Backward time goes to the
// category whose forward created the autograd node: the profiler notes which
// category was open at each autograd sequence number in forward, and reads
// the node's number in backward. LibTorch's RecordFunction drives it, so it
// costs nothing when off. One at a time per process.
class StepProfiler {
 public:
  // `with_ops` also times each outermost LibTorch op (TopOperations), at a
  // cost of a callback per op that slows the step itself.
  static absl::StatusOr<std::unique_ptr<StepProfiler>> Start(bool with_ops = false);
  ~StepProfiler();

  // Time is charged between BeginStep and EndStep only (not to evaluation).
  void BeginStep();
  void EndStep();

  struct Row {
    std::string category;
    double forward_seconds = 0;
    double backward_seconds = 0;
  };
  // Every category seen, largest total first.
  std::vector<Row> Rows() const;
  // A Markdown table of milliseconds per step over `steps` steps, with each
  // category's share of the total.
  std::string Table(int64_t steps) const;
  // The `top` most expensive operations (outermost LibTorch ops and autograd
  // nodes, with their category), milliseconds per step.
  std::string TopOperations(int64_t steps, int top) const;

  // For the RecordFunction callbacks.
  void OnScopeStart(const std::string& category);
  void OnScopeEnd();
  void OnBackwardStart(int64_t sequence_nr);
  void OnBackwardEnd();
  void OnOpStart(const char* name);
  void OnOpEnd();
  bool with_ops() const { return with_ops_; }
  bool owns_this_thread() const { return std::this_thread::get_id() == owner_; }

 private:
  StepProfiler();
  struct Open {
    std::string category;
    bool backward = false;
  };
  // Adds the time since the last event to the open category.
  void Charge();
  // The category of an autograd node by its sequence number.
  std::string CategoryOf(int64_t sequence_nr) const;

  std::thread::id owner_;
  uint64_t handle_ = 0;
  double last_ = 0;
  bool charging_ = false;
  bool with_ops_ = false;
  std::vector<Open> open_;
  int backward_depth_ = 0;
  // From this sequence number on (until the next key) forward nodes belong to
  // the category.
  std::map<int64_t, std::string> categories_by_sequence_;
  std::map<std::string, Row> rows_;
  // Outermost operations: (name, start time) while open, then seconds by
  // "category: name".
  std::vector<std::pair<std::string, double>> ops_open_;
  std::map<std::string, double> op_seconds_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_STEP_PROFILER_H_
