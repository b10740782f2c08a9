// tools/io_bench.h: the direct-I/O throughput measurement behind `memascend bench io`
// and `memascend bench tune`.
#ifndef MEMASCEND_TOOLS_IO_BENCH_H_
#define MEMASCEND_TOOLS_IO_BENCH_H_

#include <cstdint>
#include <string>

#include <absl/status/statusor.h>

#include <memascend/io_engine.h>

namespace memascend::cli {

struct IoBenchConfig {
  std::string target;
  IoOp op = IoOp::kRead;
  std::size_t block = 1 << 20;
  unsigned queue_depth = 32;
  std::uint64_t size = 0;  // 0: the target's size
  IoBackendChoice backend = IoBackendChoice::kAuto;
  // Note [bench targets]: write over a target that holds something (--destroy-data).
  bool destroy = false;
};

struct IoBenchResult {
  std::uint64_t bytes = 0;
  double seconds = 0;
  double gib_per_s() const {
    return seconds > 0 ? static_cast<double>(bytes) / seconds / (1u << 30) : 0;
  }
  std::uint64_t requests = 0;
  double iops() const { return seconds > 0 ? static_cast<double>(requests) / seconds : 0; }
  IoBackendKind backend = IoBackendKind::kIoUring;
  bool filled = false;  // the target was written first so that reads touch real blocks
};

// Opens (creating and preallocating a regular file as needed) the target with O_DIRECT
// and moves `size` bytes sequentially in `block` requests, `queue_depth` in flight.
//
// Note [bench targets]: a benchmark that writes (a write, or a read that first fills a
// file it grew) writes only into a new or empty file or a target of zeros; a target that
// carries a file system, a partition table, a MemAscend volume or any other data is
// refused (kFailedPrecondition, saying what it holds) unless config.destroy, and a target
// another process has locked (a volume a trainer holds) is refused always (kUnavailable).
// The lock is held while the benchmark writes. Reads of what a target holds are allowed.
absl::StatusOr<IoBenchResult> RunIoBench(const IoBenchConfig& config);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_IO_BENCH_H_
