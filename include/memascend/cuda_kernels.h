// memascend/cuda_kernels.h: the fused kernels on a CUDA device, stream-ordered.
//
//   const memascend::TensorView grads[] = {{d_g0, n0, memascend::DType::kBF16}, ...};
//   cudaMemsetAsync(d_flag, 0, 4, stream);
//   MEMASCEND_RETURN_IF_ERROR(memascend::CudaHasOverflow(grads, d_flag,
//   memascend::CudaStreamView(stream)));
//   // d_flag (device memory) is 1 once the stream reaches this point if any value was inf/NaN
//
// All pointers are device pointers, each aligned to the size of its elements (unlike
// the CPU kernels'). Nothing synchronises: errors of the kernels themselves surface
// on the stream. A kernel reads its inputs when the stream reaches it: data copied
// in on another stream (a plain cudaMemcpy runs on the legacy default stream, which
// a cudaStreamNonBlocking stream does not wait for) must be ordered before it.
// kFailedPrecondition when the library was built without CUDA or no device is
// present; kInvalidArgument for mismatched sizes, null or misaligned pointers.
// Thread-safety: as the CUDA runtime's, per stream.
#ifndef MEMASCEND_CUDA_KERNELS_H_
#define MEMASCEND_CUDA_KERNELS_H_

#include <cstdint>
#include <span>

#include <absl/status/status.h>

#include <memascend/cuda.h>
#include <memascend/kernels.h>

namespace memascend {

// One launch per 64 tensors; sets *device_flag to 1 if any element is inf or NaN and
// never clears it (the caller zeroes it). Stops early across blocks once set.
absl::Status CudaHasOverflow(std::span<const TensorView> device_tensors, std::uint32_t* device_flag,
                             CudaStreamView stream);

// Note [adam] in memascend/kernels.h, on `elements` values.
absl::Status CudaFusedAdam(const AdamConfig& config, float* master, float* exp_avg,
                           float* exp_avg_sq, TensorView grad, MutableTensorView params_out,
                           std::size_t elements, CudaStreamView stream);

}  // namespace memascend

#endif  // MEMASCEND_CUDA_KERNELS_H_
