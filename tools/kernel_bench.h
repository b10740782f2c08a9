// tools/kernel_bench.h: the measurements of `memascend bench kernels`.
#ifndef MEMASCEND_TOOLS_KERNEL_BENCH_H_
#define MEMASCEND_TOOLS_KERNEL_BENCH_H_

#include <cstdint>
#include <string>

#include <absl/status/statusor.h>

namespace memascend::cli {

struct KernelBenchResult {
  std::string device;  // "cpu" or "cuda"
  std::size_t elements = 0;
  int threads = 0;               // CPU threads; streaming multiprocessors on a GPU
  std::string simd;              // the CPU kernels' ISA; the GPU's name and architecture
  double read_ceiling_gbps = 0;  // a vectorised read of the fp32 gradient's bytes
  double copy_ceiling_gbps = 0;  // the better of memcpy and a vector copy, bytes read + written
  double overflow_fused_gbps = 0;
  double overflow_fused_bf16_gbps = 0;
  double overflow_baseline_gbps = 0;
  std::uint64_t overflow_fused_extra_bytes = 0;
  std::uint64_t overflow_baseline_extra_bytes = 0;
  double adam_fused_gbps = 0;  // bytes read + written
  double adam_unfused_gbps = 0;
  double adam_fused_bytes_per_element = 0;
  double adam_unfused_bytes_per_element = 0;
  std::uint64_t adam_unfused_extra_bytes = 0;
  double adam_fused_seconds = 0;
  double adam_unfused_seconds = 0;
};

absl::StatusOr<KernelBenchResult> RunKernelBench(std::size_t elements, int threads, int reps);

// The same measurements on CUDA device 0, in device memory: the CUDA kernels against
// device-side baselines (ZeRO's boolean temporaries, one kernel per Adam operation)
// and the device's ceilings (a 16-byte-load read, cudaMemcpy device to device). Extra
// bytes are device memory, read from cudaMemGetInfo (2 MiB granules). `elements` is
// rounded down to a multiple of 16. kFailedPrecondition without a usable device.
absl::StatusOr<KernelBenchResult> RunCudaKernelBench(std::size_t elements, int reps);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_KERNEL_BENCH_H_
