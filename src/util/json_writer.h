// util/json_writer.h: a small streaming writer of compact JSON, for the reports that
// the CLI and benchmarks print (one object per line, machine-readable).
#ifndef MEMASCEND_SRC_UTIL_JSON_WRITER_H_
#define MEMASCEND_SRC_UTIL_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace memascend::util {

// Writes values in order; Key() precedes each value inside an object. Misnesting is
// a programming error caught by assertions in debug builds.
// Thread-safety: none.
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(std::string_view key);

  JsonWriter& String(std::string_view value);
  JsonWriter& Bool(bool value);
  JsonWriter& Int(std::int64_t value);
  JsonWriter& Uint(std::uint64_t value);
  JsonWriter& Double(double value);  // non-finite values become null
  JsonWriter& Null();

  // Key(key) followed by the value, choosing the writer by type.
  JsonWriter& Field(std::string_view key, std::string_view value) { return Key(key).String(value); }
  JsonWriter& Field(std::string_view key, const char* value) { return Key(key).String(value); }
  JsonWriter& Field(std::string_view key, bool value) { return Key(key).Bool(value); }
  JsonWriter& Field(std::string_view key, double value) { return Key(key).Double(value); }
  template <typename T>
  requires std::is_integral_v<T> &&
      (!std::is_same_v<T, bool>)JsonWriter& Field(std::string_view key, T value) {
    Key(key);
    if constexpr (std::is_signed_v<T>) {
      return Int(static_cast<std::int64_t>(value));
    } else {
      return Uint(static_cast<std::uint64_t>(value));
    }
  }

  const std::string& str() const& { return out_; }
  std::string str() && { return std::move(out_); }

 private:
  void BeforeValue();

  std::string out_;
  struct Frame {
    bool object;     // an object (values need keys) or an array
    bool has_items;  // a comma goes before the next item
  };
  std::vector<Frame> stack_;  // one per open container
  bool after_key_ = false;
};

// `value` as a JSON string literal, quotes included.
std::string JsonQuote(std::string_view value);

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_JSON_WRITER_H_
