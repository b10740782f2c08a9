#include "storage/format.h"

#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "util/crc32c.h"

namespace memascend::storage {

static_assert(std::endian::native == std::endian::little, "the format is written little-endian");

absl::Status CheckObject(std::string_view name, std::string_view metadata) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        fmt::format("object name must be 1..{} bytes, got {}", kMaxNameBytes, name.size()));
  }
  if (metadata.size() > kMaxMetadataBytes) {
    return absl::InvalidArgumentError(
        fmt::format("metadata of {} bytes exceeds {}", metadata.size(), kMaxMetadataBytes));
  }
  return absl::OkStatus();
}

namespace {

// Superblock field offsets.
constexpr std::size_t kOffMagic = 0, kOffVersion = 8, kOffGeneration = 16, kOffUuid = 24,
                      kOffBlock = 40, kOffUnit = 44, kOffCapacity = 48, kOffJournal = 56,
                      kOffJournalHalf = 64, kOffData = 72, kOffUnits = 80, kOffHalf = 88,
                      kOffEpoch = 96, kOffCrc = kMetaBlock - 4;

// Journal block header offsets.
constexpr std::size_t kJOffMagic = 0, kJOffCrc = 4, kJOffSeq = 8, kJOffEpoch = 16, kJOffLength = 24,
                      kJOffFlags = 28;
// Flags: the block's index within its commit (low 16 bits) and the commit's block count.

// Record header: type, reserved, name length, metadata length, size, checksum, extents.
constexpr std::size_t kRecordHeader = 24;

}  // namespace

std::array<std::byte, kMetaBlock> EncodeSuperblock(const Superblock& sb) {
  std::array<std::byte, kMetaBlock> b{};
  std::byte* p = b.data();
  PutLe(p + kOffMagic, kSuperMagic);
  PutLe(p + kOffVersion, kFormatVersion);
  PutLe(p + kOffGeneration, sb.generation);
  std::memcpy(p + kOffUuid, sb.uuid.data(), 16);
  PutLe(p + kOffBlock, sb.block_size);
  PutLe(p + kOffUnit, sb.unit_bytes);
  PutLe(p + kOffCapacity, sb.capacity);
  PutLe(p + kOffJournal, sb.journal_offset);
  PutLe(p + kOffJournalHalf, sb.journal_half_bytes);
  PutLe(p + kOffData, sb.data_offset);
  PutLe(p + kOffUnits, sb.data_units);
  PutLe(p + kOffHalf, sb.active_half);
  PutLe(p + kOffEpoch, sb.epoch);
  PutLe(p + kOffCrc, util::Crc32c(p, kOffCrc));
  return b;
}

absl::StatusOr<Superblock> DecodeSuperblock(std::span<const std::byte> block) {
  if (block.size() < kMetaBlock) return absl::DataLossError("superblock: short block");
  const std::byte* p = block.data();
  if (GetLe<std::uint64_t>(p + kOffMagic) != kSuperMagic) {
    return absl::DataLossError("superblock: not a MemAscend volume (bad magic)");
  }
  if (GetLe<std::uint32_t>(p + kOffCrc) != util::Crc32c(p, kOffCrc)) {
    return absl::DataLossError("superblock: checksum mismatch");
  }
  if (const auto v = GetLe<std::uint32_t>(p + kOffVersion); v != kFormatVersion) {
    return absl::DataLossError(
        fmt::format("superblock: format version {} (this build reads {})", v, kFormatVersion));
  }
  Superblock sb;
  sb.generation = GetLe<std::uint64_t>(p + kOffGeneration);
  std::memcpy(sb.uuid.data(), p + kOffUuid, 16);
  sb.block_size = GetLe<std::uint32_t>(p + kOffBlock);
  sb.unit_bytes = GetLe<std::uint32_t>(p + kOffUnit);
  sb.capacity = GetLe<std::uint64_t>(p + kOffCapacity);
  sb.journal_offset = GetLe<std::uint64_t>(p + kOffJournal);
  sb.journal_half_bytes = GetLe<std::uint64_t>(p + kOffJournalHalf);
  sb.data_offset = GetLe<std::uint64_t>(p + kOffData);
  sb.data_units = GetLe<std::uint64_t>(p + kOffUnits);
  sb.active_half = GetLe<std::uint32_t>(p + kOffHalf);
  sb.epoch = GetLe<std::uint64_t>(p + kOffEpoch);
  // Geometry a writer could have produced; anything else is damage.
  const bool sane =
      sb.block_size >= 512 && std::has_single_bit(sb.block_size) && sb.block_size <= kMetaBlock &&
      sb.unit_bytes >= kMetaBlock && sb.unit_bytes % kMetaBlock == 0 && sb.active_half <= 1 &&
      sb.journal_offset >= 2 * kMetaBlock && sb.journal_half_bytes >= kMetaBlock &&
      sb.journal_half_bytes % kMetaBlock == 0 &&
      sb.journal_offset + 2 * sb.journal_half_bytes <= sb.data_offset &&
      sb.data_offset % kMetaBlock == 0 && sb.data_units > 0 &&
      sb.data_units <= (sb.capacity - std::min(sb.capacity, sb.data_offset)) / sb.unit_bytes;
  if (!sane) return absl::DataLossError("superblock: impossible geometry");
  return sb;
}

