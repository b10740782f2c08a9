#include "prim/memory.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>
#include <numa.h>
#include <numaif.h>

#include "prim/cuda.h"
#include "prim/os.h"
#include "util/strings.h"
#include "util/units.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend::prim {
namespace {

std::string MemlockAdvice(std::size_t bytes) {
  rlimit lim{};
  ::getrlimit(RLIMIT_MEMLOCK, &lim);
  const auto show = [](rlim_t v) {
    return v == RLIM_INFINITY ? std::string("unlimited") : util::FormatBytes(v);
  };
  return fmt::format(
      "locking {} failed: RLIMIT_MEMLOCK is {} (soft) / {} (hard) and this process {} "
      "CAP_IPC_LOCK; raise it with `ulimit -l unlimited`, a `memlock` line in "
      "/etc/security/limits.conf, LimitMEMLOCK= for a systemd unit, or --ulimit memlock=-1 "
      "for a container",
      util::FormatBytes(bytes), show(lim.rlim_cur), show(lim.rlim_max),
      ProbeMemory().cap_ipc_lock ? "has" : "lacks");
}

}  // namespace

absl::StatusOr<MappedRegion> MappedRegion::Map(std::size_t bytes, const RegionOptions& options) {
  if (bytes == 0 || bytes % PageSize() != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region size {} is not a positive multiple of the page size {}", bytes, PageSize()));
  }
  const bool accounting = options.backing == RegionBacking::kAccounting;
  const int prot = accounting ? PROT_NONE : PROT_READ | PROT_WRITE;
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (accounting ? MAP_NORESERVE : 0);
  // Note [region guard]: a region that holds memory ends in an inaccessible page, so no two
  // are ever adjacent. Each is locked (mlock, cudaHostRegister) on its own, and a range
  // running from one into the next, which a caller merging adjacent blocks into one copy
  // could otherwise form (DeviceParameters), would not be pinned as a whole.
  const std::size_t guard = accounting ? 0 : PageSize();
  void* p = ::mmap(nullptr, bytes + guard, prot, flags, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(
        fmt::format("mmap of {} failed: {}", util::FormatBytes(bytes), std::strerror(err)));
  }
  MappedRegion region;
  region.data_ = static_cast<std::byte*>(p);
  region.size_ = bytes;
  region.mapped_ = bytes + guard;
  region.backing_ = options.backing;
  if (accounting) return region;
  if (::mprotect(region.data_ + bytes, guard, PROT_NONE) != 0) {
    region.backing_ = RegionBacking::kAccounting;  // nothing locked yet: Reset unmaps only
    return absl::ErrnoToStatus(errno, "mprotect of a region's guard page");
  }

  if (options.numa_node >= 0) {
    if (numa_available() < 0 || options.numa_node > numa_max_node()) {
      return absl::InvalidArgumentError(
          fmt::format("NUMA node {} does not exist (this machine has {} node(s))",
                      options.numa_node, numa_available() < 0 ? 1 : numa_max_node() + 1));
    }
    unsigned long mask = 1ul << options.numa_node;  // NOLINT(google-runtime-int): mbind's type
    if (::mbind(p, bytes, MPOL_BIND, &mask, sizeof(mask) * 8, MPOL_MF_STRICT) != 0) {
      return absl::ErrnoToStatus(errno, fmt::format("mbind to NUMA node {}", options.numa_node));
    }
  }

  if (options.backing == RegionBacking::kUnlocked) return region;
  if (options.backing == RegionBacking::kMlock) {
    if (::mlock(p, bytes) != 0) {
      // Keep the region unlocked in the destructor's eyes: Reset() munlocks only kMlock.
      region.backing_ = RegionBacking::kAccounting;
      return absl::ResourceExhaustedError(MemlockAdvice(bytes));
    }
    return region;
  }

#if MEMASCEND_HAVE_CUDA
  // Touch nothing: cudaHostRegister faults the pages in and locks them itself.
  NoteCudaUse();
  const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    region.backing_ = RegionBacking::kAccounting;
    // Only a failure to allocate or lock is a shortage of memory; the rest (no device,
    // a runtime initialised before fork(), Note [cuda and fork]) are the process's state.
    if (err == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          fmt::format("cudaHostRegister: {}; {}", cudaGetErrorString(err), MemlockAdvice(bytes)));
    }
    return absl::FailedPreconditionError(fmt::format(
        "cudaHostRegister of {}: {}{}", util::FormatBytes(bytes), cudaGetErrorString(err),
        err == cudaErrorInitializationError ? " (was CUDA used before fork()?)" : ""));
  }
  return region;
#else
  region.backing_ = RegionBacking::kAccounting;
  return absl::FailedPreconditionError(
      "CUDA-registered host memory needs a library built with MEMASCEND_WITH_CUDA");
#endif
}

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      backing_(other.backing_) {}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    backing_ = other.backing_;
  }
  return *this;
}

MappedRegion::~MappedRegion() { Reset(); }

void MappedRegion::Reset() noexcept {
  if (data_ == nullptr) return;
  if (backing_ == RegionBacking::kMlock) ::munlock(data_, size_);
#if MEMASCEND_HAVE_CUDA
  if (backing_ == RegionBacking::kCudaRegistered) {
    cudaHostUnregister(data_);
    cudaGetLastError();
  }
#endif
  ::munmap(data_, mapped_);  // the guard page too (Note [region guard])
  data_ = nullptr;
  size_ = mapped_ = 0;
}

namespace {

std::uint64_t ReadStatusKb(std::string_view key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    const auto kv = util::SplitKeyValue(line, ':');
    if (!kv || kv->key != key) continue;
    std::string_view value = kv->value;
    util::ConsumeSuffix(&value, " kB");
    return util::ParseInt<std::uint64_t>(util::Trim(value)).value_or(0) * 1024;
  }
  return 0;
}

}  // namespace

std::uint64_t CurrentRssBytes() { return ReadStatusKb("VmRSS"); }
std::uint64_t PeakRssBytes() { return ReadStatusKb("VmHWM"); }

}  // namespace memascend::prim
