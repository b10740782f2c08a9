// train/safetensors_header.h: the checks of a safetensors header (Note [safetensors
// layout] in memascend/safetensors.h), apart from the file, so that the fuzzer reaches
// them with any bytes.
#ifndef MEMASCEND_SRC_TRAIN_SAFETENSORS_HEADER_H_
#define MEMASCEND_SRC_TRAIN_SAFETENSORS_HEADER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/safetensors.h>

namespace memascend::train {

// The most JSON values a header or a shard index may hold: some 125,000 tensors' entries
// (eight values each), far past any checkpoint's file, and a parsed tree of some hundred
// MiB at most where the 100 MiB of text allowed would otherwise parse into gigabytes.
inline constexpr std::size_t kMaxHeaderValues = std::size_t{1} << 20;

struct ParsedHeader {
  std::vector<SafetensorsTensor> tensors;  // in data order, tiling [0, data_bytes)
  std::map<std::string, std::string> metadata;
};

// `header`: the JSON after the length; `data_bytes`: the bytes after the header; `path`
// names the file in errors. kFailedPrecondition when the header is not a JSON object at
// all (not a safetensors file); kDataLoss naming the tensor for any other fault.
absl::StatusOr<ParsedHeader> ParseSafetensorsHeader(std::string_view header,
                                                    std::uint64_t data_bytes,
                                                    std::string_view path);

}  // namespace memascend::train

#endif  // MEMASCEND_SRC_TRAIN_SAFETENSORS_HEADER_H_
