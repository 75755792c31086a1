#ifndef HIMOE_TRAINER_MICRO_BATCH_TURNS_H_
#define HIMOE_TRAINER_MICRO_BATCH_TURNS_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <vector>

#include "absl/status/status.h"

namespace himoe::trainer {

// The points where the micro-batches of a step that run at once must go in
// order, so that the state they change changes as in a sequential step, bit
// for bit: a layer's routing (the routers' EMA, counts and drop seeds, and
// the micro-batch's place in the order the groups add its expert gradients
// in, GroupRows::grad_position), and the sum of the dense gradients.
enum class Turn { kRoute, kGradientSum };

// At each point, micro-batch b goes only after every micro-batch before it
// has passed that point or finished. Thread-safe.
class MicroBatchTurns {
 public:
  explicit MicroBatchTurns(int layers);

  // A step's micro-batches start: every point's turn is micro-batch 0's, and
  // no error. Until then, and after End, Wait and Pass do nothing (a lone
  // Forward outside a step waits for no one).
  void Begin();
  void End();
  // Blocks until it is `micro_batch`'s turn at (`turn`, `layer`); the error
  // given to Cancel once cancelled. Every Wait that returns OK is followed by
  // Pass with the same arguments.
  absl::Status Wait(Turn turn, int layer, uint32_t micro_batch);
  void Pass(Turn turn, int layer, uint32_t micro_batch);
  // `micro_batch` passes no more points (it ended, or failed).
  void Finish(uint32_t micro_batch);
  // Wakes every waiter, now and later, with `status` (not OK).
  void Cancel(const absl::Status& status);

 private:
  int Point(Turn turn, int layer) const;

  const int layers_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<uint32_t> next_;  // per point: whose turn it is
  std::set<uint32_t> finished_;
  absl::Status error_;
  bool active_ = false;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_MICRO_BATCH_TURNS_H_
