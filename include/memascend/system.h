// memascend/system.h: what this machine can do, probed at run time.
//
// Every MemAscend layer picks its backend from a SystemInfo and reports what it
// picked: io_uring or a thread pool for I/O, CUDA-registered or mlock'ed host memory,
// the widest SIMD level for the CPU kernels. Probing never fails: a missing capability
// is a fact recorded with its reason (io_uring disabled by sysctl or seccomp, no CUDA
// driver, no NUMA support), not an error.
//
//   memascend::SystemInfo info = memascend::ProbeSystem();
//   if (info.io_backend == memascend::IoBackendKind::kIoUring) { ... }
//   std::puts(memascend::ToJson(info).c_str());
//
// Thread-safety: ProbeSystem() may be called from any thread. The io_uring probe runs once
// per process (Note [io_uring probe]) and its result is kept; the rest is probed afresh on
// each call (memory, the CUDA runtime's devices), so callers keep the result rather than
// probing per request.
#ifndef MEMASCEND_SYSTEM_H_
#define MEMASCEND_SYSTEM_H_

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace memascend {

// The I/O backends of the I/O engine, best first.
enum class IoBackendKind {
  kIoUring,     // io_uring: batched submission, registered files and buffers
  kThreadPool,  // pread/pwrite on a pool of threads (io_uring missing or disabled)
  kSync,        // pread/pwrite on the calling thread (tests, simple clients)
};

// How page-locked host memory is obtained.
enum class HostBackingKind {
  kCudaRegistered,  // mmap + cudaHostRegister: GPU copies are true DMA
  kMlock,           // mmap + mlock: locked, but unknown to any GPU driver
};

// Widest vector instruction set the CPU kernels may use on this machine.
enum class SimdLevel { kScalar, kAvx2, kAvx512 };

std::string_view ToString(IoBackendKind kind) noexcept;
std::string_view ToString(HostBackingKind kind) noexcept;
std::string_view ToString(SimdLevel level) noexcept;

inline constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();

struct CpuInfo {
  std::string model;  // "model name" from /proc/cpuinfo, empty if unknown
  int online_cpus = 0;
  // Instruction-set extensions the CPU has and the OS has enabled (XSAVE state).
  bool sse42 = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
};

// The widest SIMD level the CPU kernels may use on `cpu`, at most `cap`.
SimdLevel SelectSimd(const CpuInfo& cpu, SimdLevel cap) noexcept;

// The names of the extensions `cpu` has ("sse4.2", "avx2", "avx512f", ...), in a fixed order.
std::vector<std::string_view> FeatureNames(const CpuInfo& cpu);

struct MemoryInfo {
  std::uint64_t page_size = 0;       // bytes
  std::uint64_t huge_page_size = 0;  // bytes of the default huge page, 0 if none
  std::uint64_t huge_pages_total = 0;
  std::uint64_t total_bytes = 0;         // MemTotal
  std::uint64_t available_bytes = 0;     // MemAvailable
  std::uint64_t memlock_soft_bytes = 0;  // RLIMIT_MEMLOCK; kUnlimited for RLIM_INFINITY
  std::uint64_t memlock_hard_bytes = 0;
  bool cap_ipc_lock = false;  // CAP_IPC_LOCK: mlock is not bounded by RLIMIT_MEMLOCK
  // Bytes this process may lock: kUnlimited with CAP_IPC_LOCK, else the soft limit.
  std::uint64_t lockable_bytes() const noexcept {
    return cap_ipc_lock ? kUnlimited : memlock_soft_bytes;
  }
};

// Note [memory limit]
// What this process may still take is the least of two figures. The memory cgroup's:
// the smallest limit on the process's own cgroup and every cgroup above it up to the
// root of its hierarchy (a parent's limit binds its children), cgroup v2 `memory.max`
// ("max": none) or v1 `memory.limit_in_bytes` (none is written as a page-rounded
// LONG_MAX, 9223372036854771712: anything at or above 2^62 reads as none), less what the
// own cgroup holds now (`memory.current` / `memory.usage_in_bytes`) but for its inactive
// file cache (`inactive_file` / `total_inactive_file` of memory.stat), which the kernel
// reclaims before it kills. And the machine's: MemAvailable of /proc/meminfo. The cgroup
// is found from /proc/self/cgroup and the mounts of /proc/self/mountinfo; a file that
// cannot be read is no limit, said in `detail`. RLIMIT_MEMLOCK (MemoryInfo) bounds only
// what may be page-locked.
struct MemoryLimit {
  int cgroup_version = 0;  // 1 or 2; 0 when the process is in no memory cgroup found
  std::string cgroup_dir;  // the process's own memory cgroup directory; empty when none
  std::uint64_t cgroup_limit_bytes = kUnlimited;  // the smallest limit on the path
  std::string cgroup_limit_file;                  // the file that holds it; empty when none
  std::uint64_t cgroup_usage_bytes = 0;           // the own cgroup's charge now
  std::uint64_t cgroup_reclaimable_bytes = 0;     // its inactive file cache, within the usage
  std::uint64_t total_bytes = 0;                  // MemTotal; 0 when unknown
  std::uint64_t available_bytes = kUnlimited;     // MemAvailable; kUnlimited when unknown
  std::string detail;  // what could not be read (empty when everything could)

  // Bytes the process may still take: the least of the cgroup's limit less its usage
  // (without the reclaimable cache) and MemAvailable; kUnlimited when neither is known.
  std::uint64_t headroom_bytes() const noexcept;
  // Which of the two headroom_bytes() is, with its figures, e.g. "cgroup memory.max of
  // /sys/fs/cgroup/job/memory.max = 4.00 GiB, 120.0 MiB of it in use" or "MemAvailable
  // of /proc/meminfo = 21.3 GiB".
  std::string headroom_source() const;
  // The hard limit a budget may never pass: the cgroup's limit, else MemTotal
  // (kUnlimited when neither is known), and its description as above.
  std::uint64_t limit_bytes() const noexcept;
  std::string limit_source() const;
};

// Reads Note [memory limit]'s figures for this process. Never fails (see `detail`).
// Thread-safety: any thread; each call reads afresh.
MemoryLimit ReadMemoryLimit();

// One step of the io_uring probe: an operation the I/O engine relies on, tried for real.
struct IoUringCheck {
  std::string name;  // "setup", "nop", "opcode probe", "scratch file", "write", "read",
                     // "eventfd read", "registered files", "registered buffers",
                     // "write_fixed", "read_fixed"
  bool ok = false;
  std::string detail;  // what failed (the error), or what was seen
};

// Note [io_uring probe]
// Creating a ring proves little: some sandboxes (gVisor) accept io_uring_setup and
// complete NOP and READV only, and refuse io_uring_register with ENOSYS. So the probe
// does what the engine will do, once per process, on a scratch file in $TMPDIR (or
// /tmp), opened with O_DIRECT where that file system allows it: a NOP round trip, a
// write and a read, a read of an eventfd (the engine's wake-up), registration of the
// file and of a buffer, and a WRITE_FIXED and READ_FIXED through both. io_uring is
// `available` only when every one of these works; the first that fails is the
// `unavailable_reason`, and the I/O engine's automatic choice is then the thread pool.
// The opcode probe (IORING_REGISTER_PROBE) is recorded but decides nothing.
struct IoUringInfo {
  bool available = false;          // every check below but "opcode probe" passed
  std::string unavailable_reason;  // the first failed check, with the fix where one exists
  std::uint32_t features = 0;      // IORING_FEAT_* bits the kernel reported
  bool op_read = false;            // IORING_OP_READ / IORING_OP_WRITE seen working
  bool op_write = false;
  bool op_read_fixed = false;  // READ_FIXED / WRITE_FIXED through a registered buffer and file
  bool op_write_fixed = false;
  bool registered_files = false;     // io_uring_register_files accepted the scratch file
  bool registered_buffers = false;   // io_uring_register_buffers accepted a buffer
  bool direct_io = false;            // the scratch file was opened with O_DIRECT
  std::string probe_dir;             // where the scratch file was made
  std::vector<IoUringCheck> checks;  // in the order run; empty when disabled
};

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  std::uint64_t total_memory_bytes = 0;
  std::string pci_bus_id;
};

