// util/crc32c.h: CRC-32C (Castagnoli), the checksum of MemAscend's on-disk structures
// and object data. Uses the SSE4.2 crc32 instruction when the CPU has it.
#ifndef MEMASCEND_SRC_UTIL_CRC32C_H_
#define MEMASCEND_SRC_UTIL_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace memascend::util {

// Extends `crc` (0 to start) over `data`. Crc32c("123456789") == 0xE3069283.
std::uint32_t Crc32c(std::uint32_t crc, const void* data, std::size_t length) noexcept;
// The table-driven CRC-32C, one byte at a time: the reference for tests.
std::uint32_t Crc32cPortable(std::uint32_t crc, const void* data, std::size_t length) noexcept;
inline std::uint32_t Crc32c(const void* data, std::size_t length) noexcept {
  return Crc32c(0, data, length);
}

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_CRC32C_H_
