// Wall-clock time summed into a counter: Timed adds its scope's seconds when it ends.
// Thread-safety: the counter is the caller's to guard (a Timed made under a lock must end
// under it). Lifetime: the counter must outlive the Timed.
#ifndef MEMASCEND_SRC_UTIL_TIMED_H_
#define MEMASCEND_SRC_UTIL_TIMED_H_

#include <chrono>

namespace memascend::util {

class Timed {
 public:
  explicit Timed(double* total) noexcept : total_(total), start_(Clock::now()) {}
  ~Timed() { *total_ += std::chrono::duration<double>(Clock::now() - start_).count(); }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  double* total_;
  Clock::time_point start_;
};

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_TIMED_H_
