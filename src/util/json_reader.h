// util/json_reader.h: a strict JSON parser (RFC 8259) for the files MemAscend reads from
// other tools: Hugging Face's config.json, safetensors headers and their shard indexes.
//
//   MEMASCEND_ASSIGN_OR_RETURN(util::JsonValue v, util::ParseJson(text));
//   MEMASCEND_ASSIGN_OR_RETURN(std::int64_t hidden, v.GetInt("hidden_size"));
//
// Strict: one value, then only whitespace; no comments, trailing commas, NaN or leading
// zeros; strings are UTF-8 with escapes decoded (\uXXXX surrogate pairs included); a
// duplicate key in an object is an error (it would otherwise pick one value silently).
// Numbers keep their text: GetInt() refuses a fraction or exponent and anything out of
// int64's range, GetDouble() converts. Nesting deeper than 256 is refused, so a
// malicious header cannot exhaust the stack. Errors are kInvalidArgument saying where
// (byte offset) and what.
//
// Thread-safety: a JsonValue is an immutable tree once parsed.
#ifndef MEMASCEND_SRC_UTIL_JSON_READER_H_
#define MEMASCEND_SRC_UTIL_JSON_READER_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

namespace memascend::util {

class JsonValue {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  JsonValue() = default;
  Type type() const noexcept { return type_; }
  bool is_null() const noexcept { return type_ == Type::kNull; }
  bool is_object() const noexcept { return type_ == Type::kObject; }
  bool is_array() const noexcept { return type_ == Type::kArray; }
  bool is_string() const noexcept { return type_ == Type::kString; }
  bool is_number() const noexcept { return type_ == Type::kNumber; }

  // The value as a type; kInvalidArgument (naming the type found) otherwise.
  absl::StatusOr<bool> AsBool() const;
  absl::StatusOr<std::int64_t> AsInt() const;  // an integer literal within int64
  absl::StatusOr<double> AsDouble() const;
  absl::StatusOr<std::string> AsString() const;
  const std::vector<JsonValue>& items() const noexcept { return items_; }  // an array's
  // An object's members, in key order.
  const std::map<std::string, JsonValue, std::less<>>& members() const noexcept { return members_; }

  // An object's member, or null when absent (or when this is not an object).
  const JsonValue* Find(std::string_view key) const;
  // A required member as a type: kNotFound naming the key when absent.
  absl::StatusOr<std::int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetDouble(std::string_view key) const;
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;

  std::string_view TypeName() const noexcept;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  std::string text_;  // a string's value, or a number's literal
  std::vector<JsonValue> items_;
  std::map<std::string, JsonValue, std::less<>> members_;
};

// Parses one JSON document. kInvalidArgument saying where and what for anything else, and
// for a document of more than `max_values` values (each array item, member value and the
// document itself counts one): a parsed value takes some hundred bytes, so a reader of
// untrusted files bounds the tree, not only the text (two bytes, "1,", are a value).
absl::StatusOr<JsonValue> ParseJson(
    std::string_view text, std::size_t max_values = std::numeric_limits<std::size_t>::max());

}  // namespace memascend::util

#endif  // MEMASCEND_SRC_UTIL_JSON_READER_H_
