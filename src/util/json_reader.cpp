#include "util/json_reader.h"

#include <cerrno>
#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

namespace memascend::util {

constexpr int kMaxDepth = 256;

class JsonParser {
 public:
  JsonParser(std::string_view text, std::size_t max_values) : s_(text), left_(max_values) {}

  absl::StatusOr<JsonValue> Document() {
    JsonValue v;
    SkipSpace();
    if (!Value(&v, 0)) return error_;
    SkipSpace();
    if (pos_ != s_.size()) {
      Fail("text after the value");
      return error_;
    }
    return v;
  }

 private:
  bool Fail(std::string_view what) {
    error_ = absl::InvalidArgumentError(fmt::format("json: {} at byte {}", what, pos_));
    return false;
  }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool Literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return Fail("an unknown literal");
    pos_ += word.size();
    return true;
  }

  bool Value(JsonValue* v, int depth) {
    if (depth > kMaxDepth) return Fail("nesting deeper than 256");
    if (left_ == 0) return Fail("more values than this document may hold");
    --left_;
    if (pos_ >= s_.size()) return Fail("the end of the text where a value belongs");
    switch (s_[pos_]) {
      case '{':
        return Object(v, depth);
      case '[':
        return Array(v, depth);
      case '"':
        v->type_ = JsonValue::Type::kString;
        return String(&v->text_);
      case 't':
        v->type_ = JsonValue::Type::kBool;
        v->bool_ = true;
        return Literal("true");
      case 'f':
        v->type_ = JsonValue::Type::kBool;
        return Literal("false");
      case 'n':
        v->type_ = JsonValue::Type::kNull;
        return Literal("null");
      default:
        return Number(v);
    }
  }