struct CudaInfo {
  bool built_with_cuda = false;  // the library was compiled with MEMASCEND_WITH_CUDA
  int device_count = 0;          // 0 when there is no driver or no device: not an error
  int driver_version = 0;        // e.g. 13000 for CUDA 13.0; 0 when no driver
  int runtime_version = 0;
  std::string status;  // what the runtime said, e.g. "no CUDA-capable device"
  std::vector<CudaDeviceInfo> devices;
};

struct NumaInfo {
  bool available = false;                        // the kernel supports NUMA policy calls
  int node_count = 1;                            // configured nodes; 1 when NUMA is unavailable
  std::vector<std::uint64_t> node_memory_bytes;  // per node, when available
};

struct SystemInfo {
  std::string kernel_release;  // uname -r
  CpuInfo cpu;
  MemoryInfo memory;
  MemoryLimit memory_limit;  // Note [memory limit]
  IoUringInfo io_uring;
  CudaInfo cuda;
  NumaInfo numa;
  // What the layers above pick from the facts above (and ProbeOptions).
  IoBackendKind io_backend = IoBackendKind::kThreadPool;
  std::string io_backend_reason;  // why: what worked, or which check failed
  HostBackingKind host_backing = HostBackingKind::kMlock;
  SimdLevel simd = SimdLevel::kScalar;
};

// Switches that force the fallbacks, for testing them on machines that have the real
// thing. FromEnvironment() reads MEMASCEND_DISABLE_IO_URING=1 and
// MEMASCEND_DISABLE_CUDA=1 and MEMASCEND_MAX_SIMD=scalar|avx2|avx512.
// MEMASCEND_DISABLE_CUDA=1 holds for the whole library whatever the options say:
// host memory is then mlock'ed rather than CUDA-registered, and the GPU tier reports
// kFailedPrecondition. A process forked from one that had used CUDA is treated the
// same way, since the CUDA runtime does not survive fork(); CudaInfo::status says so.
struct ProbeOptions {
  bool disable_io_uring = false;
  bool disable_cuda = false;
  SimdLevel max_simd = SimdLevel::kAvx512;

  static ProbeOptions FromEnvironment();
};

// Probes the machine. Never fails; see each field for what "missing" looks like.
SystemInfo ProbeSystem(const ProbeOptions& options);
inline SystemInfo ProbeSystem() { return ProbeSystem(ProbeOptions::FromEnvironment()); }

// One JSON object with every field above, and at top level the keys `io_uring`
// (bool), `cuda_devices` (int), `numa_nodes` (int), `memlock_limit_bytes` (int; -1
// when unlimited), `page_size`, `io_backend`, `io_backend_reason`, `host_backing` and
// `simd`. `io_uring_detail.checks` lists the probe's steps ({name, ok, detail}), and
// `memory_limit` Note [memory limit]'s figures (byte counts -1 when unlimited or unknown).

std::string ToJson(const SystemInfo& info);

}  // namespace memascend

#endif  // MEMASCEND_SYSTEM_H_
