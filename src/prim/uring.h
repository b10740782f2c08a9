// prim/uring.h: the io_uring ring handle and the io_uring capability probe.
#ifndef MEMASCEND_SRC_PRIM_URING_H_
#define MEMASCEND_SRC_PRIM_URING_H_

#include <memory>
#include <string_view>

#include <absl/status/statusor.h>

#include <memascend/system.h>

struct io_uring;

namespace memascend::prim {

// Owns one io_uring instance (its fd and the shared-memory rings).
// Thread-safety: none; a ring is driven by one thread at a time.
class UringRing {
 public:
  // io_uring_queue_init(entries, flags). The error says whether io_uring is disabled
  // by the kernel.io_uring_disabled sysctl, filtered by seccomp, or missing.
  static absl::StatusOr<UringRing> Create(unsigned entries, unsigned flags = 0);

  UringRing(UringRing&&) noexcept;
  UringRing& operator=(UringRing&&) noexcept;
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;
  ~UringRing();

  io_uring* get() const noexcept { return ring_.get(); }
  unsigned features() const noexcept;

 private:
  explicit UringRing(std::unique_ptr<io_uring> ring) noexcept;
  std::unique_ptr<io_uring> ring_;  // heap-held so that moves never relocate it
};

// Note [io_uring probe] (memascend/system.h): tries every operation the I/O engine uses.
// Runs once per process; later calls return the first result.
IoUringInfo ProbeIoUring(bool disabled_by_option);

// The probe itself, run afresh. `fail_on` names a check (IoUringCheck::name) to report
// as failed, as a machine without it would: the tests' way to see the fallback on a
// machine where everything works.
IoUringInfo RunIoUringProbe(std::string_view fail_on);

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_URING_H_
