#include "prim/uring.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include <fmt/format.h>
#include <liburing.h>

namespace memascend::prim {
namespace {

// kernel.io_uring_disabled: 0 enabled, 1 only for the io_uring_group, 2 disabled.
int ReadIoUringDisabledSysctl() {
  std::FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "re");
  if (f == nullptr) return 0;
  int value = 0;
  if (std::fscanf(f, "%d", &value) != 1) value = 0;
  std::fclose(f);
  return value;
}

std::string ExplainSetupError(int err) {
  const int sysctl = ReadIoUringDisabledSysctl();
  if ((err == EPERM || err == EACCES) && sysctl != 0) {
    return fmt::format(
        "io_uring_setup: {}: disabled by sysctl kernel.io_uring_disabled={} (set it to 0, or "
        "add this user to kernel.io_uring_group)",
        std::strerror(err), sysctl);
  }
  if (err == ENOSYS || err == EPERM) {
    return fmt::format(
        "io_uring_setup: {}: the kernel lacks io_uring or a seccomp filter blocks it "
        "(containers often do; allow io_uring_setup/enter/register)",
        std::strerror(err));
  }
  if (err == ENOMEM) {
    return fmt::format(
        "io_uring_setup: {}: could not map the rings (RLIMIT_MEMLOCK too small on kernels "
        "before 5.12? raise it with `ulimit -l`)",
        std::strerror(err));
  }
  return fmt::format("io_uring_setup: {}", std::strerror(err));
}

}  // namespace

UringRing::UringRing(std::unique_ptr<io_uring> ring) noexcept : ring_(std::move(ring)) {}
UringRing::UringRing(UringRing&&) noexcept = default;
UringRing& UringRing::operator=(UringRing&& other) noexcept {
  if (this != &other) {
    if (ring_) io_uring_queue_exit(ring_.get());
    ring_ = std::move(other.ring_);
  }
  return *this;
}
UringRing::~UringRing() {
  if (ring_) io_uring_queue_exit(ring_.get());
}

unsigned UringRing::features() const noexcept { return ring_ ? ring_->features : 0; }

absl::StatusOr<UringRing> UringRing::Create(unsigned entries, unsigned flags) {
  auto ring = std::make_unique<io_uring>();
  const int rc = io_uring_queue_init(entries, ring.get(), flags);
  if (rc < 0) {
    const int err = -rc;
    return absl::Status(absl::ErrnoToStatus(err, "").code(), ExplainSetupError(err));
  }
  return UringRing(std::move(ring));
}

IoUringInfo ProbeIoUring(bool disabled_by_option) {
  IoUringInfo info;
  if (disabled_by_option) {
    info.unavailable_reason = "disabled by MEMASCEND_DISABLE_IO_URING";
    return info;
  }
  auto ring = UringRing::Create(4);
  if (!ring.ok()) {
    info.unavailable_reason = std::string(ring.status().message());
    return info;
  }
  io_uring* r = ring->get();
  info.features = ring->features();

  // A ring that can be created but never completes anything (some sandboxes) is no use.
  io_uring_sqe* sqe = io_uring_get_sqe(r);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, 0x6d656d61);
  int rc = io_uring_submit(r);
  if (rc != 1) {
    info.unavailable_reason =
        fmt::format("io_uring_submit(NOP): {}", rc < 0 ? std::strerror(-rc) : "not consumed");
    return info;
  }
  io_uring_cqe* cqe = nullptr;
  do {
    rc = io_uring_wait_cqe(r, &cqe);
  } while (rc == -EINTR);
  if (rc < 0 || cqe == nullptr || cqe->res < 0 || io_uring_cqe_get_data64(cqe) != 0x6d656d61) {
    info.unavailable_reason = fmt::format(
        "io_uring NOP did not complete: {}",
        rc < 0 ? std::strerror(-rc) : (cqe && cqe->res < 0 ? std::strerror(-cqe->res) : "bad cqe"));
    return info;
  }
  io_uring_cqe_seen(r, cqe);

  if (io_uring_probe* probe = io_uring_get_probe_ring(r); probe != nullptr) {
    info.op_read = io_uring_opcode_supported(probe, IORING_OP_READ) != 0;
    info.op_write = io_uring_opcode_supported(probe, IORING_OP_WRITE) != 0;
    info.op_read_fixed = io_uring_opcode_supported(probe, IORING_OP_READ_FIXED) != 0;
    info.op_write_fixed = io_uring_opcode_supported(probe, IORING_OP_WRITE_FIXED) != 0;
    io_uring_free_probe(probe);
  }
  if (!info.op_read || !info.op_write) {
    info.unavailable_reason = "kernel io_uring lacks IORING_OP_READ/WRITE (need Linux >= 5.6)";
    return info;
  }
  info.available = true;
  return info;
}

}  // namespace memascend::prim
