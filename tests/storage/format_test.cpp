#include "storage/format.h"

#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "util/crc32c.h"

namespace memascend::storage {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

Superblock Sample() {
  Superblock sb;
  sb.generation = 7;
  for (int i = 0; i < 16; ++i)
    sb.uuid[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i * 17);
  sb.block_size = 4096;
  sb.unit_bytes = 65536;
  sb.capacity = 1ull << 30;
  sb.journal_offset = 8192;
  sb.journal_half_bytes = 1 << 20;
  sb.data_offset = 3 << 20;
  sb.data_units = ((1ull << 30) - (3 << 20)) / 65536;
  sb.active_half = 1;
  sb.epoch = 0x1234567890ull;
  return sb;
}

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(util::Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(util::Crc32c("", 0), 0u);
  std::string big(100000, 'x');
  // Incremental equals one-shot.
  EXPECT_EQ(util::Crc32c(util::Crc32c(big.data(), 33333), big.data() + 33333, big.size() - 33333),
            util::Crc32c(big.data(), big.size()));
}

TEST(Crc32c, TheThreeStreamPathMatchesTheTable) {
  std::mt19937 rng(11);
  std::vector<unsigned char> data(200000);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (std::size_t n : {0u, 1u, 7u, 8u, 24575u, 24576u, 24577u, 49152u, 100001u, 200000u}) {
    for (std::size_t offset : {0u, 3u}) {
      if (offset + n > data.size()) continue;
      EXPECT_EQ(util::Crc32c(data.data() + offset, n),
                util::Crc32cPortable(0, data.data() + offset, n))
          << n << " at " << offset;
    }
  }
  EXPECT_EQ(util::Crc32c(util::Crc32c(data.data(), 50000), data.data() + 50000, 150000),
            util::Crc32cPortable(0, data.data(), 200000));
}

TEST(Superblock, RoundTripsAndDetectsEveryFlippedBit) {
  const Superblock sb = Sample();
  auto block = EncodeSuperblock(sb);
  ASSERT_OK_AND_ASSIGN(Superblock back, DecodeSuperblock(block));
  EXPECT_EQ(back.generation, 7u);
  EXPECT_EQ(back.uuid, sb.uuid);
  EXPECT_EQ(back.data_units, sb.data_units);
  EXPECT_EQ(back.active_half, 1u);
  EXPECT_EQ(back.epoch, sb.epoch);
  for (std::size_t bit = 0; bit < 8 * 104; bit += 7) {  // every field
    auto damaged = block;
    damaged[bit / 8] ^= std::byte(1u << (bit % 8));
    EXPECT_THAT(DecodeSuperblock(damaged), StatusIs(absl::StatusCode::kDataLoss)) << bit;
  }
  auto damaged = block;
  damaged[4000] ^= std::byte{0x10};  // the zero padding is covered too
  EXPECT_THAT(DecodeSuperblock(damaged),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
}

TEST(Superblock, RejectsImpossibleGeometryEvenWithAValidChecksum) {
  Superblock sb = Sample();
  sb.data_offset = 4096;  // overlaps the journal
  EXPECT_THAT(DecodeSuperblock(EncodeSuperblock(sb)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("geometry")));
  sb = Sample();
  sb.data_units = 1ull << 40;  // past the capacity
  EXPECT_THAT(DecodeSuperblock(EncodeSuperblock(sb)), StatusIs(absl::StatusCode::kDataLoss));
  std::array<std::byte, kMetaBlock> zeros{};
  EXPECT_THAT(DecodeSuperblock(zeros), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("magic")));
}

std::vector<JournalRecord> SomeRecords(int n, std::size_t meta = 10) {
  std::vector<JournalRecord> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({RecordType::kPut,
                   "tensor." + std::to_string(i),
                   std::string(meta, 'm'),
                   static_cast<std::uint64_t>(1000 + i),
                   0xabcd0000u + static_cast<std::uint32_t>(i),
                   {{static_cast<std::uint64_t>(i * 10), 3}, {500, 1}}});
  }
  out.push_back({RecordType::kDelete, "tensor.0", "", 0, 0, {}});
  return out;
}

TEST(Records, RoundTrip) {
  const auto records = SomeRecords(5);
  ASSERT_OK_AND_ASSIGN(auto back, DecodeRecords(EncodeRecords(records)));
  EXPECT_EQ(back, records);
  auto bytes = EncodeRecords(records);
  bytes.resize(bytes.size() - 3);
  EXPECT_THAT(DecodeRecords(bytes), StatusIs(absl::StatusCode::kDataLoss));
}

// A journal half holding the given commits back to back.
std::vector<std::byte> Half(std::size_t blocks,
                            const std::vector<std::vector<JournalRecord>>& commits,
                            std::uint64_t epoch, std::vector<std::size_t>* starts = nullptr) {
  std::vector<std::byte> half(blocks * kMetaBlock);
  std::uint64_t seq = 0;
  for (const auto& c : commits) {
    auto bytes = EncodeCommit(c, seq, epoch);
    if (starts) starts->push_back(seq);
    std::memcpy(half.data() + seq * kMetaBlock, bytes.data(), bytes.size());
    seq += bytes.size() / kMetaBlock;
  }
  return half;
}

