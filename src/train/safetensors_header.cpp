#include "train/safetensors_header.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "util/json_reader.h"

namespace memascend {
namespace {

bool MulOverflows(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

}  // namespace

std::size_t SafetensorsElementBytes(std::string_view d) noexcept {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

std::string_view SafetensorsName(DType t) noexcept {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

std::uint64_t SafetensorsTensor::elements() const noexcept {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<DType> SafetensorsTensor::Type() const {
  if (dtype == "F32") return DType::kF32;
  if (dtype == "F16") return DType::kF16;
  if (dtype == "BF16") return DType::kBF16;
  return absl::InvalidArgumentError(
      fmt::format("tensor '{}' has dtype {}; MemAscend reads F32, F16 and BF16", name, dtype));
}

namespace train {

absl::StatusOr<ParsedHeader> ParseSafetensorsHeader(std::string_view header,
                                                    std::uint64_t data_bytes,
                                                    std::string_view path) {
  if (header.empty() || header[0] != '{') {
    return absl::FailedPreconditionError(
        fmt::format("{}: the header is not a JSON object: not a safetensors file", path));
  }
  auto parsed = util::ParseJson(header, kMaxHeaderValues);
  if (!parsed.ok()) {
    return absl::DataLossError(
        fmt::format("{}: header: {}", path, std::string(parsed.status().message())));
  }
  if (!parsed->is_object())
    return absl::DataLossError(fmt::format("{}: the header is not a JSON object", path));
  ParsedHeader out;
  for (const auto& member : parsed->members()) {
    const std::string& name = member.first;  // not a structured binding: lambdas capture it
    const util::JsonValue& v = member.second;
    if (name == "__metadata__") {
      if (!v.is_object())
        return absl::DataLossError(fmt::format("{}: __metadata__ is not an object", path));
      for (const auto& [k, m] : v.members()) {
        auto s = m.AsString();
        if (!s.ok())
          return absl::DataLossError(fmt::format("{}: __metadata__ '{}' is not a string", path, k));
        out.metadata[k] = *s;
      }
      continue;
    }
    auto bad = [&](std::string_view what) {
      return absl::DataLossError(fmt::format("{}: tensor '{}': {}", path, name, what));
    };
    if (!v.is_object()) return bad("its entry is not an object");
    SafetensorsTensor t;
    t.name = name;
    auto dtype = v.GetString("dtype");
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    t.dtype = *dtype;
    const std::size_t esize = SafetensorsElementBytes(t.dtype);
    if (esize == 0) return bad(fmt::format("unknown dtype '{}'", t.dtype));
    const util::JsonValue* shape = v.Find("shape");
    if (shape == nullptr || !shape->is_array()) return bad("no shape array");
    std::uint64_t elements = 1;
    for (const util::JsonValue& d : shape->items()) {
      auto n = d.AsInt();
      if (!n.ok() || *n < 0) return bad("a shape entry that is not a count");
      t.shape.push_back(static_cast<std::uint64_t>(*n));
      if (MulOverflows(elements, t.shape.back(), &elements)) return bad("a shape that overflows");
    }
    const util::JsonValue* offsets = v.Find("data_offsets");
    if (offsets == nullptr || !offsets->is_array() || offsets->items().size() != 2)
      return bad("no data_offsets pair");
    auto begin = offsets->items()[0].AsInt();
    auto end = offsets->items()[1].AsInt();
    if (!begin.ok() || !end.ok() || *begin < 0 || *end < *begin)
      return bad("data_offsets that are not an ordered pair of byte counts");
    t.begin = static_cast<std::uint64_t>(*begin);
    t.end = static_cast<std::uint64_t>(*end);
    std::uint64_t want = 0;
    if (MulOverflows(elements, esize, &want)) {
      return bad(fmt::format("{} x shape [{} dimensions] needs more bytes than 64 bits count",
                             t.dtype, t.shape.size()));
    }
    if (want != t.end - t.begin) {
      return bad(fmt::format("data_offsets [{}, {}) hold {} bytes, {} x shape needs {}", t.begin,
                             t.end, t.end - t.begin, t.dtype, want));
    }
    if (t.end > data_bytes) {
      return bad(
          fmt::format("data_offsets [{}, {}) pass the end of the data ({} bytes): the "
                      "file is truncated or the header wrong",
                      t.begin, t.end, data_bytes));
    }
    out.tensors.push_back(std::move(t));
  }
  // The tensors tile the data region: no overlap (two tensors sharing bytes would be
  // written through each other) and no gap.
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < out.tensors.size(); ++i) {
    const SafetensorsTensor& t = out.tensors[i];
    if (t.begin < at) {
      return absl::DataLossError(fmt::format("{}: tensor '{}' [{}, {}) overlaps tensor '{}'", path,
                                             t.name, t.begin, t.end, out.tensors[i - 1].name));
    }
    if (t.begin > at) {
      return absl::DataLossError(fmt::format("{}: {} bytes before tensor '{}' belong to no tensor",
                                             path, t.begin - at, t.name));
    }
    at = t.end;
  }
  if (at != data_bytes) {
    return absl::DataLossError(fmt::format("{}: {} bytes after the last tensor belong to no tensor",
                                           path, data_bytes - at));
  }
  return out;
}

}  // namespace train
}  // namespace memascend
