// tools/store_bench.h: `memascend bench store`: a workload streamed through the tensor
// store, against the volume's own engine reading the same bytes.
#ifndef MEMASCEND_TOOLS_STORE_BENCH_H_
#define MEMASCEND_TOOLS_STORE_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include <absl/status/statusor.h>

namespace memascend::cli {

struct StoreBenchConfig {
  std::string workload;
  std::string volume;  // empty: $TMPDIR/memascend_store_bench.vol, removed at the end
  std::uint64_t host_budget = 256u << 20;
  std::uint64_t scale = 16;  // element counts divided by this
  std::size_t window = 4;    // tensors prefetched ahead
  int reps = 2;
  bool verify_checksums = true;
  // Format a named `volume` that holds something (a volume, a file system, data): without
  // it such a volume is refused (Note [bench targets] in io_bench.h). The default scratch
  // volume is the benchmark's own and always formatted.
  bool destroy = false;
};

struct StoreBenchResult {
  std::string workload;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;          // one pass over every tensor
  double store_read_gib_per_s = 0;  // the best forward pass
  double raw_read_gib_per_s = 0;    // the best raw pass
  // Each repetition is a raw pass and a store pass back to back (their order alternates
  // from one repetition to the next, so neither always comes first); its ratio is
  // store / raw. The median of these pairs is the figure that drift on a shared disk
  // disturbs least.
  std::vector<double> read_ratios;
  double read_ratio_median = 0;
  double write_gib_per_s = 0;  // the backward pass's write-backs
  double stall_seconds = 0;    // in the best forward pass
  std::uint64_t prefetch_hits = 0;
  std::uint64_t prefetch_misses = 0;
  std::uint64_t prefetch_dropped = 0;
  std::uint64_t peak_pinned_bytes = 0;
  std::uint64_t peak_rss_bytes = 0;
  std::string io_backend;
};

absl::StatusOr<StoreBenchResult> RunStoreBench(const StoreBenchConfig& config);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_STORE_BENCH_H_
