#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/kernels.h>

#include "kernels/isa.h"
#include "kernels/kernel_test_util.h"

namespace memascend {
namespace {

using ::memascend::testing::KernelTest;

// A tensor of `n` finite values of `dtype`, as raw 16- or 32-bit words.
struct Buffer {
  DType dtype;
  std::vector<std::uint32_t> w32;
  std::vector<std::uint16_t> w16;
  Buffer(DType t, std::size_t n) : dtype(t) {
    if (t == DType::kF32) {
      w32.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float f = static_cast<float>(static_cast<long>(i % 2000) - 1000) * 0.37f;
        std::memcpy(&w32[i], &f, 4);
      }
    } else {
      w16.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float f = static_cast<float>(static_cast<long>(i % 2000) - 1000) * 0.37f;
        w16[i] = t == DType::kF16 ? FloatToHalf(f) : FloatToBFloat16(f);
      }
    }
  }
  TensorView view() const {
    return dtype == DType::kF32 ? TensorView{w32.data(), w32.size(), dtype}
                                : TensorView{w16.data(), w16.size(), dtype};
  }
  void Set(std::size_t i, float f) {
    if (dtype == DType::kF32) {
      std::memcpy(&w32[i], &f, 4);
    } else {
      w16[i] = dtype == DType::kF16 ? FloatToHalf(f) : FloatToBFloat16(f);
    }
  }
};

class Overflow : public KernelTest {
 protected:
  // The fused check's answer, after checking that PyTorch's way (a temporary per pass)
  // gives the same one.
  bool Check(std::span<const TensorView> tensors) {
    const bool fused = HasOverflow(tensors, options_);
    EXPECT_EQ(HasOverflowWithTemporaries(tensors, options_), fused);
    return fused;
  }
};

TEST_P(Overflow, FindsInfAndNanAtEveryPosition) {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (std::size_t n : {1u, 2u, 15u, 16u, 17u, 31u, 33u, 63u, 64u, 65u, 127u, 129u, 255u, 1000u,
                          4097u, 8193u, 70001u, 300001u}) {
      Buffer b(t, n);
      const TensorView one[] = {b.view()};
      ASSERT_FALSE(Check(one)) << ToString(t) << " n=" << n;
      std::vector<std::size_t> positions = {0, n - 1, n / 2};
      if (n <= 300) {
        for (std::size_t i = 0; i < n; ++i) positions.push_back(i);
      }
      for (std::size_t pos : positions) {
        for (float f : bad) {
          Buffer c = b;
          c.Set(pos, f);
          const TensorView v[] = {c.view()};
          ASSERT_TRUE(Check(v)) << ToString(t) << " n=" << n << " at " << pos << " value " << f;
        }
      }
    }
  }
}

TEST_P(Overflow, LooksAcrossManyTensorsOfMixedTypes) {
  Buffer a(DType::kF32, 1001), b(DType::kBF16, 77777), c(DType::kF16, 3), d(DType::kF32, 262145),
      e(DType::kBF16, 5);
  std::vector<TensorView> list = {a.view(), b.view(), c.view(), d.view(), e.view()};
  EXPECT_FALSE(Check(list));
  d.Set(262144, std::numeric_limits<float>::quiet_NaN());  // the very last element of a big one
  list[3] = d.view();
  EXPECT_TRUE(Check(list));
  d.Set(262144, 1.0f);
  e.Set(4, std::numeric_limits<float>::infinity());
  list[3] = d.view();
  list[4] = e.view();
  EXPECT_TRUE(Check(list));
  EXPECT_FALSE(Check(std::span<const TensorView>()));
}

TEST_P(Overflow, SpecialFiniteValuesAreNotOverflows) {
  // -0, the smallest subnormals, the largest finite values, of each type.
  std::vector<std::uint32_t> f32 = {0x80000000u, 0x00000001u, 0x80000001u,
                                    0x007fffffu, 0x7f7fffffu, 0xff7fffffu};
  std::vector<std::uint16_t> f16 = {0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff};
  std::vector<std::uint16_t> bf16 = {0x8000, 0x0001, 0x8001, 0x007f, 0x7f7f, 0xff7f};
  for (int rep = 0; rep < 6; ++rep) {  // long enough for the vector paths
    f32.insert(f32.end(), f32.begin(), f32.end());
    f16.insert(f16.end(), f16.begin(), f16.end());
    bf16.insert(bf16.end(), bf16.begin(), bf16.end());
  }
  const TensorView list[] = {{f32.data(), f32.size(), DType::kF32},
                             {f16.data(), f16.size(), DType::kF16},
                             {bf16.data(), bf16.size(), DType::kBF16}};
  EXPECT_FALSE(Check(list));
  f16.push_back(0x7c00);  // +inf in fp16 is the next value after the largest
  const TensorView with_inf[] = {{f16.data(), f16.size(), DType::kF16}};
  EXPECT_TRUE(Check(with_inf));
}

MEMASCEND_INSTANTIATE_KERNEL_TEST(Overflow);

