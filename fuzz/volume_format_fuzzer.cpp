// libFuzzer target for the decoders that read what is on a volume's disk: the
// superblock, journal record streams and journal replay. Whatever the bytes, they
// must return a status or a report, never crash, hang or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "storage/format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace memascend::storage;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  if (size >= kMetaBlock) {
    auto sb = DecodeSuperblock(bytes.first(kMetaBlock));
    if (sb.ok()) {
      // A decoded superblock re-encodes to a block that decodes to the same values.
      auto again = DecodeSuperblock(EncodeSuperblock(*sb));
      if (!again.ok() || again->generation != sb->generation || again->data_units != sb->data_units)
        __builtin_trap();
    }
  }
  auto records = DecodeRecords(bytes);
  if (records.ok()) {
    // Records that decode re-encode to the same bytes.
    const auto encoded = EncodeRecords(*records);
    if (encoded.size() != size || (size > 0 && std::memcmp(encoded.data(), data, size) != 0))
      __builtin_trap();
  }
  std::uint64_t epoch = 0;
  if (size >= 8) std::memcpy(&epoch, data, 8);
  const Replay replay = ReplayJournal(bytes, epoch);
  if (replay.blocks_used * kMetaBlock > size) __builtin_trap();
  return 0;
}
