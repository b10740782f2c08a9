#include "util/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace memascend::util {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<std::uint32_t, 256> MakeTable() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<std::uint32_t, 256> kTable = MakeTable();

std::uint32_t Portable(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t Hardware(std::uint32_t crc, const unsigned char* p,
                                                         std::size_t n) noexcept {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// Note [crc streams]: the crc32 instruction has a latency of three cycles but issues
// once a cycle, so three independent streams over three parts of a block run about
// three times faster than one. The parts' register states are joined by shifting the
// first over the bytes of the other two: a CRC state moved past n zero bytes is the
// state times x^(8n) modulo the polynomial.

// Product of a and b modulo the (reflected) polynomial.
std::uint32_t MultModP(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8n) modulo the polynomial.
std::uint32_t ShiftFactor(std::uint64_t n) noexcept {
  std::uint32_t power[32];  // x^(2^k)
  power[0] = 1u << 30;      // x^1 (reflected)
  for (int k = 1; k < 32; ++k) power[k] = MultModP(power[k - 1], power[k - 1]);
  std::uint32_t p = 1u << 31;  // x^0
  for (int k = 3; n != 0; n >>= 1, ++k) {
    if (n & 1) p = MultModP(power[k % 32], p);
  }
  return p;
}

constexpr std::size_t kStream = 8192;  // bytes per stream and block part

__attribute__((target("sse4.2"))) std::uint32_t HardwareStreams(std::uint32_t crc,
                                                                const unsigned char* p,
                                                                std::size_t n) noexcept {
  static const std::uint32_t shift1 = ShiftFactor(kStream), shift2 = ShiftFactor(2 * kStream);
  while (n >= 3 * kStream) {
    std::uint64_t a = crc, b = 0, c = 0;
    for (std::size_t i = 0; i < kStream; i += 8) {
      std::uint64_t wa, wb, wc;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kStream + i, 8);
      std::memcpy(&wc, p + 2 * kStream + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = MultModP(shift2, static_cast<std::uint32_t>(a)) ^
          MultModP(shift1, static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(c);
    p += 3 * kStream;
    n -= 3 * kStream;
  }
  return Hardware(crc, p, n);
}

bool HasSse42() noexcept {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return has;
}
#endif

}  // namespace

std::uint32_t Crc32c(std::uint32_t crc, const void* data, std::size_t length) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  crc = HasSse42() ? HardwareStreams(crc, p, length) : Portable(crc, p, length);
#else
  crc = Portable(crc, p, length);
#endif
  return ~crc;
}

std::uint32_t Crc32cPortable(std::uint32_t crc, const void* data, std::size_t length) noexcept {
  return ~Portable(~crc, static_cast<const unsigned char*>(data), length);
}

}  // namespace memascend::util