// Note [kernel grain]: a pool of 16 cuts a call of 2^20 + 5 elements into tasks of
// ElementwiseGrain(16, n); an overflow on either side of every task boundary is found, on
// every instruction set this CPU has, and in the last tensor of a list (a list's tasks
// are cut per tensor).
TEST(Overflow, IsFoundAtTheTaskBoundariesOfALargePool) {
  KernelThreads pool(16);
  const std::size_t n = (std::size_t{1} << 20) + 5;
  const std::size_t grain = kernels::ElementwiseGrain(pool.size(), n);
  ASSERT_LT(grain, n / 8);  // many tasks, so many boundaries
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (!::memascend::testing::CpuHas(level)) continue;
    const KernelOptions options{&pool, level};
    for (DType t : {DType::kF32, DType::kBF16}) {
      Buffer b(t, n);
      const TensorView clean[] = {b.view()};
      ASSERT_FALSE(HasOverflow(clean, options));
      for (std::size_t edge = 0; edge < n; edge += grain) {
        for (std::size_t at : {edge, edge == 0 ? n - 1 : edge - 1}) {
          Buffer c = b;
          c.Set(at, std::numeric_limits<float>::quiet_NaN());
          const TensorView v[] = {c.view()};
          ASSERT_TRUE(HasOverflow(v, options))
              << ToString(level) << " " << ToString(t) << " at " << at;
        }
      }
      Buffer small(t, 3), c = b;
      c.Set(n - 1, std::numeric_limits<float>::infinity());
      const TensorView list[] = {small.view(), small.view(), c.view()};
      EXPECT_TRUE(HasOverflow(list, options)) << ToString(level) << " " << ToString(t);
      EXPECT_TRUE(HasOverflowWithTemporaries(list, options))
          << ToString(level) << " " << ToString(t);
    }
  }
}

// Note [one pass] (OffloadedAdam): the optimizer's overflow check is the sum of squares,
// so the sum must be non-finite exactly where HasOverflow finds an overflow: an inf or a
// NaN in the vector body or the scalar tail of any dtype on every instruction set, and
// finite for the largest finite values of each dtype, whose squares overflow a float.
TEST(Overflow, TheSumOfSquaresIsNonFiniteExactlyWhereThereIsOne) {
  KernelThreads pool(3);
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (!::memascend::testing::CpuHas(level)) continue;
    const KernelOptions options{&pool, level};
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      const float largest = t == DType::kF32   ? FLT_MAX
                            : t == DType::kF16 ? 65504.0f
                                               : BFloat16ToFloat(0x7F7F);
      for (std::size_t n : {5u, 16u, 37u, 70001u}) {  // a tail alone, none, both
        Buffer b(t, n);
        for (std::size_t i = 0; i < n; i += 3) b.Set(i, i % 2 ? largest : -largest);
        const TensorView big[] = {b.view()};
        ASSERT_TRUE(std::isfinite(SumOfSquares(big, options))) << ToString(level) << ToString(t);
        for (std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
          for (float f : bad) {
            Buffer c = b;
            c.Set(at, f);
            const TensorView v[] = {c.view()};
            ASSERT_FALSE(std::isfinite(SumOfSquares(v, options, 12.5)))
                << ToString(level) << " " << ToString(t) << " n " << n << " at " << at << " " << f;
            ASSERT_TRUE(HasOverflow(v, options));
          }
        }
      }
    }
  }
}

TEST(KernelThreads, EveryChunkRunsOnceAcrossRepeatedCalls) {
  KernelThreads pool(4);
  EXPECT_EQ(pool.size(), 4);
  for (std::size_t chunks : {0u, 1u, 3u, 1000u}) {
    for (int round = 0; round < 20; ++round) {
      std::vector<std::atomic<int>> hits(chunks);
      pool.ParallelFor(chunks, [&](std::size_t i) { hits[i].fetch_add(1); });
      for (std::size_t i = 0; i < chunks; ++i) ASSERT_EQ(hits[i].load(), 1) << chunks << " " << i;
    }
  }
}

// Note [kernel threads]: a worker that wakes late for a call, after its caller has
// done every chunk alone and returned, must not take part in the next call with a mix
// of the two calls' state (a chunk run twice, or by the previous call's dangling
// function). One-chunk calls, which the caller mostly finishes alone, alternate with
// 64-chunk calls; two functions take turns, each writing only its own array, so every
// chunk must be run exactly once and by its own call's function. Found on a 16-core
// machine, where training runs' losses differed now and then.
TEST(KernelThreads, ALateWorkerNeverMixesTwoCalls) {
  KernelThreads pool(8);
  constexpr std::size_t kCalls = 20000, kWide = 64;
  std::vector<std::atomic<int>> by_a(kCalls * kWide), by_b(kCalls * kWide);
  std::size_t call = 0;
  const auto a = [&](std::size_t i) { by_a[call * kWide + i].fetch_add(1); };
  const auto b = [&](std::size_t i) { by_b[call * kWide + i].fetch_add(1); };
  const auto chunks_of = [](std::size_t c) { return c % 2 == 0 ? std::size_t{1} : kWide; };
  for (call = 0; call < kCalls; ++call) {
    if ((call / 2) % 2 == 0) {
      pool.ParallelFor(chunks_of(call), a);
    } else {
      pool.ParallelFor(chunks_of(call), b);
    }
  }
  for (std::size_t c = 0; c < kCalls; ++c) {
    auto& right = (c / 2) % 2 == 0 ? by_a : by_b;
    auto& wrong = (c / 2) % 2 == 0 ? by_b : by_a;
    for (std::size_t i = 0; i < kWide; ++i) {
      ASSERT_EQ(right[c * kWide + i].load(), i < chunks_of(c) ? 1 : 0)
          << "call " << c << " chunk " << i;
      ASSERT_EQ(wrong[c * kWide + i].load(), 0) << "call " << c << " chunk " << i;
    }
  }
}

TEST(KernelThreads, ConcurrentCallersAreSerialised) {
  KernelThreads pool(3);
  std::atomic<long> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r)
        pool.ParallelFor(100, [&](std::size_t i) { total += static_cast<long>(i); });
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(total.load(), 3L * 50 * 4950);
}

}  // namespace
}  // namespace memascend
