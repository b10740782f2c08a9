// util/units.h: byte sizes as people write them ("64MiB", "1G") and as reports print them.
#ifndef MEMASCEND_SRC_UTIL_UNITS_H_
#define MEMASCEND_SRC_UTIL_UNITS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include <absl/status/statusor.h>

namespace memascend::util {

// Parses a non-negative integer with an optional binary suffix: K, M, G, T, each
// optionally followed by "iB" or "B" (all powers of 1024: "4K" == "4KiB" == 4096).
// Overflow, fractions, negatives and unknown suffixes are kInvalidArgument.
absl::StatusOr<std::uint64_t> ParseByteSize(std::string_view text);

// "512 B", "4.00 KiB", "1.50 GiB": binary units, two decimals above bytes.
std::string FormatBytes(std::uint64_t bytes);

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_UNITS_H_
