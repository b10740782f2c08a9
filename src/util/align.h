// util/align.h: integer rounding for sizes and offsets.
#ifndef MEMASCEND_SRC_UTIL_ALIGN_H_
#define MEMASCEND_SRC_UTIL_ALIGN_H_

#include <cstddef>
#include <cstdint>

namespace memascend::util {

// n rounded up to a multiple of `to` (> 0). The caller keeps n + to from overflowing.
constexpr std::uint64_t RoundUp(std::uint64_t n, std::uint64_t to) {
  return (n + to - 1) / to * to;
}
constexpr std::uint64_t RoundDown(std::uint64_t n, std::uint64_t to) { return n / to * to; }
constexpr bool IsAligned(std::uint64_t n, std::uint64_t to) { return n % to == 0; }

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_ALIGN_H_