std::vector<std::byte> EncodeRecords(std::span<const JournalRecord> records) {
  std::vector<std::byte> out;
  for (const JournalRecord& r : records) {
    const std::size_t at = out.size();
    out.resize(at + kRecordHeader + r.name.size() + r.metadata.size() + r.extents.size() * 16);
    std::byte* p = out.data() + at;
    PutLe(p, static_cast<std::uint8_t>(r.type));
    PutLe(p + 1, std::uint8_t{0});
    PutLe(p + 2, static_cast<std::uint16_t>(r.name.size()));
    PutLe(p + 4, static_cast<std::uint32_t>(r.metadata.size()));
    PutLe(p + 8, r.size);
    PutLe(p + 16, r.checksum);
    PutLe(p + 20, static_cast<std::uint32_t>(r.extents.size()));
    p += kRecordHeader;
    std::memcpy(p, r.name.data(), r.name.size());
    p += r.name.size();
    std::memcpy(p, r.metadata.data(), r.metadata.size());
    p += r.metadata.size();
    for (const Extent& e : r.extents) {
      PutLe(p, e.start);
      PutLe(p + 8, e.units);
      p += 16;
    }
  }
  return out;
}

absl::StatusOr<std::vector<JournalRecord>> DecodeRecords(std::span<const std::byte> stream) {
  std::vector<JournalRecord> records;
  std::size_t at = 0;
  while (at < stream.size()) {
    if (stream.size() - at < kRecordHeader) return absl::DataLossError("journal: truncated record");
    const std::byte* p = stream.data() + at;
    JournalRecord r;
    const auto type = GetLe<std::uint8_t>(p);
    if (type != 1 && type != 2)
      return absl::DataLossError(fmt::format("journal: record type {}", type));
    if (GetLe<std::uint8_t>(p + 1) != 0)
      return absl::DataLossError("journal: reserved record byte is set");
    r.type = static_cast<RecordType>(type);
    const auto name_len = GetLe<std::uint16_t>(p + 2);
    const auto meta_len = GetLe<std::uint32_t>(p + 4);
    r.size = GetLe<std::uint64_t>(p + 8);
    r.checksum = GetLe<std::uint32_t>(p + 16);
    const auto extents = GetLe<std::uint32_t>(p + 20);
    if (name_len == 0 || name_len > kMaxNameBytes || meta_len > kMaxMetadataBytes ||
        extents > kMaxExtents) {
      return absl::DataLossError("journal: record field out of range");
    }
    const std::size_t body = std::size_t{name_len} + meta_len + std::size_t{extents} * 16;
    if (stream.size() - at - kRecordHeader < body)
      return absl::DataLossError("journal: truncated record");
    p += kRecordHeader;
    r.name.assign(reinterpret_cast<const char*>(p), name_len);
    p += name_len;
    r.metadata.assign(reinterpret_cast<const char*>(p), meta_len);
    p += meta_len;
    for (std::uint32_t i = 0; i < extents; ++i) {
      r.extents.push_back({GetLe<std::uint64_t>(p), GetLe<std::uint64_t>(p + 8)});
      p += 16;
    }
    records.push_back(std::move(r));
    at += kRecordHeader + body;
  }
  return records;
}

