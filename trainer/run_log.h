#ifndef HIMOE_TRAINER_RUN_LOG_H_
#define HIMOE_TRAINER_RUN_LOG_H_

#include <cstdint>
#include <deque>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "himoe/v1/model.pb.h"
#include "common/compute_setup.h"
#include "trainer/trainer.h"

namespace himoe::trainer {

// What a person and a plot see of a run: one JSON object per line in
// metrics.jsonl (kind "config" once per start, "train" per step, "eval" per
// evaluation, "stop" when a signal stopped it), a live
// progress line, and the final per-layer balance table.
class RunLog {
 public:
  // A new run truncates the file. A run resumed at checkpoint step
  // `resumed_at` keeps the file up to that step: its "train" lines of later
  // steps and its "eval" lines from that step on (the resumed run redoes
  // them) are dropped, so no step is counted twice.
  static absl::StatusOr<std::unique_ptr<RunLog>> Create(
      const std::string& jsonl_path, int64_t total_steps, int window,
      std::optional<int64_t> resumed_at = std::nullopt);

  // The run's settings (RunConfigFor): the JSON of `config` (proto field
  // names) with "kind":"config", or "kind":"resume" in a resumed run (the
  // file's first "config" line stays the run's).
  void OnConfig(const v1::RunConfig& config);
  // The compute set-up a throughput is read against ("kind":"compute").
  void OnCompute(const ComputeSetup& compute, double flops_per_token);
  void OnStep(const StepResult& step);
  // Peak resident memory of the coordinator and of each expert process it
  // started, in bytes ("kind":"memory"; experts empty when none).
  void OnMemory(int64_t coordinator, const std::vector<int64_t>& experts);
  // CPU time over `steps` timed steps lasting `wall_seconds` in all, per
  // step: the coordinator's and each expert process's it started, and the
  // share of `cores` cores that all of them used ("kind":"cpu"). Returns it
  // as a line to print: "CPU per step over 55 steps: coordinator 54.3
  // core-ms, expert processes 27.1, 27.4 core-ms; 74% of 2 cores' 218.7 core-ms".
  std::string OnCpu(int64_t steps, double wall_seconds, int cores, double coordinator_seconds,
             const std::vector<double>& expert_seconds);
  void OnEval(int64_t step, const EvalResult& eval);
  // A run stopped by a signal after `step` ("kind":"stop"; `checkpoint` is
  // the directory written on the way out, or empty).
  void OnStop(int64_t step, const std::string& signal, const std::string& checkpoint);
  // "step 120/600 | loss 2.31 | val ppl 9.84 | CV 0.12 | top share 0.41 |
  // 5.3k tok/s | MFU 38% | ETA 1m12s" (MFU when the GEMM rate is known)
  std::string ProgressLine() const;
  // Expert CV, group CV, MaxVio, groups/token, the top expert's share inside
  // its group, the load entropy and mean ||pi||^2 per MoE layer over the last
  // `window` steps (counts summed, then the statistic), and the controller's
  // bias range when it is on.
  std::string FinalReport() const;
  double last_val_loss() const { return last_val_loss_; }

 private:
  RunLog(std::ofstream out, int64_t total_steps, int window, bool resumed)
      : out_(std::move(out)), total_steps_(total_steps), window_(window), resumed_(resumed) {}
  // One line of metrics.jsonl, flushed.
  void WriteLine(const std::string& json);

  std::ofstream out_;
  int64_t total_steps_;
  int window_;
  bool resumed_;
  std::deque<StepResult> recent_;
  double seconds_ = 0;
  int64_t steps_seen_ = 0;  // by this process (a resumed run starts late)
  int64_t tokens_ = 0;
  double flops_ = 0;
  double last_val_loss_ = -1;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_RUN_LOG_H_
