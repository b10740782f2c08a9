#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/kernels.h>

#include "kernels/kernel_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::KernelTest;

bool IsNanHalf(std::uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool IsNanBf16(std::uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

TEST(Half, AllValuesRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const float f = HalfToFloat(half);
    if (IsNanHalf(half)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(IsNanHalf(FloatToHalf(f))) << h;
    } else {
      ASSERT_EQ(FloatToHalf(f), half) << std::hex << h;
    }
  }
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

TEST(BFloat16, AllValuesRoundTrip) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto v = static_cast<std::uint16_t>(b);
    const float f = BFloat16ToFloat(v);
    if (IsNanBf16(v)) {
      ASSERT_TRUE(IsNanBf16(FloatToBFloat16(f))) << b;
    } else {
      ASSERT_EQ(FloatToBFloat16(f), v) << std::hex << b;
    }
  }
}

// Rounding to nearest, ties to even, checked against the neighbours of the result.
template <typename ToBits, typename FromBits>
void CheckNearestEven(float f, ToBits to, FromBits from, std::uint16_t max_finite,
                      std::uint16_t inf) {
  const std::uint16_t r = to(f);
  const std::uint16_t mag = r & 0x7fff;
  const double x = std::fabs(static_cast<double>(f));
  if (mag == inf) {  // rounded up past the largest finite value
    const double largest = from(max_finite);
    const double next = largest + (largest - static_cast<double>(from(max_finite - 1)));
    ASSERT_GE(x, (largest + next) / 2) << f;
    return;
  }
  const double got = std::fabs(static_cast<double>(from(mag)));
  const double err = std::fabs(got - x);
  for (int d : {-1, 1}) {
    const int nb = static_cast<int>(mag) + d;
    if (nb < 0 || nb > max_finite) continue;
    const double other = std::fabs(static_cast<double>(from(static_cast<std::uint16_t>(nb))));
    const double err2 = std::fabs(other - x);
    ASSERT_LE(err, err2) << f;
    if (err == err2) {
      ASSERT_EQ(mag & 1, 0) << "tie not to even for " << f;
    }
  }
}

TEST(Half, RoundsToNearestEven) {
  std::mt19937 rng(1);
  std::vector<float> values;
  for (std::uint32_t h = 0; h < 0x7bff; ++h) {  // every midpoint between consecutive halves
    const double a = HalfToFloat(static_cast<std::uint16_t>(h)),
                 b = HalfToFloat(static_cast<std::uint16_t>(h + 1));
    values.push_back(static_cast<float>((a + b) / 2));
  }
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 200000; ++i) values.push_back(u(rng));
  for (int i = 0; i < 100000; ++i)
    values.push_back(std::ldexp(u(rng) / 70000.0f, -10 - static_cast<int>(rng() % 20)));
  for (float f : values) {
    CheckNearestEven(f, FloatToHalf, HalfToFloat, 0x7bff, 0x7c00);
  }
}

TEST(BFloat16, RoundsToNearestEven) {
  std::mt19937 rng(2);
  for (int i = 0; i < 300000; ++i) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(rng()) &
                                         0xbfffffffu);  // finite, all magnitudes
    if (!std::isfinite(f)) continue;
    CheckNearestEven(f, FloatToBFloat16, BFloat16ToFloat, 0x7f7f, 0x7f80);
  }
}

class Conversion : public KernelTest {};

TEST_P(Conversion, VectorPathsMatchTheScalarDefinition) {
  std::mt19937 rng(3);
  std::vector<float> src(100003);
  for (float& f : src)
    f = std::bit_cast<float>(static_cast<std::uint32_t>(rng()) & 0xc7ffffffu);  // to ~1e5
  src[7] = 65519.0f;
  src[8] = 65520.0f;  // rounds to inf in fp16
  src[9] = -0.0f;
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<std::uint16_t> out(src.size());
    ASSERT_OK(
        Convert({src.data(), src.size(), DType::kF32}, {out.data(), out.size(), t}, options_));
    for (std::size_t i = 0; i < src.size(); ++i) {
      const std::uint16_t want = t == DType::kF16 ? FloatToHalf(src[i]) : FloatToBFloat16(src[i]);
      if (std::isnan(src[i])) continue;
      ASSERT_EQ(out[i], want) << ToString(t) << " " << src[i];
    }
    std::vector<float> back(src.size());
    ASSERT_OK(
        Convert({out.data(), out.size(), t}, {back.data(), back.size(), DType::kF32}, options_));
    for (std::size_t i = 0; i < src.size(); ++i) {
      const float want = t == DType::kF16 ? HalfToFloat(out[i]) : BFloat16ToFloat(out[i]);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(back[i]), std::bit_cast<std::uint32_t>(want)) << i;
    }
  }
  // Every fp16 value through the vector path and back.
  std::vector<std::uint16_t> all(65536), again(65536);
  for (std::uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<std::uint16_t>(h);
  std::vector<float> wide(65536);
  ASSERT_OK(Convert({all.data(), 65536, DType::kF16}, {wide.data(), 65536, DType::kF32}, options_));
  ASSERT_OK(
      Convert({wide.data(), 65536, DType::kF32}, {again.data(), 65536, DType::kF16}, options_));
  for (std::uint32_t h = 0; h < 65536; ++h) {
    if (IsNanHalf(all[h])) {
      ASSERT_TRUE(IsNanHalf(again[h]));
    } else {
      ASSERT_EQ(again[h], all[h]) << h;
    }
  }
  EXPECT_THAT(Convert({src.data(), 3, DType::kF32}, {all.data(), 4, DType::kF16}),
              ::memascend::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

// Between equal dtypes Convert copies: every bit pattern, NaN payloads and signalling
// NaNs included, on one thread and over a pool's many tasks (Note [kernel grain]).
TEST_P(Conversion, EqualDtypesAreCopiedBitForBit) {
  const std::size_t n = (std::size_t{1} << 20) + 3;
  std::mt19937 rng(5);
  std::vector<std::uint32_t> w32(n);
  for (std::uint32_t& w : w32) w = static_cast<std::uint32_t>(rng());
  w32[1] = 0x7f800001u;      // a signalling NaN
  w32[n - 1] = 0xffc12345u;  // a quiet NaN with a payload
  std::vector<std::uint32_t> c32(n);
  ASSERT_OK(Convert({w32.data(), n, DType::kF32}, {c32.data(), n, DType::kF32}, options_));
  EXPECT_EQ(c32, w32);
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<std::uint16_t> w16(n), c16(n);
    for (std::size_t i = 0; i < n; ++i) w16[i] = static_cast<std::uint16_t>(w32[i] >> 7);
    w16[2] = t == DType::kF16 ? 0x7c01 : 0x7f81;  // signalling NaNs
    ASSERT_OK(Convert({w16.data(), n, t}, {c16.data(), n, t}, options_));
    EXPECT_EQ(c16, w16) << ToString(t);
  }
}

MEMASCEND_INSTANTIATE_KERNEL_TEST(Conversion);

}  // namespace
}  // namespace memascend