std::size_t CommitBlocks(std::span<const JournalRecord> records) {
  std::size_t bytes = 0;
  for (const JournalRecord& r : records) {
    bytes += kRecordHeader + r.name.size() + r.metadata.size() + r.extents.size() * 16;
  }
  return std::max<std::size_t>(1, (bytes + kJournalPayload - 1) / kJournalPayload);
}

std::vector<std::byte> EncodeCommit(std::span<const JournalRecord> records, std::uint64_t first_seq,
                                    std::uint64_t epoch) {
  const std::vector<std::byte> stream = EncodeRecords(records);
  const std::size_t blocks = CommitBlocks(records);
  std::vector<std::byte> out(blocks * kMetaBlock);
  for (std::size_t i = 0; i < blocks; ++i) {
    std::byte* b = out.data() + i * kMetaBlock;
    const std::size_t from = i * kJournalPayload;
    const std::size_t len =
        std::min(kJournalPayload, stream.size() - std::min(stream.size(), from));
    PutLe(b + kJOffMagic, kJournalMagic);
    PutLe(b + kJOffSeq, first_seq + i);
    PutLe(b + kJOffEpoch, epoch);
    PutLe(b + kJOffLength, static_cast<std::uint32_t>(len));
    PutLe(b + kJOffFlags, static_cast<std::uint32_t>((blocks << 16) | i));
    if (len > 0) std::memcpy(b + kJournalHeader, stream.data() + from, len);
    PutLe(b + kJOffCrc, std::uint32_t{0});
    PutLe(b + kJOffCrc, util::Crc32c(b, kMetaBlock));
  }
  return out;
}

namespace {

struct BlockView {
  bool valid = false;
  std::uint64_t seq = 0;
  std::uint32_t length = 0;
  std::uint32_t index = 0;  // within its commit
  bool last = false;
  const std::byte* payload = nullptr;
};

BlockView View(const std::byte* b, std::uint64_t epoch) {
  BlockView v;
  if (GetLe<std::uint32_t>(b + kJOffMagic) != kJournalMagic) return v;
  if (GetLe<std::uint64_t>(b + kJOffEpoch) != epoch) return v;
  std::array<std::byte, kMetaBlock> copy;
  std::memcpy(copy.data(), b, kMetaBlock);
  PutLe(copy.data() + kJOffCrc, std::uint32_t{0});
  if (util::Crc32c(copy.data(), kMetaBlock) != GetLe<std::uint32_t>(b + kJOffCrc)) return v;
  v.length = GetLe<std::uint32_t>(b + kJOffLength);
  if (v.length > kJournalPayload) return v;
  v.seq = GetLe<std::uint64_t>(b + kJOffSeq);
  const auto flags = GetLe<std::uint32_t>(b + kJOffFlags);
  v.index = flags & 0xffffu;
  const std::uint32_t count = flags >> 16;
  if (v.index >= count || v.index > v.seq) return v;
  v.last = v.index + 1 == count;
  v.payload = b + kJournalHeader;
  v.valid = true;
  return v;
}

}  // namespace

std::array<std::byte, kMetaBlock> EncodeSeal(std::uint64_t seq, std::uint64_t epoch) {
  std::array<std::byte, kMetaBlock> b{};
  PutLe(b.data() + kJOffMagic, kJournalMagic);
  PutLe(b.data() + kJOffSeq, seq);
  PutLe(b.data() + kJOffEpoch, epoch);
  PutLe(b.data() + kJOffLength, std::uint32_t{0});
  PutLe(b.data() + kJOffFlags, std::uint32_t{0});
  PutLe(b.data() + kJOffCrc, std::uint32_t{0});
  PutLe(b.data() + kJOffCrc, util::Crc32c(b.data(), kMetaBlock));
  return b;
}

