// The CUDA kernels against the CPU ones. Without a device (or a CUDA build) the calls
// must say so with kFailedPrecondition; the comparisons run where a GPU is present.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/cuda_kernels.h>
#include <memascend/system.h>
#include <memascend/version.h>

#include "testing/status_matchers.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;

bool HaveGpu() { return ProbeSystem(ProbeOptions{}).cuda.device_count > 0; }

TEST(CudaKernels, WithoutAGpuTheyReportIt) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is present: the comparisons below run instead";
  std::uint32_t flag = 0;
  const TensorView none[] = {{&flag, 1, DType::kF32}};
  EXPECT_THAT(CudaHasOverflow(none, &flag, CudaStreamView()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  float x = 0;
  EXPECT_THAT(
      CudaFusedAdam(AdamConfig{}, &x, &x, &x, {&x, 1, DType::kF32}, {}, 1, CudaStreamView()),
      StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(
      CudaFusedAdam(AdamConfig{}, &x, &x, &x, {&x, 2, DType::kF32}, {}, 1, CudaStreamView()),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

#if MEMASCEND_HAVE_CUDA
template <typename T>
T* ToDevice(const std::vector<T>& host) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(d);
}
template <typename T>
std::vector<T> ToHost(const T* d, std::size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

TEST(CudaKernels, OverflowCheckFindsWhatTheCpuFinds) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> clean(1 << 20, 1.5f);
  std::vector<std::uint16_t> half(70001, FloatToHalf(2.0f));
  std::uint32_t* flag = ToDevice(std::vector<std::uint32_t>{0});
  float* d_clean = ToDevice(clean);
  std::uint16_t* d_half = ToDevice(half);
  std::vector<TensorView> list;
  for (int i = 0; i < 100; ++i)
    list.push_back({d_clean, clean.size(), DType::kF32});  // > 64: two launches
  list.push_back({d_half, half.size(), DType::kF16});
  ASSERT_OK(CudaHasOverflow(list, flag, CudaStreamView()));
  EXPECT_EQ(ToHost(flag, 1)[0], 0u);
  half[70000] = 0x7c00;  // +inf, the last element of the last tensor
  cudaMemcpy(d_half, half.data(), half.size() * 2, cudaMemcpyHostToDevice);
  ASSERT_OK(CudaHasOverflow(list, flag, CudaStreamView()));
  EXPECT_EQ(ToHost(flag, 1)[0], 1u);
  cudaFree(flag);
  cudaFree(d_clean);
  cudaFree(d_half);
}

TEST(CudaKernels, FusedAdamMatchesTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const std::size_t n = 100003;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<std::uint16_t> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    g[i] = FloatToBFloat16(normal(rng) * 100.0f);
  }
  float *dp = ToDevice(p), *dm = ToDevice(m), *dv = ToDevice(v);
  std::uint16_t* dg = ToDevice(g);
  std::uint16_t* dout = ToDevice(std::vector<std::uint16_t>(n));
  AdamConfig c;
  c.weight_decay = 0.01f;
  c.grad_multiplier = 1.0f / 128;
  std::vector<std::uint16_t> out(n);
  for (int step = 1; step <= 10; ++step) {
    c.step = step;
    ASSERT_OK(FusedAdam(c, p, m, v, {g.data(), n, DType::kBF16}, {out.data(), n, DType::kBF16}));
    ASSERT_OK(CudaFusedAdam(c, dp, dm, dv, {dg, n, DType::kBF16}, {dout, n, DType::kBF16}, n,
                            CudaStreamView()));
  }
  const std::vector<float> gp = ToHost(dp, n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(gp[i], p[i], 2e-5f * std::max(1.0f, std::fabs(p[i]))) << i;
  }
  for (float* d : {dp, dm, dv}) cudaFree(d);
  cudaFree(dg);
  cudaFree(dout);
}
#endif

}  // namespace
}  // namespace memascend
