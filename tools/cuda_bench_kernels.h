// tools/cuda_bench_kernels.h: the device-side baselines and ceilings of
// `memascend bench kernels --device cuda` (tools/cuda_bench_kernels.cu). Plain types
// only, as kernels/cuda_launch.h: nvcc sees no Abseil. Every call enqueues on
// `stream` and returns a cudaError_t value as int (0: launched).
#ifndef MEMASCEND_TOOLS_CUDA_BENCH_KERNELS_H_
#define MEMASCEND_TOOLS_CUDA_BENCH_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace memascend::cli::cuda_bench {

// The read ceiling: every byte read once with 16-byte loads, folded, nothing written
// (unless the fold hits a value that the data cannot produce).
int ReadFold(const void* data, std::size_t bytes, std::uint32_t* sink, void* stream);

// ZeRO's check on the device, as a framework's element-wise kernels do it:
// mask[i] = isinf(x[i]) (or isnan), then any(mask) into *out (0 or 1, never cleared).
int IsInf(const float* x, bool* mask, std::size_t n, void* stream);
int IsNan(const float* x, bool* mask, std::size_t n, void* stream);
int Any(const bool* mask, std::size_t n, std::uint32_t* out, void* stream);

// The unfused Adam: one kernel per operation, as an optimizer written with a
// framework's element-wise ops (foreach or not) runs it.
int Unscale(const std::uint16_t* grad_bf16, float* grad, float mul, std::size_t n, void* stream);
int Moment(float* m, const float* g, float beta1, std::size_t n, void* stream);
int SecondMoment(float* v, const float* g, float beta2, std::size_t n, void* stream);
int Update(float* p, const float* m, const float* v, float decay, float step_size,
           float inv_sqrt_bc2, float eps, std::size_t n, void* stream);
int ToBf16(const float* p, std::uint16_t* out, std::size_t n, void* stream);

}  // namespace memascend::cli::cuda_bench

#endif  // MEMASCEND_TOOLS_CUDA_BENCH_KERNELS_H_
