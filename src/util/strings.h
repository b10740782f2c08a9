// util/strings.h: the few string helpers MemAscend needs, on std::string_view.
//
// Note [absl string_view]: Debian's Abseil (20220623) is built with its own
// absl::string_view, not an alias of std::string_view, so absl's string utilities do
// not accept std::string_view. MemAscend builds strings with fmt and std, and uses
// Abseil only for Status, StatusOr and synchronization.
#ifndef MEMASCEND_SRC_UTIL_STRINGS_H_
#define MEMASCEND_SRC_UTIL_STRINGS_H_

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace memascend::util {

constexpr bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

constexpr std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// Removes `prefix` from the front of *s and returns true, or leaves *s alone.
constexpr bool ConsumePrefix(std::string_view* s, std::string_view prefix) {
  if (!s->starts_with(prefix)) return false;
  s->remove_prefix(prefix.size());
  return true;
}

constexpr bool ConsumeSuffix(std::string_view* s, std::string_view suffix) {
  if (!s->ends_with(suffix)) return false;
  s->remove_suffix(suffix.size());
  return true;
}

// The whole of `s` as an integer in `base`, or nullopt (empty, junk, overflow).
template <typename T>
std::optional<T> ParseInt(std::string_view s, int base = 10) {
  T value{};
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(s.data(), end, value, base);
  if (s.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

// Splits "key<sep>value" at the first `sep`; both sides trimmed. nullopt without `sep`.
struct KeyValue {
  std::string_view key;
  std::string_view value;
};
constexpr std::optional<KeyValue> SplitKeyValue(std::string_view s, char sep) {
  const auto pos = s.find(sep);
  if (pos == std::string_view::npos) return std::nullopt;
  return KeyValue{Trim(s.substr(0, pos)), Trim(s.substr(pos + 1))};
}

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_STRINGS_H_