  bool Object(JsonValue* v, int depth) {
    v->type_ = JsonValue::Type::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return true;
    }
    for (;;) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Fail("an object key that is not a string");
      std::string key;
      const std::size_t key_at = pos_;
      if (!String(&key)) return false;
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Fail("no ':' after an object key");
      ++pos_;
      SkipSpace();
      JsonValue member;
      if (!Value(&member, depth + 1)) return false;
      if (!v->members_.emplace(std::move(key), std::move(member)).second) {
        pos_ = key_at;
        return Fail("a key repeated in one object");
      }
      SkipSpace();
      if (pos_ >= s_.size()) return Fail("an unterminated object");
      if (s_[pos_] == '}') {
        ++pos_;
        return true;
      }
      if (s_[pos_] != ',') return Fail("no ',' or '}' after an object member");
      ++pos_;
    }
  }

  bool Array(JsonValue* v, int depth) {
    v->type_ = JsonValue::Type::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return true;
    }
    for (;;) {
      SkipSpace();
      JsonValue item;
      if (!Value(&item, depth + 1)) return false;
      v->items_.push_back(std::move(item));
      SkipSpace();
      if (pos_ >= s_.size()) return Fail("an unterminated array");
      if (s_[pos_] == ']') {
        ++pos_;
        return true;
      }
      if (s_[pos_] != ',') return Fail("no ',' or ']' after an array item");
      ++pos_;
    }
  }

  static void AppendUtf8(std::string* out, std::uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool Hex4(std::uint32_t* out) {
    if (pos_ + 4 > s_.size()) return Fail("a short \\u escape");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<std::uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<std::uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<std::uint32_t>(c - 'A' + 10);
      } else {
        return Fail("a bad hex digit in a \\u escape");
      }
    }
    *out = v;
    return true;
  }

  // Checks one UTF-8 sequence starting at pos_ and copies it.
  bool Utf8(std::string* out) {
    const auto b0 = static_cast<unsigned char>(s_[pos_]);
    int len = 0;
    std::uint32_t cp = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      len = 2;
      cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      len = 3;
      cp = b0 & 0x0F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      len = 4;
      cp = b0 & 0x07;
    } else {
      return Fail("invalid UTF-8");
    }
    if (pos_ + static_cast<std::size_t>(len) > s_.size()) return Fail("truncated UTF-8");
    for (int i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(s_[pos_ + static_cast<std::size_t>(i)]);
      if ((b & 0xC0) != 0x80) return Fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      return Fail("invalid UTF-8");
    out->append(s_.substr(pos_, static_cast<std::size_t>(len)));
    pos_ += static_cast<std::size_t>(len);
    return true;
  }

  bool String(std::string* out) {
    ++pos_;  // '"'
    for (;;) {
      if (pos_ >= s_.size()) return Fail("an unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return true;
      }
      if (static_cast<unsigned char>(c) < 0x20) return Fail("a control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        if (!Utf8(out)) return false;
        continue;
      }
      if (c != '\\') {
        out->push_back(c);
        ++pos_;
        continue;
      }
      if (++pos_ >= s_.size()) return Fail("an unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          std::uint32_t cp = 0;
          if (!Hex4(&cp)) return false;
          if (cp >= 0xDC00 && cp <= 0xDFFF) return Fail("a lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            std::uint32_t low = 0;
            if (s_.substr(pos_, 2) != "\\u") return Fail("a high surrogate without its pair");
            pos_ += 2;
            if (!Hex4(&low)) return false;
            if (low < 0xDC00 || low > 0xDFFF) return Fail("a high surrogate without its pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          AppendUtf8(out, cp);
          break;
        }
        default:
          --pos_;
          return Fail("an unknown escape");
      }
    }
  }

  bool Number(JsonValue* v) {
    const std::size_t start = pos_;
    auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9')
      return Fail("an unexpected character");
    if (s_[pos_] == '0') {
      ++pos_;
      if (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') return Fail("a leading zero");
    } else {
      digits();
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) return Fail("no digits after a decimal point");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Fail("no digits in an exponent");
    }
    v->type_ = JsonValue::Type::kNumber;
    v->text_.assign(s_.substr(start, pos_ - start));
    return true;
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  std::size_t left_;  // values the document may still hold
  absl::Status error_;
};

absl::StatusOr<JsonValue> ParseJson(std::string_view text, std::size_t max_values) {
  return JsonParser(text, max_values).Document();
}

std::string_view JsonValue::TypeName() const noexcept {
  switch (type_) {
    case Type::kNull:
      return "null";
    case Type::kBool:
      return "a boolean";
    case Type::kNumber:
      return "a number";
    case Type::kString:
      return "a string";
    case Type::kArray:
      return "an array";
    case Type::kObject:
      return "an object";
  }
  return "?";
}

absl::StatusOr<bool> JsonValue::AsBool() const {
  if (type_ != Type::kBool)
    return absl::InvalidArgumentError(fmt::format("json: {} where a boolean belongs", TypeName()));
  return bool_;
}

absl::StatusOr<std::int64_t> JsonValue::AsInt() const {
  if (type_ != Type::kNumber)
    return absl::InvalidArgumentError(fmt::format("json: {} where an integer belongs", TypeName()));
  std::int64_t v = 0;
  const char* end = text_.data() + text_.size();
  const auto [ptr, ec] = std::from_chars(text_.data(), end, v);
  if (ec != std::errc() || ptr != end) {
    return absl::InvalidArgumentError(
        fmt::format("json: {} is not an integer within 64 bits", text_));
  }
  return v;
}

absl::StatusOr<double> JsonValue::AsDouble() const {
  if (type_ != Type::kNumber)
    return absl::InvalidArgumentError(fmt::format("json: {} where a number belongs", TypeName()));
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text_.c_str(), &end);
  if (end != text_.c_str() + text_.size() || errno == ERANGE)
    return absl::InvalidArgumentError(fmt::format("json: {} is out of a double's range", text_));
  return v;
}

absl::StatusOr<std::string> JsonValue::AsString() const {
  if (type_ != Type::kString)
    return absl::InvalidArgumentError(fmt::format("json: {} where a string belongs", TypeName()));
  return text_;
}

const JsonValue* JsonValue::Find(std::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  const auto it = members_.find(key);
  return it == members_.end() ? nullptr : &it->second;
}

namespace {
template <typename T, typename F>
absl::StatusOr<T> Member(const JsonValue& v, std::string_view key, F&& as) {
  const JsonValue* m = v.Find(key);
  if (m == nullptr) return absl::NotFoundError(fmt::format("json: no '{}'", key));
  auto r = as(*m);
  if (!r.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("json: '{}': {}", key, std::string(r.status().message())));
  }
  return r;
}
}  // namespace

absl::StatusOr<std::int64_t> JsonValue::GetInt(std::string_view key) const {
  return Member<std::int64_t>(*this, key, [](const JsonValue& m) { return m.AsInt(); });
}
absl::StatusOr<double> JsonValue::GetDouble(std::string_view key) const {
  return Member<double>(*this, key, [](const JsonValue& m) { return m.AsDouble(); });
}
absl::StatusOr<std::string> JsonValue::GetString(std::string_view key) const {
  return Member<std::string>(*this, key, [](const JsonValue& m) { return m.AsString(); });
}
absl::StatusOr<bool> JsonValue::GetBool(std::string_view key) const {
  return Member<bool>(*this, key, [](const JsonValue& m) { return m.AsBool(); });
}

}  // namespace memascend::util