namespace {

// A seal of `epoch` for slot `slot` (EncodeSeal), checksum and all.
bool IsSeal(const std::byte* b, std::uint64_t epoch, std::size_t slot) {
  if (GetLe<std::uint32_t>(b + kJOffMagic) != kJournalMagic ||
      GetLe<std::uint64_t>(b + kJOffEpoch) != epoch || GetLe<std::uint64_t>(b + kJOffSeq) != slot ||
      GetLe<std::uint32_t>(b + kJOffLength) != 0 || GetLe<std::uint32_t>(b + kJOffFlags) != 0)
    return false;
  std::array<std::byte, kMetaBlock> copy;
  std::memcpy(copy.data(), b, kMetaBlock);
  PutLe(copy.data() + kJOffCrc, std::uint32_t{0});
  return util::Crc32c(copy.data(), kMetaBlock) == GetLe<std::uint32_t>(b + kJOffCrc);
}

}  // namespace

Replay ReplayJournal(std::span<const std::byte> half, std::uint64_t epoch) {
  Replay r;
  const std::size_t slots = half.size() / kMetaBlock;
  std::vector<std::byte> stream;
  std::size_t slot = 0;
  std::size_t commit_start = 0;
  for (; slot < slots; ++slot) {
    const BlockView v = View(half.data() + slot * kMetaBlock, epoch);
    // Block i of the half carries sequence number i; a commit's blocks are consecutive.
    if (!v.valid || v.seq != slot || v.index != slot - commit_start) break;
    stream.insert(stream.end(), v.payload, v.payload + v.length);
    if (!v.last) continue;
    auto records = DecodeRecords(stream);
    if (!records.ok()) {
      r.corrupt = true;
      r.detail = fmt::format("commit at block {}: {}", commit_start,
                             std::string(records.status().message()));
      return r;
    }
    for (JournalRecord& rec : *records) r.records.push_back(std::move(rec));
    stream.clear();
    ++r.commits;
    commit_start = slot + 1;
    r.blocks_used = slot + 1;
  }
  if (commit_start == slots) return r;  // the half is full of complete commits
  // Note [journal seals]: the seal the last commit left after itself ends the journal.
  const std::byte* stop = half.data() + slot * kMetaBlock;
  if (slot == commit_start && IsSeal(stop, epoch, slot)) return r;
  // Something stops the replay at `commit_start`: a partial commit or a damaged block.
  // A valid block of a *later* commit, or a seal after it, means the commit at
  // `commit_start` had completed (commits are written one after another, each made
  // durable before the next, and a seal only after the commit before it is durable): it
  // was damaged, not torn. Blocks of the torn commit itself, or stale ones of an earlier
  // torn commit, start at or before `commit_start`.
  for (std::size_t s = slot + 1; s < slots; ++s) {
    const std::byte* b = half.data() + s * kMetaBlock;
    const BlockView v = View(b, epoch);
    if ((v.valid && v.seq == s && s - v.index > commit_start) || IsSeal(b, epoch, s)) {
      r.corrupt = true;
      r.detail = fmt::format(
          "journal block {} is damaged but {} {} after it is valid: committed records were lost",
          slot, v.valid ? "block" : "the seal at block", s);
      return r;
    }
  }
  // A block that is neither zeros (never written since format), nor a journal block (of
  // this epoch: a torn write; of another: stale), nor a torn write whose first sector did
  // not land (a zero header), is damage: the journal was overwritten.
  if (slot == commit_start && GetLe<std::uint32_t>(stop + kJOffMagic) != kJournalMagic &&
      GetLe<std::uint64_t>(stop) != 0) {
    r.corrupt = true;
    r.detail = fmt::format(
        "journal block {} holds neither a commit, a seal nor zeros: the journal was overwritten",
        slot);
    return r;
  }
  r.torn_tail =
      slot > commit_start ||
      (slot < slots && GetLe<std::uint32_t>(half.data() + slot * kMetaBlock) == kJournalMagic &&
       GetLe<std::uint64_t>(half.data() + slot * kMetaBlock + kJOffEpoch) == epoch);
  if (r.torn_tail)
    r.detail = fmt::format("an incomplete commit at block {} was discarded", commit_start);
  return r;
}

}  // namespace memascend::storage
