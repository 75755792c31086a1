#ifndef HIMOE_TRAINER_DATA_PARALLEL_H_
#define HIMOE_TRAINER_DATA_PARALLEL_H_

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace himoe::trainer {

// Where this process sits among the trainer ranks of one run.
struct DataParallelOptions {
  int rank = 0;
  int world_size = 1;
  // The rendezvous: c10d's TCPStore at master_addr:master_port, which rank 0
  // serves unless store_hosted (a launcher serves it, as torchrun's agent
  // does). Port 0 on rank 0: any free port (on_listening tells which).
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool store_hosted = false;
  // The rendezvous and every collective give up after this.
  std::chrono::milliseconds timeout{60000};
  // Process groups for the routers' statistics, one per micro-batch running
  // at once on each rank (collectives of one group go in one order).
  int lanes = 1;
  // Rank 0 serving the store: called with its port once it listens.
  std::function<void(int)> on_listening;
};

// The torchrun environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
// TORCHELASTIC_USE_AGENT_STORE) over `base`; an error naming a variable
// that is set but not a number in range.
absl::StatusOr<DataParallelOptions> DataParallelOptionsFromEnvironment(DataParallelOptions base);

// One trainer rank of world_size: c10d's TCPStore for the rendezvous and
// ProcessGroupGloo for the collectives (CPU tensors). Every rank calls the
// same collectives in the same order on each group: the main one, and each
// lane's.
class DataParallel {
 public:
  // Blocks until every rank has joined, or the timeout; then checks that
  // they agree on `fingerprint` (the run's settings), naming the first rank
  // that does not.
  static absl::StatusOr<std::unique_ptr<DataParallel>> Create(const DataParallelOptions& options,
                                                              const std::string& fingerprint = "");
  ~DataParallel();

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  int lanes() const { return options_.lanes; }

  // Sums every tensor over the ranks, in place (contiguous CPU tensors, all
  // float32 or all float64), in flat buckets of at most bucket_bytes.
  absl::Status AllReduceSum(const std::vector<at::Tensor>& tensors,
                            int64_t bucket_bytes = 32 << 20);
  // Every rank's `tensor` (the same shape and dtype on each), in rank order,
  // through lane `lane`'s group.
  absl::StatusOr<std::vector<at::Tensor>> AllGather(const at::Tensor& tensor, int lane);
  // Rank 0's `value` on every rank.
  absl::StatusOr<std::string> Broadcast(const std::string& value);
  absl::Status Barrier();

 private:
  struct Impl;
  DataParallel(const DataParallelOptions& options, std::unique_ptr<Impl> impl);
  // UNAVAILABLE for a collective that threw, naming the ranks that stopped.
  absl::Status Failed(const std::string& what, const std::exception& e);

  DataParallelOptions options_;
  std::unique_ptr<Impl> impl_;
};

// The rendezvous store a launcher serves for the ranks it starts (as
// torchrun's agent does; the ranks then run with store_hosted): c10d's
// TCPStore listening on `port` (0 = a free one) of every address.
class RendezvousStore {
 public:
  static absl::StatusOr<std::unique_ptr<RendezvousStore>> Serve(int port, int world_size,
                                                                std::chrono::milliseconds timeout);
  ~RendezvousStore();
  int port() const;

 private:
  struct Impl;
  explicit RendezvousStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_DATA_PARALLEL_H_
