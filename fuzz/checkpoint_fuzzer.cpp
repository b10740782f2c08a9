// libFuzzer target for what MemAscend reads from checkpoints other tools wrote: JSON
// (config.json, shard indexes) and safetensors headers. Whatever the bytes, they must
// give a value or a status, never crash, hang or read out of bounds; a header that is
// accepted must describe tensors that tile its data region exactly.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "train/safetensors_header.h"
#include "util/json_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)memascend::util::ParseJson(text);
  if (size < 2) return 0;
  // The first two bytes choose the data region's size; the rest is the header.
  const std::uint64_t data_bytes = (std::uint64_t{data[0]} << 8 | data[1]) * 4;
  auto h = memascend::train::ParseSafetensorsHeader(text.substr(2), data_bytes, "fuzz");
  if (h.ok()) {
    std::uint64_t at = 0;
    for (const memascend::SafetensorsTensor& t : h->tensors) {
      if (t.begin != at || t.end < t.begin ||
          t.end - t.begin != t.elements() * memascend::SafetensorsElementBytes(t.dtype))
        __builtin_trap();
      at = t.end;
    }
    if (at != data_bytes) __builtin_trap();
  }
  return 0;
}
