#include "prim/uring.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/uio.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <liburing.h>

#include "prim/file.h"
#include "prim/unique_fd.h"

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

namespace {

// Note [io_uring probe] (memascend/system.h). Each step records one IoUringCheck; the
// first failure ends the probe, since the steps after it build on it.
class UringProber {
 public:
  explicit UringProber(std::string_view fail_on) : fail_on_(fail_on) {}

  IoUringInfo Run() {
    auto ring = UringRing::Create(8);
    if (!Check("setup", ring.ok(), ring.ok() ? "" : std::string(ring.status().message()))) {
      return Finish();
    }
    io_uring* r = ring->get();
    info_.features = ring->features();
    if (!Nop(r)) return Finish();
    OpcodeProbe(r);
    if (!OpenScratch()) return Finish();
    if (!ReadWrite(r)) return Finish();
    if (!EventFdRead(r)) return Finish();
    if (!FixedReadWrite(r)) return Finish();
    info_.available = true;
    return Finish();
  }

 private:
  static constexpr std::size_t kBlock = 4096;
  static constexpr std::uint64_t kTag = 0x6d656d61;
  // The probe holds one entry at a time in a ring of eight: never seen, but checked.
  static constexpr const char* kNoEntry = "the ring has no free submission entry";

  // Records a step; a forced failure (tests: `fail_on`) counts as the step failing.
  bool Check(std::string_view name, bool ok, std::string detail) {
    if (ok && name == fail_on_) {
      ok = false;
      detail = "failed on purpose (a test's forced failure)";
    }
    info_.checks.push_back(IoUringCheck{std::string(name), ok, std::move(detail)});
    // The opcode probe decides nothing: the operations are tried below.
    if (!ok && info_.unavailable_reason.empty() && name != "opcode probe") {
      info_.unavailable_reason = fmt::format("io_uring {}: {}", name, info_.checks.back().detail);
    }
    return ok;
  }

  IoUringInfo Finish() { return std::move(info_); }

  // Submits the prepared entry and waits for its completion with io_uring_enter's own
  // wait, as the engine does. Returns the completion's result, or a negative errno.
  static int SubmitAndWait(io_uring* r, std::string* why) {
    int rc = io_uring_submit_and_wait(r, 1);
    if (rc < 0) {
      *why = fmt::format("io_uring_submit_and_wait: {}", std::strerror(-rc));
      return rc;
    }
    io_uring_cqe* cqe = nullptr;
    do {
      rc = io_uring_wait_cqe(r, &cqe);
    } while (rc == -EINTR);
    if (rc < 0 || cqe == nullptr) {
      *why = fmt::format("io_uring_wait_cqe: {}", std::strerror(rc < 0 ? -rc : EIO));
      return rc < 0 ? rc : -EIO;
    }
    const int res = cqe->res;
    io_uring_cqe_seen(r, cqe);
    if (res < 0) *why = std::strerror(-res);
    return res;
  }

  // A NOP, submitted without waiting and then polled for at most two seconds: a ring
  // that accepts entries but never completes them (seen in sandboxes) must not hang the
  // probe.
  bool Nop(io_uring* r) {
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("nop", false, kNoEntry);
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, kTag);
    const int rc = io_uring_submit(r);
    if (rc != 1) {
      return Check(
          "nop", false,
          fmt::format("io_uring_submit: {}", rc < 0 ? std::strerror(-rc) : "not consumed"));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(r, &cqe) != 0 || cqe == nullptr) {
      if (std::chrono::steady_clock::now() > deadline) {
        return Check("nop", false, "submitted, but no completion within 2 s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const bool ok = cqe->res >= 0 && io_uring_cqe_get_data64(cqe) == kTag;
    const std::string detail =
        ok ? "" : (cqe->res < 0 ? std::string(std::strerror(-cqe->res)) : "a foreign completion");
    io_uring_cqe_seen(r, cqe);
    return Check("nop", ok, detail);
  }

  void OpcodeProbe(io_uring* r) {
    io_uring_probe* probe = io_uring_get_probe_ring(r);
    if (probe == nullptr) {
      Check("opcode probe", false, "io_uring_register(IORING_REGISTER_PROBE) refused");
      return;
    }
    std::string missing;
    for (auto [op, name] : {std::pair{IORING_OP_READ, "READ"},
                            {IORING_OP_WRITE, "WRITE"},
                            {IORING_OP_READ_FIXED, "READ_FIXED"},
                            {IORING_OP_WRITE_FIXED, "WRITE_FIXED"}}) {
      if (io_uring_opcode_supported(probe, op) == 0) missing += fmt::format(" {}", name);
    }
    io_uring_free_probe(probe);
    Check("opcode probe", true,
          missing.empty() ? "READ, WRITE, READ_FIXED, WRITE_FIXED listed"
                          : fmt::format("not listed:{}", missing));
  }

  // An unnamed file in the first of $TMPDIR, /tmp, /var/tmp and the working directory
  // that takes one; O_DIRECT where the file system allows it.
  bool OpenScratch() {
    std::vector<std::string> dirs;
    if (const char* tmp = std::getenv("TMPDIR"); tmp != nullptr && *tmp != '\0')
      dirs.push_back(tmp);
    for (const char* d : {"/tmp", "/var/tmp", "."}) dirs.push_back(d);
    std::string tried;
    for (const std::string& dir : dirs) {
      for (int direct : {O_DIRECT, 0}) {
        int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | direct, 0600);
        if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR)) {
          // No O_TMPFILE on this file system: a named file, unlinked at once.
          std::string path = dir + "/memascend-probe-XXXXXX";
          fd = ::mkostemp(path.data(), O_CLOEXEC | direct);
          if (fd >= 0) ::unlink(path.c_str());
        }
        if (fd >= 0) {
          file_ = UniqueFd(fd);
          info_.direct_io = direct != 0;
          info_.probe_dir = dir;
          return Check("scratch file", true,
                       fmt::format("in {}, {}", dir,
                                   direct != 0 ? "O_DIRECT"
                                               : "buffered (the file system refuses O_DIRECT)"));
        }
        if (direct == 0)
          tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", dir, std::strerror(errno));
      }
    }
    return Check("scratch file", false, fmt::format("no directory takes a file ({})", tried));
  }