TEST(Journal, ReplaysCompleteCommitsInOrder) {
  const std::vector<std::vector<JournalRecord>> commits = {SomeRecords(1), SomeRecords(300, 40),
                                                           SomeRecords(2)};
  EXPECT_GT(CommitBlocks(commits[1]), 2u);  // a commit over several blocks
  const auto half = Half(64, commits, 99);
  const Replay r = ReplayJournal(half, 99);
  EXPECT_FALSE(r.corrupt);
  EXPECT_FALSE(r.torn_tail);
  EXPECT_EQ(r.commits, 3u);
  EXPECT_EQ(r.records.size(), commits[0].size() + commits[1].size() + commits[2].size());
  EXPECT_EQ(r.blocks_used,
            CommitBlocks(commits[0]) + CommitBlocks(commits[1]) + CommitBlocks(commits[2]));
  // Another epoch's blocks (an earlier life of this half) are not replayed.
  EXPECT_EQ(ReplayJournal(half, 98).commits, 0u);
}

TEST(Journal, ATornLastCommitIsDiscardedQuietly) {
  const std::vector<std::vector<JournalRecord>> commits = {SomeRecords(1), SomeRecords(300, 40)};
  std::vector<std::size_t> starts;
  auto half = Half(64, commits, 5, &starts);
  // The crash lost the second commit's second block, but its later blocks landed.
  std::memset(half.data() + (starts[1] + 1) * kMetaBlock + 100, 0x77, 50);
  const Replay r = ReplayJournal(half, 5);
  EXPECT_FALSE(r.corrupt) << r.detail;
  EXPECT_TRUE(r.torn_tail);
  EXPECT_EQ(r.commits, 1u);
  EXPECT_EQ(r.blocks_used, starts[1]);
}

TEST(Journal, DamageBeforeALaterCommitIsCorruption) {
  const std::vector<std::vector<JournalRecord>> commits = {SomeRecords(1), SomeRecords(1),
                                                           SomeRecords(1)};
  std::vector<std::size_t> starts;
  auto half = Half(16, commits, 5, &starts);
  half[starts[1] * kMetaBlock + 200] ^= std::byte{1};
  const Replay r = ReplayJournal(half, 5);
  EXPECT_TRUE(r.corrupt);
  EXPECT_EQ(r.commits, 1u);
  EXPECT_THAT(r.detail, HasSubstr("damaged"));
}

TEST(Journal, StaleBlocksOfAnEarlierTornCommitAreIgnored) {
  // A 3-block commit was torn at slot 1; after reopen a 1-block commit took slot 1.
  std::vector<std::vector<JournalRecord>> commits = {SomeRecords(1), SomeRecords(300, 40)};
  auto half = Half(16, commits, 5);
  const auto replacement = EncodeCommit(SomeRecords(2), 1, 5);
  ASSERT_EQ(replacement.size(), kMetaBlock);
  std::memcpy(half.data() + kMetaBlock, replacement.data(), kMetaBlock);
  const Replay r = ReplayJournal(half, 5);
  EXPECT_FALSE(r.corrupt) << r.detail;
  EXPECT_EQ(r.commits, 2u);
  EXPECT_EQ(r.blocks_used, 2u);
}

// Note [journal seals]: what follows the last commit tells a torn tail from damage.
TEST(Journal, ASealEndsTheJournalAndProvesTheCommitBeforeIt) {
  const std::vector<std::vector<JournalRecord>> commits = {SomeRecords(1), SomeRecords(2)};
  std::vector<std::size_t> starts;
  auto half = Half(16, commits, 5, &starts);
  const std::size_t end = starts[1] + CommitBlocks(commits[1]);
  const auto seal = EncodeSeal(end, 5);
  std::memcpy(half.data() + end * kMetaBlock, seal.data(), kMetaBlock);
  Replay r = ReplayJournal(half, 5);
  EXPECT_FALSE(r.corrupt);
  EXPECT_FALSE(r.torn_tail);
  EXPECT_EQ(r.commits, 2u);
  EXPECT_EQ(r.blocks_used, end);
  // The last commit damaged, its seal after it: damage, not a torn tail.
  half[starts[1] * kMetaBlock + 300] ^= std::byte{4};
  r = ReplayJournal(half, 5);
  EXPECT_TRUE(r.corrupt);
  EXPECT_THAT(r.detail, HasSubstr("seal"));
  // A seal of another epoch (a stale one) proves nothing: a torn tail.
  const auto stale = EncodeSeal(end, 4);
  std::memcpy(half.data() + end * kMetaBlock, stale.data(), kMetaBlock);
  r = ReplayJournal(half, 5);
  EXPECT_FALSE(r.corrupt) << r.detail;
  EXPECT_TRUE(r.torn_tail);
}

TEST(Journal, BytesThatAreNoJournalAreDamageButAZeroHeaderIsATornWrite) {
  auto half = Half(16, {SomeRecords(1)}, 5);
  const std::size_t at = 1;  // after the one commit
  for (std::size_t i = 0; i < kMetaBlock; ++i)
    half[at * kMetaBlock + i] = static_cast<std::byte>(i * 37 + 11);
  Replay r = ReplayJournal(half, 5);
  EXPECT_TRUE(r.corrupt);
  EXPECT_THAT(r.detail, HasSubstr("overwritten"));
  std::memset(half.data() + at * kMetaBlock, 0, 64);  // the first sector never landed
  r = ReplayJournal(half, 5);
  EXPECT_FALSE(r.corrupt) << r.detail;
  EXPECT_EQ(r.commits, 1u);
}

}  // namespace
}  // namespace memascend::storage
