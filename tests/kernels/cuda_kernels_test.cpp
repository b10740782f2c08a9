// The CUDA kernels against the CPU ones. Without a device (or a CUDA build) the calls
// must say so with kFailedPrecondition; the comparisons run where a GPU is present.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
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
}

TEST(CudaKernels, BadArgumentsAreRefusedBeforeAnyLaunch) {
  float x = 0;
  EXPECT_THAT(
      CudaFusedAdam(AdamConfig{}, &x, &x, &x, {&x, 2, DType::kF32}, {}, 1, CudaStreamView()),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaFusedAdam(AdamConfig{}, &x, &x, &x, {&x, 1, DType::kF32}, {&x, 3, DType::kF32}, 1,
                            CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  AdamConfig bad;
  bad.step = 0;
  EXPECT_THAT(CudaFusedAdam(bad, &x, &x, &x, {&x, 1, DType::kF32}, {}, 1, CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  bad = AdamConfig{};
  bad.beta2 = 1.0f;
  EXPECT_THAT(CudaFusedAdam(bad, &x, &x, &x, {&x, 1, DType::kF32}, {}, 1, CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const TensorView one[] = {{&x, 1, DType::kF32}};
  EXPECT_THAT(CudaHasOverflow(one, nullptr, CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Misaligned elements would fault the kernel: refused on the host.
  alignas(8) std::uint32_t words[4] = {};
  auto* odd = reinterpret_cast<std::byte*>(words) + 2;
  const TensorView misaligned[] = {{words, 1, DType::kF16}, {odd, 1, DType::kF32}};
  EXPECT_THAT(CudaHasOverflow(misaligned, words, CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("tensor 1")));
  EXPECT_THAT(CudaHasOverflow(one, reinterpret_cast<std::uint32_t*>(odd), CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaFusedAdam(AdamConfig{}, &x, &x, reinterpret_cast<float*>(odd),
                            {&x, 1, DType::kF32}, {}, 1, CudaStreamView()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

#if MEMASCEND_HAVE_CUDA
// One cudaMalloc'ed array, freed at scope end.
template <typename T>
class Device {
 public:
  explicit Device(std::size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  explicit Device(const std::vector<T>& host) : Device(host.size()) { Upload(host); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() { cudaFree(p_); }
  // Copies in and waits until they land: the kernels run on a non-blocking stream,
  // which does not wait for cudaMemcpy's legacy default stream.
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    ASSERT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void Put(std::size_t i, T value) {
    ASSERT_EQ(cudaMemcpy(static_cast<T*>(p_) + i, &value, sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  T* get() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

// A stream of its own, so that the kernels are checked stream-ordered, not only on
// the legacy default stream.
class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), cudaSuccess); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s_); }
  CudaStreamView view() const { return CudaStreamView(s_); }
  void Sync() const { ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess); }

 private:
  cudaStream_t s_ = nullptr;
};

std::uint32_t FiniteBits(DType t, std::size_t i) {
  const float f = static_cast<float>(static_cast<long>(i % 2000) - 1000) * 0.37f;
  if (t == DType::kF16) return FloatToHalf(f);
  if (t == DType::kBF16) return FloatToBFloat16(f);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

std::uint32_t Bits(DType t, float f) {
  if (t == DType::kF16) return FloatToHalf(f);
  if (t == DType::kBF16) return FloatToBFloat16(f);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// A device tensor of one of the three types, with host-side pokes.
struct DeviceTensorOf {
  DType dtype;
  std::size_t n;
  std::unique_ptr<Device<std::uint32_t>> d32;
  std::unique_ptr<Device<std::uint16_t>> d16;
  DeviceTensorOf(DType t, std::size_t count) : dtype(t), n(count) {
    if (t == DType::kF32) {
      std::vector<std::uint32_t> h(n);
      for (std::size_t i = 0; i < n; ++i) h[i] = FiniteBits(t, i);
      d32 = std::make_unique<Device<std::uint32_t>>(h);
    } else {
      std::vector<std::uint16_t> h(n);
      for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<std::uint16_t>(FiniteBits(t, i));
      d16 = std::make_unique<Device<std::uint16_t>>(h);
    }
  }
  void Put(std::size_t i, std::uint32_t bits) {
    if (d32) {
      d32->Put(i, bits);
    } else {
      d16->Put(i, static_cast<std::uint16_t>(bits));
    }
  }
  TensorView view() const {
    return d32 ? TensorView{d32->get(), n, dtype} : TensorView{d16->get(), n, dtype};
  }
};

std::uint32_t CheckOnDevice(std::span<const TensorView> list, const Stream& stream) {
  Device<std::uint32_t> flag(std::vector<std::uint32_t>{0});
  EXPECT_OK(CudaHasOverflow(list, flag.get(), stream.view()));
  stream.Sync();
  return flag.Download()[0];
}

TEST(CudaKernels, OverflowCheckFindsInfAndNanAtEveryPosition) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (std::size_t n : {1u, 2u, 31u, 33u, 255u, 1023u, 4097u, 70001u, 1048579u}) {
      DeviceTensorOf tensor(t, n);
      const TensorView one[] = {tensor.view()};
      ASSERT_EQ(CheckOnDevice(one, stream), 0u) << ToString(t) << " n=" << n;
      for (std::size_t pos : {std::size_t{0}, n / 2, n - 1, n / 3 + 1}) {
        if (pos >= n) continue;
        for (float f : bad) {
          tensor.Put(pos, Bits(t, f));
          ASSERT_EQ(CheckOnDevice(one, stream), 1u)
              << ToString(t) << " n=" << n << " pos=" << pos << " value=" << f;
          tensor.Put(pos, FiniteBits(t, pos));
        }
      }
    }
  }
}

// Views that start off a 16-byte boundary (the kernel's scalar head) and end inside
// a vector (its scalar tail): the first and last elements of the view count, the
// ones just outside it do not.
TEST(CudaKernels, OverflowCheckHonoursTheViewsEdges) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const float inf = std::numeric_limits<float>::infinity();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    const std::size_t n = 4099;
    DeviceTensorOf whole(t, n);
    const auto* base = static_cast<const std::byte*>(whole.view().data);
    for (std::size_t offset = 0; offset < 9; ++offset) {
      for (std::size_t end : {n, n - 1, n - 5}) {
        SCOPED_TRACE(std::string(ToString(t)) + " [" + std::to_string(offset) + ", " +
                     std::to_string(end) + ")");
        const TensorView view[] = {{base + offset * SizeOf(t), end - offset, t}};
        for (std::size_t inside : {offset, end - 1}) {
          whole.Put(inside, Bits(t, inf));
          EXPECT_EQ(CheckOnDevice(view, stream), 1u) << "at " << inside;
          whole.Put(inside, FiniteBits(t, inside));
        }
        for (std::size_t outside : {offset - 1, end}) {
          if (outside >= n) continue;  // offset 0 or end n: nothing outside
          whole.Put(outside, Bits(t, inf));
          EXPECT_EQ(CheckOnDevice(view, stream), 0u) << "at " << outside;
          whole.Put(outside, FiniteBits(t, outside));
        }
      }
    }
  }
}

// 129 tensors of mixed types and odd lengths: three launches of at most 64 tensors
// each. An inf in the first, the last, or one at a launch's edge is found; none is
// found when all are clean, and the flag is never cleared by a clean call.
TEST(CudaKernels, OverflowCheckLooksAcrossManyTensorsAndLaunches) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const DType types[] = {DType::kF32, DType::kF16, DType::kBF16};
  std::vector<std::unique_ptr<DeviceTensorOf>> tensors;
  std::vector<TensorView> list;
  for (int i = 0; i < 129; ++i) {
    tensors.push_back(std::make_unique<DeviceTensorOf>(types[i % 3], 1 + (i * 7919) % 5003));
    list.push_back(tensors.back()->view());
  }
  list.insert(list.begin() + 5, TensorView{nullptr, 0, DType::kF32});  // empty: skipped
  ASSERT_EQ(CheckOnDevice(list, stream), 0u);
  for (int k : {0, 63, 64, 127, 128}) {
    DeviceTensorOf& t = *tensors[static_cast<std::size_t>(k)];
    t.Put(t.n - 1, Bits(t.dtype, std::numeric_limits<float>::infinity()));
    EXPECT_EQ(CheckOnDevice(list, stream), 1u) << "tensor " << k;
    t.Put(t.n - 1, FiniteBits(t.dtype, t.n - 1));
  }
  // The flag is the caller's to clear: a clean list leaves a set flag set.
  Device<std::uint32_t> flag(std::vector<std::uint32_t>{1});
  ASSERT_OK(CudaHasOverflow(list, flag.get(), stream.view()));
  stream.Sync();
  EXPECT_EQ(flag.Download()[0], 1u);
  EXPECT_OK(CudaHasOverflow(std::span<const TensorView>(), flag.get(), stream.view()));
}

TEST(CudaKernels, SpecialFiniteValuesAreNotOverflows) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  // -0, the smallest subnormals, the largest subnormal, the largest finite values.
  std::vector<std::uint32_t> f32 = {0x80000000u, 0x00000001u, 0x80000001u,
                                    0x007fffffu, 0x7f7fffffu, 0xff7fffffu};
  std::vector<std::uint16_t> f16 = {0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff};
  std::vector<std::uint16_t> bf16 = {0x8000, 0x0001, 0x8001, 0x007f, 0x7f7f, 0xff7f};
  for (int rep = 0; rep < 12; ++rep) {  // 24576 values: many blocks
    f32.insert(f32.end(), f32.begin(), f32.end());
    f16.insert(f16.end(), f16.begin(), f16.end());
    bf16.insert(bf16.end(), bf16.begin(), bf16.end());
  }
  Device<std::uint32_t> d32(f32);
  Device<std::uint16_t> d16(f16), dbf(bf16);
  const TensorView list[] = {{d32.get(), f32.size(), DType::kF32},
                             {d16.get(), f16.size(), DType::kF16},
                             {dbf.get(), bf16.size(), DType::kBF16}};
  EXPECT_EQ(CheckOnDevice(list, stream), 0u);
  d16.Put(f16.size() - 1, 0x7c00);  // +inf in fp16: the next value after the largest
  EXPECT_EQ(CheckOnDevice(list, stream), 1u);
}

struct AdamCase {
  DType grad;
  std::optional<DType> out;  // none: no working copy
  bool adamw;
  float wd;
  float multiplier;
};

// Every gradient and working-copy type, Adam and AdamW, with and without weight
// decay, unscaling and clipping folded into the multiplier: 20 steps on the GPU and
// on the CPU kernels give the same weights and moments within float rounding, and
// the working copy is the weights converted with round to nearest even.
TEST(CudaKernels, FusedAdamMatchesTheCpuForEveryTypeAndMode) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const std::size_t n = 100003;
  for (const AdamCase& k : {AdamCase{DType::kF32, DType::kF32, true, 0.0f, 1.0f},
                            AdamCase{DType::kBF16, DType::kBF16, true, 0.01f, 1.0f / 128},
                            AdamCase{DType::kF16, DType::kF16, false, 0.01f, 0.5f / 65536},
                            AdamCase{DType::kF32, DType::kBF16, false, 0.0f, 0.7f},
                            AdamCase{DType::kBF16, std::nullopt, true, 0.1f, 0.25f}}) {
    SCOPED_TRACE(std::string(ToString(k.grad)) + " -> " +
                 (k.out ? std::string(ToString(*k.out)) : std::string("none")));
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
    for (float& x : p) x = normal(rng);
    Device<float> dp(p), dm(m), dv(v);
    const float scale = k.grad == DType::kF16 ? 65536.0f : k.grad == DType::kBF16 ? 128.0f : 1.0f;
    std::vector<std::uint32_t> g32(n);
    std::vector<std::uint16_t> g16(n);
    Device<std::uint32_t> dg32(n);
    Device<std::uint16_t> dg16(n);
    const bool has_out = k.out.has_value();
    std::vector<std::uint32_t> out32(n);
    std::vector<std::uint16_t> out16(n);
    Device<std::uint32_t> dout32(n);
    Device<std::uint16_t> dout16(n);
    AdamConfig c;
    c.adamw = k.adamw;
    c.weight_decay = k.wd;
    c.grad_multiplier = k.multiplier;
    for (int step = 1; step <= 20; ++step) {
      for (std::size_t i = 0; i < n; ++i) {
        const float g = normal(rng) * scale * 0.01f;
        g32[i] = Bits(DType::kF32, g);
        if (k.grad != DType::kF32) g16[i] = static_cast<std::uint16_t>(Bits(k.grad, g));
      }
      const bool wide = k.grad == DType::kF32;
      if (wide) {
        dg32.Upload(g32);
      } else {
        dg16.Upload(g16);
      }
      const TensorView hg =
          wide ? TensorView{g32.data(), n, k.grad} : TensorView{g16.data(), n, k.grad};
      const TensorView dg =
          wide ? TensorView{dg32.get(), n, k.grad} : TensorView{dg16.get(), n, k.grad};
      const bool out_wide = k.out == DType::kF32;
      MutableTensorView hout{}, dout{};
      if (has_out) {
        hout = out_wide ? MutableTensorView{out32.data(), n, *k.out}
                        : MutableTensorView{out16.data(), n, *k.out};
        dout = out_wide ? MutableTensorView{dout32.get(), n, *k.out}
                        : MutableTensorView{dout16.get(), n, *k.out};
      }
      c.step = step;
      ASSERT_OK(FusedAdam(c, p, m, v, hg, hout));
      ASSERT_OK(CudaFusedAdam(c, dp.get(), dm.get(), dv.get(), dg, dout, n, stream.view()));
      stream.Sync();  // before the next step's gradient overwrites this one's
    }
    stream.Sync();
    const std::vector<float> gp = dp.Download(), gm = dm.Download(), gv = dv.Download();
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(gp[i], p[i], 2e-5f * std::max(1.0f, std::fabs(p[i]))) << i;
      ASSERT_NEAR(gm[i], m[i], 1e-4f * std::fabs(m[i]) + 1e-12f) << i;
      ASSERT_NEAR(gv[i], v[i], 1e-4f * std::fabs(v[i]) + 1e-20f) << i;
    }
    if (!has_out) continue;
    // The working copy is exactly the GPU's weights, converted.
    if (k.out == DType::kF32) {
      const std::vector<std::uint32_t> got = dout32.Download();
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], Bits(DType::kF32, gp[i])) << i;
    } else {
      const std::vector<std::uint16_t> got = dout16.Download();
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], Bits(*k.out, gp[i])) << i;
    }
  }
}
#endif

}  // namespace
}  // namespace memascend
