// CUDA kernels of MemAscend: the multi-tensor overflow check and fused Adam.
// The host side is src/kernels/cuda_kernels.cpp; the contract is src/kernels/cuda_launch.h.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_launch.h"

namespace memascend::cuda_internal {
namespace {

constexpr int kMaxTensors = 64;  // per launch: the list travels as a kernel parameter
constexpr int kThreads = 256;

struct TensorList {
  const void* data[kMaxTensors];
  unsigned long long elements[kMaxTensors];
  int dtype[kMaxTensors];
  int count;
};

// True if a 32-bit word holds an inf or NaN: one fp32 value, or two 16-bit values
// whose exponent field is `mask16` (0x7c00 fp16, 0x7f80 bf16).
__device__ __forceinline__ bool BadWord(unsigned int w, int dtype) {
  if (dtype == 0) return (w & 0x7f800000u) == 0x7f800000u;
  const unsigned int m = dtype == 1 ? 0x7c00u : 0x7f80u;
  return (w & m) == m || ((w >> 16) & m) == m;
}

__device__ __forceinline__ bool BadElement(const unsigned char* p, unsigned long long i,
                                           int dtype) {
  if (dtype == 0) return BadWord(reinterpret_cast<const unsigned int*>(p)[i], 0);
  const unsigned int m = dtype == 1 ? 0x7c00u : 0x7f80u;
  return (reinterpret_cast<const unsigned short*>(p)[i] & m) == m;
}

// Note [cuda overflow check]
// Each tensor is read with 16-byte loads (four fp32 or eight 16-bit values a load)
// from its first 16-byte boundary, elements before it and after the last whole
// vector one by one; the whole grid strides over each tensor in turn. A thread ORs
// what it sees and writes the flag once per tensor if it saw anything, and blocks
// stop at the next tensor once any has set the flag. Elements must be aligned to
// their size (checked on the host).
__global__ void OverflowKernel(TensorList list, unsigned int* flag) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int t = 0; t < list.count; ++t) {
    if (*static_cast<volatile unsigned int*>(flag) != 0) return;  // another block found one
    const auto* p = static_cast<const unsigned char*>(list.data[t]);
    const unsigned long long n = list.elements[t];
    const int dtype = list.dtype[t];
    const unsigned long long size = dtype == 0 ? 4 : 2;
    const unsigned long long misalign = reinterpret_cast<unsigned long long>(p) & 15u;
    unsigned long long head = misalign == 0 ? 0 : (16 - misalign) / size;
    if (head > n) head = n;
    const unsigned long long vectors = (n - head) * size / 16;
    const unsigned long long tail = head + vectors * 16 / size;
    const auto* body = reinterpret_cast<const uint4*>(p + head * size);
    bool bad = false;
    for (unsigned long long v = first; v < vectors; v += stride) {
      const uint4 w = body[v];
      bad |= BadWord(w.x, dtype) | BadWord(w.y, dtype) | BadWord(w.z, dtype) | BadWord(w.w, dtype);
    }
    if (first < head) bad |= BadElement(p, first, dtype);
    for (unsigned long long i = tail + first; i < n; i += stride) bad |= BadElement(p, i, dtype);
    if (bad) *flag = 1u;  // every writer writes the same value
  }
}

template <int G>
__device__ float LoadGrad(const void* p, unsigned long long i) {
  if constexpr (G == 0) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (G == 1) {
    return __half2float(static_cast<const __half*>(p)[i]);
  } else {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

template <int O>
__device__ void StoreOut(void* p, unsigned long long i, float x) {
  if constexpr (O == 0) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (O == 1) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  } else if constexpr (O == 2) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  }
}

// Note [adam] in memascend/kernels.h; O == -1: no working copy.
template <int G, int O>
__global__ void AdamKernel(AdamDeviceArgs a, unsigned long long n) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float p = a.master[i];
    const float g = fmaf(LoadGrad<G>(a.grad, i), a.grad_mul, a.l2 * p);
    const float m = fmaf(a.b1, a.m[i], a.one_minus_b1 * g);
    const float v = fmaf(a.b2, a.v[i], a.one_minus_b2 * g * g);
    const float denom = fmaf(sqrtf(v), a.inv_sqrt_bc2, a.eps);
    p = fmaf(-a.step_size, m / denom, p * a.decay);
    a.m[i] = m;
    a.v[i] = v;
    a.master[i] = p;
    if constexpr (O >= 0) StoreOut<O>(a.out, i, p);
  }
}

int Blocks(unsigned long long elements) {
  unsigned long long blocks = (elements + kThreads - 1) / kThreads;
  if (blocks > 4096) blocks = 4096;
  return blocks == 0 ? 1 : static_cast<int>(blocks);
}

template <int G, int O>
int Launch(const AdamDeviceArgs& a, unsigned long long n, cudaStream_t s) {
  AdamKernel<G, O><<<Blocks(n), kThreads, 0, s>>>(a, n);
  return static_cast<int>(cudaGetLastError());
}

template <int G>
int LaunchG(const AdamDeviceArgs& a, unsigned long long n, cudaStream_t s) {
  switch (a.out == nullptr ? -1 : a.out_type) {
    case 0:
      return Launch<G, 0>(a, n, s);
    case 1:
      return Launch<G, 1>(a, n, s);
    case 2:
      return Launch<G, 2>(a, n, s);
    default:
      return Launch<G, -1>(a, n, s);
  }
}

}  // namespace

int LaunchOverflowCheck(const DeviceTensor* tensors, int count, unsigned int* flag, void* stream) {
  for (int start = 0; start < count; start += kMaxTensors) {
    TensorList list{};
    list.count = count - start < kMaxTensors ? count - start : kMaxTensors;
    unsigned long long total = 0;
    for (int i = 0; i < list.count; ++i) {
      list.data[i] = tensors[start + i].data;
      list.elements[i] = tensors[start + i].elements;
      list.dtype[i] = tensors[start + i].dtype;
      total += list.elements[i] * (list.dtype[i] == 0 ? 4 : 2) / 16;  // 16-byte vectors
    }
    OverflowKernel<<<Blocks(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(list, flag);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  return static_cast<int>(cudaSuccess);
}

int LaunchFusedAdam(const AdamDeviceArgs& a, unsigned long long n, void* stream) {
  if (n == 0) return static_cast<int>(cudaSuccess);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.grad_type) {
    case 0:
      return LaunchG<0>(a, n, s);
    case 1:
      return LaunchG<1>(a, n, s);
    default:
      return LaunchG<2>(a, n, s);
  }
}

const char* ErrorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace memascend::cuda_internal
