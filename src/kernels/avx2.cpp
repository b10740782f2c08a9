// AVX2 kernels (compiled with -mavx2 -mfma -mf16c).
// File-local functions and intrinsics only: Note [isa units] in isa.h.
#include <cstring>
#include <immintrin.h>

#include "kernels/isa.h"

namespace memascend::kernels {
namespace {

constexpr std::size_t kBlock = 4096;  // elements between early-exit checks

bool AnyNonfinite32(const std::uint32_t* p, std::size_t n) {
  const __m256i mask = _mm256_set1_epi32(0x7f800000);
  const std::size_t vec_end = n / 32 * 32;
  std::size_t i = 0;
  while (i < vec_end) {
    const std::size_t block_end = vec_end - i > kBlock ? i + kBlock : vec_end;
    __m256i hit = _mm256_setzero_si256();
    for (; i < block_end; i += 32) {
      const auto* q = reinterpret_cast<const __m256i*>(p + i);
      const __m256i a = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(q), mask), mask);
      const __m256i b = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(q + 1), mask), mask);
      const __m256i c = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(q + 2), mask), mask);
      const __m256i d = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(q + 3), mask), mask);
      hit = _mm256_or_si256(hit, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d)));
    }
    if (!_mm256_testz_si256(hit, hit)) return true;
  }
  for (; i < n; ++i) {
    if ((p[i] & 0x7f800000u) == 0x7f800000u) return true;
  }
  return false;
}

bool AnyNonfinite16(const std::uint16_t* p, std::size_t n, std::uint16_t exponent_mask) {
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(exponent_mask));
  const std::size_t vec_end = n / 64 * 64;
  std::size_t i = 0;
  while (i < vec_end) {
    const std::size_t block_end = vec_end - i > 2 * kBlock ? i + 2 * kBlock : vec_end;
    __m256i hit = _mm256_setzero_si256();
    for (; i < block_end; i += 64) {
      const auto* q = reinterpret_cast<const __m256i*>(p + i);
      const __m256i a = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q), mask), mask);
      const __m256i b = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q + 1), mask), mask);
      const __m256i c = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q + 2), mask), mask);
      const __m256i d = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q + 3), mask), mask);
      hit = _mm256_or_si256(hit, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d)));
    }
    if (!_mm256_testz_si256(hit, hit)) return true;
  }
  for (; i < n; ++i) {
    if ((p[i] & exponent_mask) == exponent_mask) return true;
  }
  return false;
}

template <DType T>
__m256 Load8(const void* base, std::size_t i) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(base) + i));
    if constexpr (T == DType::kF16) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

template <DType T>
void Store8(void* base, std::size_t i, __m256 x) {
  if constexpr (T == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  } else if constexpr (T == DType::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                           nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
}

template <DType G, DType O, bool kOut>
void AdamT(const AdamArgs& a, std::size_t begin, std::size_t end) {
  const __m256 b1 = _mm256_set1_ps(a.b1), b2 = _mm256_set1_ps(a.b2);
  const __m256 omb1 = _mm256_set1_ps(a.one_minus_b1), omb2 = _mm256_set1_ps(a.one_minus_b2);
  const __m256 eps = _mm256_set1_ps(a.eps), l2 = _mm256_set1_ps(a.l2),
               decay = _mm256_set1_ps(a.decay);
  const __m256 step = _mm256_set1_ps(a.step_size), isb2 = _mm256_set1_ps(a.inv_sqrt_bc2);
  const __m256 gm = _mm256_set1_ps(a.grad_mul);
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 p = _mm256_loadu_ps(a.master + i);
    const __m256 g = _mm256_fmadd_ps(Load8<G>(a.grad, i), gm, _mm256_mul_ps(l2, p));
    const __m256 m = _mm256_fmadd_ps(b1, _mm256_loadu_ps(a.m + i), _mm256_mul_ps(omb1, g));
    const __m256 v =
        _mm256_fmadd_ps(b2, _mm256_loadu_ps(a.v + i), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), isb2, eps);
    p = _mm256_fnmadd_ps(step, _mm256_div_ps(m, denom), _mm256_mul_ps(p, decay));
    _mm256_storeu_ps(a.m + i, m);
    _mm256_storeu_ps(a.v + i, v);
    _mm256_storeu_ps(a.master + i, p);
    if constexpr (kOut) Store8<O>(a.out, i, p);
  }
  if (i < end) ScalarAdam(a, i, end);
}

template <DType F, DType T>
void ConvertT(const void* from, void* to, std::size_t begin, std::size_t end) {
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) Store8<T>(to, i, Load8<F>(from, i));
  if (i < end) ScalarConvert(from, F, to, T, i, end);
}

template <DType T>
double SumSquaresT(const void* p, std::size_t begin, std::size_t end) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 x = Load8<T>(p, i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (i < end) sum += ScalarSumSquares(p, T, i, end);
  return sum;
}

#include "kernels/isa_dispatch.inc"

std::uint64_t ReadFold(const std::byte* p, std::size_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const auto* q = reinterpret_cast<const __m256i*>(p + i);
    a = _mm256_xor_si256(a, _mm256_loadu_si256(q));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(q + 1));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(q + 2));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(q + 3));
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  std::uint64_t words[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), x);
  std::uint64_t acc = words[0] ^ words[1] ^ words[2] ^ words[3];
  for (; i < bytes; ++i) acc ^= static_cast<std::uint64_t>(p[i]);
  return acc;
}

// A plain vectorised copy, for the copy ceiling (benchmarks take the better of it and memcpy).
void Copy(std::byte* to, const std::byte* from, std::size_t bytes) {
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const auto* s = reinterpret_cast<const __m256i*>(from + i);
    auto* d = reinterpret_cast<__m256i*>(to + i);
    const __m256i a = _mm256_loadu_si256(s), b = _mm256_loadu_si256(s + 1);
    const __m256i c = _mm256_loadu_si256(s + 2), e = _mm256_loadu_si256(s + 3);
    _mm256_storeu_si256(d, a);
    _mm256_storeu_si256(d + 1, b);
    _mm256_storeu_si256(d + 2, c);
    _mm256_storeu_si256(d + 3, e);
  }
  if (i < bytes) std::memcpy(to + i, from + i, bytes - i);
}

}  // namespace

const Isa& Avx2Isa() {
  static const Isa isa{SimdLevel::kAvx2, AnyNonfinite32, AnyNonfinite16, Adam,
                       Convert,          SumSquares,     ReadFold,       Copy};
  return isa;
}

}  // namespace memascend::kernels
