// Host side of the CUDA kernels: validation, error mapping, no-CUDA builds.
#include <cmath>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include <memascend/cuda_kernels.h>

#include "kernels/cuda_launch.h"
#include "kernels/isa.h"
#include "prim/cuda.h"

namespace memascend {
namespace {

#if MEMASCEND_HAVE_CUDA
int CodeOf(DType t) { return t == DType::kF32 ? 0 : t == DType::kF16 ? 1 : 2; }

absl::Status FromCuda(int error, std::string_view what) {
  if (error == 0) return absl::OkStatus();
  // No device, no driver: a capability that is missing, not a failure of the call.
  const bool missing = error == 100 /* cudaErrorNoDevice */ || error == 35 /* InsufficientDriver */;
  return absl::Status(missing ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kInternal,
                      fmt::format("{}: {}", what, cuda_internal::ErrorString(error)));
}
#else
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "the CUDA kernels need a library built with MEMASCEND_WITH_CUDA");
}
#endif

// Device loads need elements aligned to their size (a misaligned one faults the
// kernel and, with it, the stream's context).
bool Aligned(const void* p, DType t) {
  return reinterpret_cast<std::uintptr_t>(p) % SizeOf(t) == 0;
}

}  // namespace

absl::Status CudaHasOverflow(std::span<const TensorView> device_tensors, std::uint32_t* device_flag,
                             CudaStreamView stream) {
  if (device_flag == nullptr || !Aligned(device_flag, DType::kF32)) {
    return absl::InvalidArgumentError("CudaHasOverflow: the flag must be a 4-byte aligned word");
  }
  for (std::size_t i = 0; i < device_tensors.size(); ++i) {
    const TensorView& t = device_tensors[i];
    if (t.elements > 0 && (t.data == nullptr || !Aligned(t.data, t.dtype))) {
      return absl::InvalidArgumentError(
          fmt::format("CudaHasOverflow: tensor {} ({}) is null or not aligned to its {}-byte "
                      "elements",
                      i, ToString(t.dtype), SizeOf(t.dtype)));
    }
  }
#if MEMASCEND_HAVE_CUDA
  std::vector<cuda_internal::DeviceTensor> list;
  list.reserve(device_tensors.size());
  for (const TensorView& t : device_tensors) {
    if (t.elements > 0) list.push_back({t.data, t.elements, CodeOf(t.dtype)});
  }
  if (list.empty()) return absl::OkStatus();
  prim::NoteCudaUse();
  return FromCuda(cuda_internal::LaunchOverflowCheck(list.data(), static_cast<int>(list.size()),
                                                     device_flag, stream.handle),
                  "overflow check launch");
#else
  (void)device_tensors;
  (void)stream;
  return NoCuda();
#endif
}

absl::Status CudaFusedAdam(const AdamConfig& c, float* master, float* exp_avg, float* exp_avg_sq,
                           TensorView grad, MutableTensorView params_out, std::size_t elements,
                           CudaStreamView stream) {
  if (grad.elements != elements ||
      (params_out.data != nullptr && params_out.elements != elements)) {
    return absl::InvalidArgumentError(
        fmt::format("CudaFusedAdam: {} elements, gradient {}, parameters {}", elements,
                    grad.elements, params_out.elements));
  }
  if (c.step < 1 || !(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1) ||
      !(c.eps > 0)) {
    return absl::InvalidArgumentError("CudaFusedAdam: bad config");
  }
  if (!Aligned(master, DType::kF32) || !Aligned(exp_avg, DType::kF32) ||
      !Aligned(exp_avg_sq, DType::kF32) || !Aligned(grad.data, grad.dtype) ||
      (params_out.data != nullptr && !Aligned(params_out.data, params_out.dtype))) {
    return absl::InvalidArgumentError(
        "CudaFusedAdam: every array must be aligned to the size of its elements");
  }
#if MEMASCEND_HAVE_CUDA
  prim::NoteCudaUse();
  const kernels::AdamArgs k = kernels::AdamCoefficients(c);
  cuda_internal::AdamDeviceArgs a{};
  a.master = master;
  a.m = exp_avg;
  a.v = exp_avg_sq;
  a.grad = grad.data;
  a.grad_type = CodeOf(grad.dtype);
  a.out = params_out.data;
  a.out_type = CodeOf(params_out.dtype);
  a.b1 = k.b1;
  a.b2 = k.b2;
  a.one_minus_b1 = k.one_minus_b1;
  a.one_minus_b2 = k.one_minus_b2;
  a.eps = k.eps;
  a.l2 = k.l2;
  a.decay = k.decay;
  a.step_size = k.step_size;
  a.inv_sqrt_bc2 = k.inv_sqrt_bc2;
  a.grad_mul = k.grad_mul;
  return FromCuda(cuda_internal::LaunchFusedAdam(a, elements, stream.handle), "fused adam launch");
#else
  (void)master;
  (void)exp_avg;
  (void)exp_avg_sq;
  (void)stream;
  return NoCuda();
#endif
}

}  // namespace memascend
