// storage/format.h: the on-disk format of a MemAscend volume (docs/volume-format.md),
// as pure encode/decode functions: no I/O, so they can be fuzzed.
//
// All integers are little-endian. Metadata blocks are kMetaBlock bytes.
#ifndef MEMASCEND_SRC_STORAGE_FORMAT_H_
#define MEMASCEND_SRC_STORAGE_FORMAT_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

namespace memascend::storage {

inline constexpr std::uint32_t kMetaBlock = 4096;
inline constexpr std::uint32_t kFormatVersion = 1;
inline constexpr std::uint64_t kSuperMagic = 0x314C4F5643534D41ull;  // "AMSCVOL1" read LE
inline constexpr std::uint32_t kJournalMagic = 0x4E524A4Du;          // "MJRN"
inline constexpr std::size_t kJournalHeader = 32;
inline constexpr std::size_t kJournalPayload = kMetaBlock - kJournalHeader;
inline constexpr std::size_t kMaxNameBytes = 255;
inline constexpr std::size_t kMaxMetadataBytes = 16 * 1024;
inline constexpr std::size_t kMaxExtents = 4096;

// Little-endian integers in place (the format's, and the host's: format.cpp asserts it).
template <typename T>
void PutLe(std::byte* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}
template <typename T>
T GetLe(const std::byte* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

// An object's name (1..kMaxNameBytes) and metadata (up to kMaxMetadataBytes), as every
// object store takes them: kInvalidArgument otherwise.
absl::Status CheckObject(std::string_view name, std::string_view metadata);

struct Superblock {
  std::uint64_t generation = 0;
  std::array<std::uint8_t, 16> uuid{};
  std::uint32_t block_size = 4096;   // the device's I/O block (>= logical block size)
  std::uint32_t unit_bytes = 0;      // allocation unit of the data region
  std::uint64_t capacity = 0;        // bytes of the target in use
  std::uint64_t journal_offset = 0;  // two halves of journal_half_bytes each
  std::uint64_t journal_half_bytes = 0;
  std::uint64_t data_offset = 0;
  std::uint64_t data_units = 0;
  std::uint32_t active_half = 0;  // which half holds the live journal
  std::uint64_t epoch = 0;        // the live half's blocks carry this epoch
};

// One kMetaBlock block: fields, zero padding, CRC-32C of the rest in the last 4 bytes.
std::array<std::byte, kMetaBlock> EncodeSuperblock(const Superblock& sb);
// kDataLoss for a wrong magic, version, checksum or impossible geometry.
absl::StatusOr<Superblock> DecodeSuperblock(std::span<const std::byte> block);

struct Extent {
  std::uint64_t start = 0;  // in allocation units from the data region's start
  std::uint64_t units = 0;
  friend bool operator==(const Extent&, const Extent&) = default;
};

enum class RecordType : std::uint8_t { kPut = 1, kDelete = 2 };

struct JournalRecord {
  RecordType type = RecordType::kPut;
  std::string name;
  std::string metadata;  // kPut
  std::uint64_t size = 0;
  std::uint32_t checksum = 0;
  std::vector<Extent> extents;
  friend bool operator==(const JournalRecord&, const JournalRecord&) = default;
};

// A commit: its records, packed into as many journal blocks as they need, the last one
// flagged. Blocks carry consecutive sequence numbers from `first_seq`.
std::vector<std::byte> EncodeCommit(std::span<const JournalRecord> records, std::uint64_t first_seq,
                                    std::uint64_t epoch);
std::size_t CommitBlocks(std::span<const JournalRecord> records);

// What replaying one journal half found.
struct Replay {
  std::vector<JournalRecord> records;  // of complete, valid commits, in order
  std::uint64_t blocks_used = 0;       // blocks of complete commits: the next write slot
  std::uint64_t commits = 0;
  bool torn_tail = false;  // an incomplete or invalid last write (a crash mid-commit): normal
  // A damaged block followed by valid later blocks: committed records were lost.
  bool corrupt = false;
  std::string detail;
};
// Replays `half` (journal_half_bytes) for `epoch`. Never fails: damage is reported.
// Note [journal seals]: a torn tail is told from damage by what follows the last valid
// commit (docs/volume-format.md).
Replay ReplayJournal(std::span<const std::byte> half, std::uint64_t epoch);

// Note [journal seals]: the block written at slot `seq` once the commit before it is
// durable: a journal block of no commit (length 0, flags 0). Its presence after a slot
// that does not replay proves that slot's commit had completed.
std::array<std::byte, kMetaBlock> EncodeSeal(std::uint64_t seq, std::uint64_t epoch);

// Exposed for tests and the fuzzer.
std::vector<std::byte> EncodeRecords(std::span<const JournalRecord> records);
absl::StatusOr<std::vector<JournalRecord>> DecodeRecords(std::span<const std::byte> stream);

}  // namespace memascend::storage

#endif  // MEMASCEND_SRC_STORAGE_FORMAT_H_
