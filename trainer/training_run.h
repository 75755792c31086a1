#ifndef HIMOE_TRAINER_TRAINING_RUN_H_
#define HIMOE_TRAINER_TRAINING_RUN_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/compute_setup.h"
#include "trainer/data_parallel.h"
#include "trainer/run_log.h"
#include "trainer/trainer.h"
#include "trainer/trainer_flags.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace himoe::local {
class LocalExpertCluster;
}  // namespace himoe::local

namespace himoe::trainer {

class TrainerMetrics;

// One himoe-trainer run, in three parts: Create places the experts
// (--experts: spawned processes, a cluster file's services, or in process);
// Train trains to the last step, evaluating, checkpointing, stopping
// between steps on a stop signal, and, under --on_group_failure=
// wait_and_resume, recovering from a failed expert group; Report prints the
// final report and logs the peak memory. The spawned processes stop with
// the object.
class TrainingRun {
 public:
  // `flags` checked by TrainerOptionsFromFlags; <out_dir> is created.
  // `compute`: the set-up already made (ConfigureCompute). `registry`: where
  // the training metrics go, or null for none.
  static absl::StatusOr<std::unique_ptr<TrainingRun>> Create(
      const TrainerFlags& flags, const ComputeSetup& compute,
      std::shared_ptr<prometheus::Registry> registry);
  ~TrainingRun();

  // Trains to the last step (first_val(), last_val() then hold the
  // validation losses where it began and ended).
  absl::Status Train();
  // The final report, memory and the losses, on stderr and in the run log.
  absl::Status Report();

  // The stop signal the run stopped on (Train then returns CANCELLED naming
  // it), or 0.
  int stop_signal() const { return stop_signal_; }
  const TrainerOptions& options() const { return options_; }
  Trainer& trainer() { return *trainer_; }
  double first_val() const { return first_val_; }
  double last_val() const { return last_val_; }

 private:
  TrainingRun(const TrainerFlags& flags, const ComputeSetup& compute);
  absl::Status PlaceExperts();
  absl::Status StartLocalExperts();
  absl::Status UseClusterExperts();
  // Creates the trainer (which begins a run on every group), resumes it
  // from the newest checkpoint when asked, and evaluates where it starts.
  absl::StatusOr<double> Start(bool resume);
  // Steps until the last, from validation loss `val`; the last one.
  absl::StatusOr<double> TrainLoop(double val);
  // After a step: evaluation and checkpoint when due, the progress line.
  absl::StatusOr<double> AfterStep(const StepResult& r, bool eval, bool checkpoint, double val);
  absl::StatusOr<double> Evaluate(int64_t step);
  absl::Status SaveCheckpointNow();
  // A stop signal between steps: a checkpoint of the steps since the last
  // (with --checkpoint_every), a "stop" line in the run log, and CANCELLED
  // naming the signal and where to resume.
  absl::Status StopOnSignal(int sig);
  // Until every group serves again (restarting exited local processes), for
  // up to --group_wait_s.
  absl::Status WaitForGroups();

  bool lead() const { return data_parallel_ == nullptr || data_parallel_->rank() == 0; }
  // The stop signal any rank got since the last step (each rank's, summed
  // over the ranks), so that every rank stops after the same step.
  absl::StatusOr<int> AgreedStopSignal();

  TrainerFlags flags_;
  ComputeSetup compute_;
  // One rank of several (--world_size > 1): rank 0 evaluates, checkpoints
  // and prints; every rank writes its run log (<out_dir>/rank<r>/ but rank
  // 0's) and resumes from <out_dir>/checkpoints.
  std::unique_ptr<DataParallel> data_parallel_;
  std::string log_dir_;
  TrainerOptions options_;
  std::string checkpoints_;
  std::unique_ptr<local::LocalExpertCluster> spawned_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<TrainerMetrics> metrics_;
  std::unique_ptr<Trainer> trainer_;
  std::unique_ptr<RunLog> log_;
  int64_t checkpointed_step_ = 0;  // the newest checkpoint's, or where the run began
  double val_ = 0;                 // the latest validation loss
  int stop_signal_ = 0;
  double first_val_ = 0;
  double last_val_ = 0;
};

// --experts=local's M himoe-expert processes for `model` (logs in
// <out_dir>/experts), started and waited for.
absl::StatusOr<std::unique_ptr<local::LocalExpertCluster>> StartLocalExpertProcesses(
    const TrainerFlags& flags, const model::ModelOptions& model);

// A step, evaluation or checkpoint that failed because a group went away or
// did not answer in time: what --on_group_failure=wait_and_resume recovers.
bool IsGroupFailure(const absl::Status& status);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_TRAINING_RUN_H_
