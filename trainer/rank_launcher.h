#ifndef HIMOE_TRAINER_RANK_LAUNCHER_H_
#define HIMOE_TRAINER_RANK_LAUNCHER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/trainer_flags.h"

namespace himoe::trainer {

// himoe-trainer --ranks N, as torchrun starts a job on one host: serves the
// rendezvous store, starts the expert processes once with --experts=local,
// starts N ranks of this program (`args`: its command line after argv[0],
// --ranks dropped from it; each rank gets --world_size, --rank, the store's
// port, --expert_addresses with local experts, and --threads of its share of
// the cores), follows rank 0's log on stderr and waits. A stop signal goes to
// every rank (they stop after the same step; rank 0 checkpoints). When a
// rank fails the others fail within seconds, and any left after 10 s are
// killed; if an expert process had exited, under wait_and_resume, the group
// and then every rank start again from the newest checkpoint (up to
// --max_group_restarts times). Logs: <out_dir>/rank<r>.log (the last
// attempt's; the one before as .previous). Returns the exit code: 0, the
// first failed rank's, or 128 + the stop signal.
absl::StatusOr<int> LaunchRanks(const TrainerFlags& flags, const std::vector<std::string>& args);

// `args` without --ranks (as --ranks=N or --ranks N).
std::vector<std::string> WithoutRanksFlag(const std::vector<std::string>& args);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_RANK_LAUNCHER_H_
