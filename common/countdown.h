#ifndef HIMOE_COMMON_COUNTDOWN_H_
#define HIMOE_COMMON_COUNTDOWN_H_

#include <condition_variable>
#include <mutex>

namespace himoe {

// Waits until Done() has been called `count` times; what each caller wrote
// before its Done() is visible after Wait(). A std::mutex and condition
// variable, not abseil's BlockingCounter: ThreadSanitizer sees pthread locks
// in Debian's uninstrumented abseil, not abseil's own atomics and futexes
// (scripts/tsan.sh).
class Countdown {
 public:
  explicit Countdown(int count) : pending_(count) {}
  Countdown(const Countdown&) = delete;
  Countdown& operator=(const Countdown&) = delete;

  void Done() {
    // Notified under the lock: the waiter may destroy this as soon as it can
    // take the lock.
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) all_done_.notify_all();
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    all_done_.wait(lock, [this] { return pending_ <= 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable all_done_;
  int pending_;  // guarded by mu_
};

}  // namespace himoe

#endif  // HIMOE_COMMON_COUNTDOWN_H_
