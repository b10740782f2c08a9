// AVX-512 kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c).
// File-local functions and intrinsics only: Note [isa units] in isa.h.
#include <cstring>
#include <immintrin.h>

#include "kernels/isa.h"

namespace memascend::kernels {
namespace {

constexpr std::size_t kBlock = 4096;  // elements between early-exit checks

bool AnyNonfinite32(const std::uint32_t* p, std::size_t n) {
  const __m512i mask = _mm512_set1_epi32(0x7f800000);
  const std::size_t vec_end = n / 64 * 64;
  std::size_t i = 0;
  while (i < vec_end) {
    const std::size_t block_end = vec_end - i > kBlock ? i + kBlock : vec_end;
    __mmask16 hit = 0;
    for (; i < block_end; i += 64) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(p + i), mask);
      const __m512i b = _mm512_and_si512(_mm512_loadu_si512(p + i + 16), mask);
      const __m512i c = _mm512_and_si512(_mm512_loadu_si512(p + i + 32), mask);
      const __m512i d = _mm512_and_si512(_mm512_loadu_si512(p + i + 48), mask);
      hit |= _mm512_cmpeq_epi32_mask(a, mask) | _mm512_cmpeq_epi32_mask(b, mask) |
             _mm512_cmpeq_epi32_mask(c, mask) | _mm512_cmpeq_epi32_mask(d, mask);
    }
    if (hit != 0) return true;
  }
  for (; i < n; ++i) {
    if ((p[i] & 0x7f800000u) == 0x7f800000u) return true;
  }
  return false;
}

bool AnyNonfinite16(const std::uint16_t* p, std::size_t n, std::uint16_t exponent_mask) {
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(exponent_mask));
  const std::size_t vec_end = n / 128 * 128;
  std::size_t i = 0;
  while (i < vec_end) {
    const std::size_t block_end = vec_end - i > 2 * kBlock ? i + 2 * kBlock : vec_end;
    __mmask32 hit = 0;
    for (; i < block_end; i += 128) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(p + i), mask);
      const __m512i b = _mm512_and_si512(_mm512_loadu_si512(p + i + 32), mask);
      const __m512i c = _mm512_and_si512(_mm512_loadu_si512(p + i + 64), mask);
      const __m512i d = _mm512_and_si512(_mm512_loadu_si512(p + i + 96), mask);
      hit |= _mm512_cmpeq_epi16_mask(a, mask) | _mm512_cmpeq_epi16_mask(b, mask) |
             _mm512_cmpeq_epi16_mask(c, mask) | _mm512_cmpeq_epi16_mask(d, mask);
    }
    if (hit != 0) return true;
  }
  for (; i < n; ++i) {
    if ((p[i] & exponent_mask) == exponent_mask) return true;
  }
  return false;
}

template <DType T>
__m512 Load16(const void* base, std::size_t i) {
  if constexpr (T == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(base) + i));
    if constexpr (T == DType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

template <DType T>
void Store16(void* base, std::size_t i, __m512 x) {
  if constexpr (T == DType::kF32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, x);
  } else if constexpr (T == DType::kF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r,
                                _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i),
                        _mm512_cvtepi32_epi16(r));
  }
}

template <DType G, DType O, bool kOut>
void AdamT(const AdamArgs& a, std::size_t begin, std::size_t end) {
  const __m512 b1 = _mm512_set1_ps(a.b1), b2 = _mm512_set1_ps(a.b2);
  const __m512 omb1 = _mm512_set1_ps(a.one_minus_b1), omb2 = _mm512_set1_ps(a.one_minus_b2);
  const __m512 eps = _mm512_set1_ps(a.eps), l2 = _mm512_set1_ps(a.l2),
               decay = _mm512_set1_ps(a.decay);
  const __m512 step = _mm512_set1_ps(a.step_size), isb2 = _mm512_set1_ps(a.inv_sqrt_bc2);
  const __m512 gm = _mm512_set1_ps(a.grad_mul);
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 p = _mm512_loadu_ps(a.master + i);
    const __m512 g = _mm512_fmadd_ps(Load16<G>(a.grad, i), gm, _mm512_mul_ps(l2, p));
    const __m512 m = _mm512_fmadd_ps(b1, _mm512_loadu_ps(a.m + i), _mm512_mul_ps(omb1, g));
    const __m512 v =
        _mm512_fmadd_ps(b2, _mm512_loadu_ps(a.v + i), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), isb2, eps);
    p = _mm512_fnmadd_ps(step, _mm512_div_ps(m, denom), _mm512_mul_ps(p, decay));
    _mm512_storeu_ps(a.m + i, m);
    _mm512_storeu_ps(a.v + i, v);
    _mm512_storeu_ps(a.master + i, p);
    if constexpr (kOut) Store16<O>(a.out, i, p);
  }
  if (i < end) ScalarAdam(a, i, end);
}

template <DType F, DType T>
void ConvertT(const void* from, void* to, std::size_t begin, std::size_t end) {
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) Store16<T>(to, i, Load16<F>(from, i));
  if (i < end) ScalarConvert(from, F, to, T, i, end);
}

template <DType T>
double SumSquaresT(const void* p, std::size_t begin, std::size_t end) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 x = Load16<T>(p, i);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  if (i < end) sum += ScalarSumSquares(p, T, i, end);
  return sum;
}

#include "kernels/isa_dispatch.inc"

std::uint64_t ReadFold(const std::byte* p, std::size_t bytes) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  std::size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  std::uint64_t words[8];
  _mm512_storeu_si512(words, x);
  std::uint64_t acc =
      words[0] ^ words[1] ^ words[2] ^ words[3] ^ words[4] ^ words[5] ^ words[6] ^ words[7];
  for (; i < bytes; ++i) acc ^= static_cast<std::uint64_t>(p[i]);
  return acc;
}

// A plain vectorised copy, for the copy ceiling (benchmarks take the better of it and memcpy).
void Copy(std::byte* to, const std::byte* from, std::size_t bytes) {
  std::size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    const __m512i a = _mm512_loadu_si512(from + i), b = _mm512_loadu_si512(from + i + 64);
    const __m512i c = _mm512_loadu_si512(from + i + 128), d = _mm512_loadu_si512(from + i + 192);
    _mm512_storeu_si512(to + i, a);
    _mm512_storeu_si512(to + i + 64, b);
    _mm512_storeu_si512(to + i + 128, c);
    _mm512_storeu_si512(to + i + 192, d);
  }
  if (i < bytes) std::memcpy(to + i, from + i, bytes - i);
}

}  // namespace

const Isa& Avx512Isa() {
  static const Isa isa{SimdLevel::kAvx512,
                       AnyNonfinite32,
                       AnyNonfinite16,
                       Adam,
                       Convert,
                       SumSquares,
                       ReadFold,
                       Copy};
  return isa;
}

}  // namespace memascend::kernels
