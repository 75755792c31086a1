// A group's training run on disk (himoe-expert --run_state_file): after every
// applied Step, the run id, world size, last applied step, weights and AdamW
// state; a group restarted on the file serves the run again from that step,
// so the trainer runs the failed step again instead of reloading a
// checkpoint.
#ifndef HIMOE_EXPERT_SERVICE_RUN_STATE_FILE_H_
#define HIMOE_EXPERT_SERVICE_RUN_STATE_FILE_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "himoe/v1/expert.pb.h"

namespace himoe::expert {

struct RunSnapshot {
  std::string run_id;
  uint32_t world_size = 1;
  uint64_t last_applied_step = 0;
  // ExpertServiceCore::GetState(include_optimizer = true): CPU copies.
  std::vector<NamedTensor> state;
};

// Writes `snapshot` to `path` atomically (readers see the old file or the
// new one), with `shape` and `group_id` in its header.
absl::Status WriteRunStateFile(const std::string& path, const v1::ExpertShape& shape, int group_id,
                               RunSnapshot snapshot);

// The snapshot in `path`; nullopt when there is no such file. A file of
// another shape or group is FAILED_PRECONDITION naming the difference; a
// truncated or corrupt one DATA_LOSS.
absl::StatusOr<std::optional<RunSnapshot>> ReadRunStateFile(const std::string& path,
                                                            const v1::ExpertShape& shape,
                                                            int group_id);

// WriteRunStateFile on a thread of its own, latest snapshot wins: Submit
// never waits for the disk, and a snapshot submitted while another is being
// written replaces any still waiting. The destructor writes the one waiting.
class RunStateWriter {
 public:
  RunStateWriter(std::string path, v1::ExpertShape shape, int group_id);
  ~RunStateWriter();
  RunStateWriter(const RunStateWriter&) = delete;
  RunStateWriter& operator=(const RunStateWriter&) = delete;

  void Submit(RunSnapshot snapshot);
  // Waits until every snapshot submitted so far is written or replaced;
  // the last write's status.
  absl::Status Flush();
  const std::string& path() const { return path_; }
  // Files written so far.
  int64_t written() const;

 private:
  void Loop();

  const std::string path_;
  const v1::ExpertShape shape_;
  const int group_id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<RunSnapshot> waiting_;  // guarded by mu_
  bool writing_ = false;                // guarded by mu_
  bool stop_ = false;                   // guarded by mu_
  absl::Status last_;                   // guarded by mu_
  int64_t written_ = 0;                 // guarded by mu_
  std::thread thread_;
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_RUN_STATE_FILE_H_
