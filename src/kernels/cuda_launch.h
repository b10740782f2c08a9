// kernels/cuda_launch.h: the plain interface between the CUDA sources (kernels/*.cu,
// compiled by nvcc) and the library (compiled by the host compiler). No Abseil here:
// nvcc sees only these types. Results are cudaError_t values as int.
#ifndef MEMASCEND_SRC_KERNELS_CUDA_LAUNCH_H_
#define MEMASCEND_SRC_KERNELS_CUDA_LAUNCH_H_

#include <cstddef>

namespace memascend::cuda_internal {

// dtype: 0 fp32, 1 fp16, 2 bf16; -1 for "no tensor" (an Adam without a working copy).
struct DeviceTensor {
  const void* data;
  unsigned long long elements;
  int dtype;
};

struct AdamDeviceArgs {
  float* master;
  float* m;
  float* v;
  const void* grad;
  int grad_type;
  void* out;
  int out_type;
  float b1, b2, one_minus_b1, one_minus_b2, eps, l2, decay, step_size, inv_sqrt_bc2, grad_mul;
};

// Sets *flag (device memory) to 1 if any element is inf or NaN; never clears it.
// One launch per 64 tensors, all on `stream`.
int LaunchOverflowCheck(const DeviceTensor* tensors, int count, unsigned int* flag, void* stream);
int LaunchFusedAdam(const AdamDeviceArgs& args, unsigned long long elements, void* stream);
const char* ErrorString(int error);

}  // namespace memascend::cuda_internal

#endif  // MEMASCEND_SRC_KERNELS_CUDA_LAUNCH_H_
