#include "util/units.h"

#include <cctype>

#include <fmt/format.h>

#include "util/strings.h"

namespace memascend::util {

absl::StatusOr<std::uint64_t> ParseByteSize(std::string_view text) {
  const std::string_view original = text;
  text = Trim(text);
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) {
    return absl::InvalidArgumentError(
        fmt::format("not a byte size: '{}' (expected e.g. 4096, 64K, 1GiB)", original));
  }
  const auto parsed = ParseInt<std::uint64_t>(text.substr(0, digits));
  if (!parsed) {
    return absl::InvalidArgumentError(fmt::format("byte size out of range: '{}'", original));
  }
  const std::uint64_t value = *parsed;
  std::string suffix(text.substr(digits));
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (!suffix.empty()) {
    switch (suffix[0]) {
      case 'K':
        shift = 10;
        break;
      case 'M':
        shift = 20;
        break;
      case 'G':
        shift = 30;
        break;
      case 'T':
        shift = 40;
        break;
      case 'B':
        shift = 0;
        break;
      default:
        shift = -1;
    }
    const std::string_view rest = std::string_view(suffix).substr(suffix[0] == 'B' ? 0 : 1);
    if (shift < 0 || !(rest.empty() || rest == "B" || rest == "IB")) {
      return absl::InvalidArgumentError(fmt::format(
          "unknown unit in byte size '{}' (use K, M, G, T, KiB, MiB, GiB, TiB)", original));
    }
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) {
    return absl::InvalidArgumentError(fmt::format("byte size out of range: '{}'", original));
  }
  return value << shift;
}

std::string FormatBytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace memascend::util
