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
  // The fused Adam over the same elements one call per part of adam_part_elements, as
  // OffloadedAdam runs it (CPU only).
  std::size_t adam_part_elements = 0;
  double adam_parts_gbps = 0;
};

// `part_elements`: the part size of the per-part Adam row (memascend.torch's default).
absl::StatusOr<KernelBenchResult> RunKernelBench(std::size_t elements, int threads, int reps,
                                                 std::size_t part_elements = std::size_t{1} << 20);

// The same measurements on CUDA device 0, in device memory: the CUDA kernels against
// device-side baselines (ZeRO's boolean temporaries, one kernel per Adam operation)
// and the device's ceilings (a 16-byte-load read, cudaMemcpy device to device). Extra
// bytes are device memory, read from cudaMemGetInfo (2 MiB granules). `elements` is
// rounded down to a multiple of 16. kFailedPrecondition without a usable device.
absl::StatusOr<KernelBenchResult> RunCudaKernelBench(std::size_t elements, int reps);

// `memascend bench pcie`: copies between page-locked host memory of MemAscend's own (a
// HostArena region, cudaHostRegister'ed) and device 0, on one stream, timed with events:
// the ceiling every offloaded parameter and gradient moves under. Also a copy from
// pageable memory (what a copy without registration gets) and the time to register.
// With `chunk` (> 0, under `bytes`), the host-to-device copy is also timed as copies of
// `chunk` bytes queued back to back, as a trainer moves a group's parts: the ceiling at
// that granularity (each copy's set-up on the copy engine is paid once per chunk).
struct PcieBenchResult {
  std::string device;  // the GPU's name and architecture
  std::size_t bytes = 0;
  int reps = 0;
  std::string host_backing;     // the arena's backing ("cuda_registered")
  double register_seconds = 0;  // mapping, faulting in and registering `bytes`
  double h2d_gib_per_s = 0;     // best of `reps`
  double h2d_gib_per_s_median = 0;
  double d2h_gib_per_s = 0;
  double d2h_gib_per_s_median = 0;
  double h2d_pageable_gib_per_s = 0;  // best of `reps`, from malloc'ed memory
  std::size_t chunk_bytes = 0;        // 0: no chunked measurement
  double h2d_chunked_gib_per_s = 0;   // best of `reps`: `bytes` in copies of chunk_bytes
  double h2d_chunked_gib_per_s_median = 0;
  bool verified = false;  // the bytes came back as they went
};

// kFailedPrecondition without a usable device or a CUDA build; kResourceExhausted when
// `bytes` cannot be locked (RLIMIT_MEMLOCK) or allocated on the device.
absl::StatusOr<PcieBenchResult> RunPcieBench(std::size_t bytes, int reps, std::size_t chunk = 0);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_KERNEL_BENCH_H_
