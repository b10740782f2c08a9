// Portable kernels: the fallback, and the tails of the vector units (Note [isa units]).
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/isa.h"

namespace memascend {

std::uint16_t FloatToHalf(float f) noexcept {
  // Round to nearest even with float arithmetic doing the rounding: subnormal results
  // by adding a magic number that aligns the binary point, normal ones by adding half
  // an ulp (minus one, plus the kept bit's parity) before truncating.
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  std::uint32_t h;
  if (u >= (127u + 16u) << 23) {  // >= 65536, inf or NaN
    h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // below the smallest normal half (2^-14)
    constexpr std::uint32_t kMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float sum = std::bit_cast<float>(u) + std::bit_cast<float>(kMagic);
    h = std::bit_cast<std::uint32_t>(sum) - kMagic;
  } else {
    const std::uint32_t odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu + odd;  // rebias the exponent, round
    h = u >> 13;
  }
  return static_cast<std::uint16_t>(h | sign);
}

float HalfToFloat(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float
    const float value = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -value : value;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

std::uint16_t FloatToBFloat16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float BFloat16ToFloat(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

namespace kernels {
namespace {

float Load(const void* p, DType t, std::size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const std::uint16_t*>(p)[i]);
    case DType::kBF16:
      return BFloat16ToFloat(static_cast<const std::uint16_t*>(p)[i]);
  }
  return 0;
}

void Store(void* p, DType t, std::size_t i, float value) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = value;
      break;
    case DType::kF16:
      static_cast<std::uint16_t*>(p)[i] = FloatToHalf(value);
      break;
    case DType::kBF16:
      static_cast<std::uint16_t*>(p)[i] = FloatToBFloat16(value);
      break;
  }
}

bool AnyNonfinite32(const std::uint32_t* p, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 4096) {
    std::uint32_t hit = 0;
    const std::size_t end = std::min(n, i + 4096);
    for (std::size_t j = i; j < end; ++j)
      hit |= static_cast<std::uint32_t>((p[j] & 0x7f800000u) == 0x7f800000u);
    if (hit != 0) return true;
  }
  return false;
}

bool AnyNonfinite16(const std::uint16_t* p, std::size_t n, std::uint16_t mask) {
  for (std::size_t i = 0; i < n; i += 8192) {
    std::uint32_t hit = 0;
    const std::size_t end = std::min(n, i + 8192);
    for (std::size_t j = i; j < end; ++j) hit |= static_cast<std::uint32_t>((p[j] & mask) == mask);
    if (hit != 0) return true;
  }
  return false;
}

std::uint64_t ReadFold(const std::byte* p, std::size_t bytes) {
  std::uint64_t acc = 0;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc ^= w;
  }
  for (; i < bytes; ++i) acc ^= static_cast<std::uint64_t>(p[i]);
  return acc;
}

void Copy(std::byte* to, const std::byte* from, std::size_t bytes) { std::memcpy(to, from, bytes); }

}  // namespace

void ScalarAdam(const AdamArgs& a, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    float p = a.master[i];
    const float g = Load(a.grad, a.grad_type, i) * a.grad_mul + a.l2 * p;
    const float m = a.b1 * a.m[i] + a.one_minus_b1 * g;
    const float v = a.b2 * a.v[i] + a.one_minus_b2 * g * g;
    p *= a.decay;
    p -= a.step_size * m / (std::sqrt(v) * a.inv_sqrt_bc2 + a.eps);
    a.m[i] = m;
    a.v[i] = v;
    a.master[i] = p;
    if (a.out != nullptr) Store(a.out, a.out_type, i, p);
  }
}

void ScalarConvert(const void* from, DType from_type, void* to, DType to_type, std::size_t begin,
                   std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) Store(to, to_type, i, Load(from, from_type, i));
}

double ScalarSumSquares(const void* p, DType type, std::size_t begin, std::size_t end) {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) {
    const double x = Load(p, type, i);
    sum += x * x;
  }
  return sum;
}

const Isa& ScalarIsa() {
  static const Isa isa{SimdLevel::kScalar, AnyNonfinite32,   AnyNonfinite16, ScalarAdam,
                       ScalarConvert,      ScalarSumSquares, ReadFold,       Copy};
  return isa;
}

}  // namespace kernels
}  // namespace memascend