  bool ReadWrite(io_uring* r) {
    buffer_.reset(static_cast<std::byte*>(std::aligned_alloc(kBlock, 2 * kBlock)));
    if (buffer_ == nullptr) return Check("write", false, "no memory for the probe's buffer");
    std::memset(buffer_.get(), 0x5a, kBlock);
    std::string why;
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("write", false, kNoEntry);
    io_uring_prep_write(sqe, file_.get(), buffer_.get(), kBlock, 0);
    int res = SubmitAndWait(r, &why);
    if (!Check("write", res == static_cast<int>(kBlock),
               res >= 0 && why.empty() ? fmt::format("{} of {} bytes", res, kBlock) : why)) {
      return false;
    }
    std::memset(buffer_.get(), 0, kBlock);
    sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("read", false, kNoEntry);
    io_uring_prep_read(sqe, file_.get(), buffer_.get(), kBlock, 0);
    res = SubmitAndWait(r, &why);
    const bool same = res == static_cast<int>(kBlock) &&
                      std::all_of(buffer_.get(), buffer_.get() + kBlock,
                                  [](std::byte b) { return b == std::byte{0x5a}; });
    info_.op_write = true;
    info_.op_read = same;
    return Check("read", same,
                 res < 0 ? why : (same ? "" : fmt::format("{} bytes, not what was written", res)));
  }

  bool EventFdRead(io_uring* r) {
    auto event = MakeEventFd();
    if (!event.ok()) return Check("eventfd read", false, std::string(event.status().message()));
    SignalEventFd(event->get());
    std::uint64_t value = 0;
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("eventfd read", false, kNoEntry);
    io_uring_prep_read(sqe, event->get(), &value, sizeof(value), 0);
    std::string why;
    const int res = SubmitAndWait(r, &why);
    return Check("eventfd read", res == sizeof(value) && value != 0,
                 res < 0 ? why : (res == sizeof(value) ? "" : fmt::format("{} bytes", res)));
  }

  bool FixedReadWrite(io_uring* r) {
    int fd = file_.get();
    int rc = io_uring_register_files(r, &fd, 1);
    info_.registered_files = rc == 0;
    if (!Check("registered files", rc == 0,
               rc == 0 ? "" : fmt::format("io_uring_register_files: {}", std::strerror(-rc)))) {
      return false;
    }
    iovec iov{buffer_.get(), 2 * kBlock};
    rc = io_uring_register_buffers(r, &iov, 1);
    info_.registered_buffers = rc == 0;
    if (!Check("registered buffers", rc == 0,
               rc == 0
                   ? ""
                   : fmt::format("io_uring_register_buffers: {}{}", std::strerror(-rc),
                                 rc == -ENOMEM ? " (raise RLIMIT_MEMLOCK, `ulimit -l`)" : ""))) {
      return false;
    }
    std::byte* second = buffer_.get() + kBlock;
    std::memset(second, 0xa5, kBlock);
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("write_fixed", false, kNoEntry);
    io_uring_prep_write_fixed(sqe, 0, second, kBlock, kBlock, 0);
    sqe->flags |= IOSQE_FIXED_FILE;
    std::string why;
    int res = SubmitAndWait(r, &why);
    info_.op_write_fixed = res == static_cast<int>(kBlock);
    if (!Check("write_fixed", info_.op_write_fixed,
               res < 0 ? why : fmt::format("{} of {} bytes", res, kBlock))) {
      return false;
    }
    std::memset(second, 0, kBlock);
    sqe = io_uring_get_sqe(r);
    if (sqe == nullptr) return Check("read_fixed", false, kNoEntry);
    io_uring_prep_read_fixed(sqe, 0, second, kBlock, kBlock, 0);
    sqe->flags |= IOSQE_FIXED_FILE;
    res = SubmitAndWait(r, &why);
    info_.op_read_fixed =
        res == static_cast<int>(kBlock) &&
        std::all_of(second, second + kBlock, [](std::byte b) { return b == std::byte{0xa5}; });
    return Check("read_fixed", info_.op_read_fixed,
                 res < 0 ? why
                         : (info_.op_read_fixed
                                ? (info_.direct_io ? "a registered file opened with O_DIRECT" : "")
                                : fmt::format("{} bytes, not what was written", res)));
  }

  struct Free {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };

  std::string_view fail_on_;
  IoUringInfo info_;
  UniqueFd file_;
  std::unique_ptr<std::byte, Free> buffer_;  // two blocks
};

}  // namespace

IoUringInfo RunIoUringProbe(std::string_view fail_on) { return UringProber(fail_on).Run(); }

IoUringInfo ProbeIoUring(bool disabled_by_option) {
  if (disabled_by_option) {
    IoUringInfo info;
    info.unavailable_reason = "disabled by MEMASCEND_DISABLE_IO_URING";
    return info;
  }
  // Once per process: the machine's io_uring does not change while it runs.
  static const IoUringInfo probed = RunIoUringProbe({});
  return probed;
}

}  // namespace memascend::prim
