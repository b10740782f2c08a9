#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memascend/block_target.h>
#include <memascend/volume.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

// Writes `n` zero bytes at `offset` of a closed volume's file.
void ZeroBytes(const std::string& path, std::uint64_t offset, std::size_t n) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const std::vector<char> zeros(n, 0);
  ASSERT_EQ(::pwrite(fd, zeros.data(), n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::fsync(fd);
  ::close(fd);
}

using ::memascend::testing::FaultyEngine;
using ::memascend::testing::FlipByte;
using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kMiB = 1 << 20;

std::unique_ptr<Volume> FormatAndOpen(const std::string& path, std::uint64_t size = 64 * kMiB,
                                      std::uint64_t journal = 0, VolumeOpenOptions open = {}) {
  VolumeFormatOptions f;
  f.size = size;
  f.journal_bytes = journal;
  EXPECT_OK(Volume::Format(path, f));
  auto v = Volume::Open(path, open);
  EXPECT_OK(v);
  return v.ok() ? *std::move(v) : nullptr;
}

void ExpectContent(Volume& v, const std::string& name, std::uint64_t version, std::size_t size) {
  std::vector<std::byte> out(size + 1);
  ASSERT_OK_AND_ASSIGN(std::size_t n, v.Get(name, out));
  ASSERT_EQ(n, size) << name;
  out.resize(size);
  EXPECT_TRUE(out == Pattern(name, version, size)) << name << " v" << version;
}

TEST(Volume, RoundTripsManySizesAndReopens) {
  ScratchPath p("vol");
  const std::vector<std::size_t> sizes = {0,     1,     4095,  4096,     4097,
                                          65535, 65536, 65537, kMiB + 3, 5 * kMiB};
  {
    auto v = FormatAndOpen(p.path());
    for (std::size_t s : sizes) {
      const std::string name = "t" + std::to_string(s);
      // An unaligned source buffer: the volume stages what it cannot write directly.
      std::vector<std::byte> src(s + 1);
      auto pat = Pattern(name, 1, s);
      std::copy(pat.begin(), pat.end(), src.begin() + 1);
      ASSERT_OK(v->Put(name, std::span(src).subspan(1, s), Durability::kDurable,
                       "bf16[" + std::to_string(s) + "]"));
      ExpectContent(*v, name, 1, s);
    }
    ASSERT_OK_AND_ASSIGN(ObjectInfo info, v->Stat("t65537"));
    EXPECT_EQ(info.size, 65537u);
    EXPECT_EQ(info.metadata, "bf16[65537]");
    EXPECT_EQ(info.durability, Durability::kDurable);
    EXPECT_EQ(info.extents.size(), 1u);
    EXPECT_EQ(info.extents[0].bytes, 2 * 65536u);
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  EXPECT_EQ(v->List().size(), sizes.size());
  for (std::size_t s : sizes) ExpectContent(*v, "t" + std::to_string(s), 1, s);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  EXPECT_EQ(r.objects, sizes.size());
  EXPECT_EQ(r.used_bytes, v->stats().used_bytes);
}

TEST(Volume, OverwritesReplaceAndFreeTheOldExtents) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path());
  const std::uint64_t free0 = v->stats().free_bytes;
  ASSERT_OK(v->Put("w", Pattern("w", 1, kMiB), Durability::kDurable));
  ASSERT_OK(v->Put("w", Pattern("w", 2, 2 * kMiB), Durability::kDurable));  // the same name again
  EXPECT_EQ(v->stats().free_bytes, free0 - 2 * kMiB);
  ExpectContent(*v, "w", 2, 2 * kMiB);
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "w", 2, 2 * kMiB);
  EXPECT_EQ(v->stats().free_bytes, free0 - 2 * kMiB);
  ASSERT_OK(v->Delete("w"));
  EXPECT_THAT(v->Delete("w"), StatusIs(absl::StatusCode::kNotFound));
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  EXPECT_THAT(v->Stat("w"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(v->stats().free_bytes, free0);
}

TEST(Volume, StagedPutsAreSeenAtOnceAndCommittedBySync) {
  ScratchPath p("vol");
  const std::size_t size = 100'000;
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, size), Durability::kDurable));
    ASSERT_OK(v->PutStaged("a", Pattern("a", 2, size), "meta2"));
    ASSERT_OK(v->PutStaged("b", Pattern("b", 1, size)));
    ExpectContent(*v, "a", 2, size);  // this process sees the staged versions
    ExpectContent(*v, "b", 1, size);
    ASSERT_OK_AND_ASSIGN(ObjectInfo info, v->Stat("a"));
    EXPECT_EQ(info.metadata, "meta2");
    EXPECT_EQ(v->List().size(), 2u);
    const std::uint64_t commits = v->stats().commits;
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
    // Closed without Sync: as if the process had crashed.
    EXPECT_EQ(v->stats().commits, commits);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
    ExpectContent(*v, "a", 1, size);  // the committed version
    EXPECT_THAT(v->Stat("b"), StatusIs(absl::StatusCode::kNotFound));
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean);
    // Replaced twice before the Sync: only the last is kept, nothing leaks.
    for (std::uint64_t version = 3; version <= 5; ++version)
      ASSERT_OK(v->PutStaged("a", Pattern("a", version, size)));
    ASSERT_OK(v->PutStaged("c", Pattern("c", 1, size)));
    ASSERT_OK(v->PutStaged("d", Pattern("d", 1, size)));
    ASSERT_OK(v->Delete("d"));  // only staged: gone without a commit
    const std::uint64_t before = v->stats().commits;
    ASSERT_OK(v->Sync());
    EXPECT_EQ(v->stats().commits, before + 1);  // one commit for all of them
    ASSERT_OK(v->Sync());                       // nothing staged: nothing to do
    EXPECT_EQ(v->stats().commits, before + 1);
    ASSERT_OK(v->PutStaged("c", Pattern("c", 2, size)));
    ASSERT_OK(v->Put("c", Pattern("c", 3, size), Durability::kDurable));  // supersedes it
    ASSERT_OK(v->Sync());
    ASSERT_OK_AND_ASSIGN(r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "a", 5, size);
  ExpectContent(*v, "c", 3, size);
  EXPECT_THAT(v->Stat("d"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(v->List().size(), 2u);
  const VolumeStats st = v->stats();
  EXPECT_EQ(st.used_bytes, 2 * 2 * 65536u);  // two objects of two units each
}

// ObjectStore::DropStaged forgets every staged object as a crash would: the committed
// versions are seen again, a new object staged is gone, its extents are free, and a later
// Sync commits none of it.
TEST(Volume, DropStagedForgetsEveryStagedObjectAsACrashWould) {
  ScratchPath p("vol");
  const std::size_t size = 100'000;
  auto v = FormatAndOpen(p.path());
  ASSERT_OK(v->Put("a", Pattern("a", 1, size), Durability::kDurable));
  const std::uint64_t used = v->stats().used_bytes;
  ASSERT_OK(v->PutStaged("a", Pattern("a", 2, size)));
  ASSERT_OK(v->PutStaged("c", Pattern("c", 1, size)));
  ASSERT_GT(v->staged_bytes(), 0u);
  ASSERT_OK(v->DropStaged(std::vector<std::string>{"a", "c", "not-staged"}));
  EXPECT_EQ(v->staged_bytes(), 0u);
  EXPECT_EQ(v->stats().used_bytes, used);
  ExpectContent(*v, "a", 1, size);
  EXPECT_EQ(v->Stat("c").status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK(v->Sync());
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "a", 1, size);
  EXPECT_EQ(v->Stat("c").status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
}

// Note [selective commit]: SyncOnly commits the named staged objects in one commit and
// leaves the others staged (lost by a crash, committed by a later Sync); a name that is
// not staged is passed over; what it committed frees the versions it replaced.
TEST(Volume, SyncOnlyCommitsTheNamedStagedObjectsAndLeavesTheOthersStaged) {
  ScratchPath p("vol");
  const std::size_t size = 100'000;
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, size), Durability::kDurable));
    ASSERT_OK(v->Put("b", Pattern("b", 1, size), Durability::kDurable));
    ASSERT_OK(v->PutStaged("a", Pattern("a", 2, size)));
    ASSERT_OK(v->PutStaged("b", Pattern("b", 2, size)));
    ASSERT_OK(v->PutStaged("c", Pattern("c", 1, size)));
    const std::uint64_t staged = v->staged_bytes();
    const std::uint64_t commits = v->stats().commits;
    const std::vector<std::string> names = {"a", "c", "not-staged"};
    ASSERT_OK(v->SyncOnly(names));
    EXPECT_EQ(v->stats().commits, commits + 1);
    EXPECT_LT(v->staged_bytes(), staged);
    EXPECT_GT(v->staged_bytes(), 0u);                       // b's
    ExpectContent(*v, "b", 2, size);                        // still seen by this process
    ASSERT_OK(v->SyncOnly(std::vector<std::string>{"a"}));  // nothing of it staged: no commit
    EXPECT_EQ(v->stats().commits, commits + 1);
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  }  // closed without a Sync: as a crash
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
    ExpectContent(*v, "a", 2, size);
    ExpectContent(*v, "c", 1, size);
    ExpectContent(*v, "b", 1, size);  // its staged version was not committed
    ASSERT_OK(v->PutStaged("b", Pattern("b", 3, size)));
    ASSERT_OK(v->Sync());
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "b", 3, size);
  EXPECT_EQ(v->stats().used_bytes, 3 * 2 * 65536u);  // nothing leaked: three objects
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean);
}

TEST(Volume, ScratchObjectsLiveForOneOpen) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path());
  const std::uint64_t free0 = v->stats().free_bytes;
  ASSERT_OK(v->Put("durable", Pattern("durable", 1, 100000), Durability::kDurable));
  ASSERT_OK(v->Put("swap", Pattern("swap", 1, 300000), Durability::kScratch));
  ASSERT_OK(v->Put("was-durable", Pattern("was-durable", 1, 1000), Durability::kDurable));
  ASSERT_OK(v->Put("was-durable", Pattern("was-durable", 2, 2000), Durability::kScratch));
  ExpectContent(*v, "swap", 1, 300000);
  ExpectContent(*v, "was-durable", 2, 2000);
  EXPECT_EQ(v->stats().durable_objects, 1u);
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  EXPECT_THAT(v->Stat("swap"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(v->Stat("was-durable"), StatusIs(absl::StatusCode::kNotFound));  // not resurrected
  ExpectContent(*v, "durable", 1, 100000);
  EXPECT_EQ(v->stats().free_bytes, free0 - 2 * 65536);  // only the durable object holds space
}

TEST(Volume, AFullVolumeFailsCleanly) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path(), 16 * kMiB);
  int stored = 0;
  absl::Status s;
  for (; stored < 100; ++stored) {
    s = v->Put("obj" + std::to_string(stored), Pattern("obj" + std::to_string(stored), 1, kMiB),
               Durability::kDurable);
    if (!s.ok()) break;
  }
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("free")));
  EXPECT_GT(stored, 5);
  for (int i = 0; i < stored; ++i) ExpectContent(*v, "obj" + std::to_string(i), 1, kMiB);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
  EXPECT_TRUE(r.clean);
  // Overwriting with something larger than the free space keeps the old version.
  EXPECT_THAT(v->Put("obj0", Pattern("obj0", 2, 8 * kMiB), Durability::kDurable),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ExpectContent(*v, "obj0", 1, kMiB);
  ASSERT_OK(v->Delete("obj1"));
  EXPECT_OK(v->Put("again", Pattern("again", 1, kMiB), Durability::kDurable));
}

// Note [volume growth]: a full volume grows, keeps what it holds, and the new room is free;
// a grow whose second superblock write was lost opens with the newer, saying so.
TEST(Volume, AFileVolumeGrowsAndKeepsWhatItHolds) {
  ScratchPath p("vol_grow");
  {
    auto v = FormatAndOpen(p.path(), 16 * kMiB);
    int stored = 0;
    while (v->Put("obj" + std::to_string(stored), Pattern("obj" + std::to_string(stored), 1, kMiB),
                  Durability::kDurable)
               .ok())
      ++stored;
    const VolumeStats before = v->stats();
    ASSERT_OK(v->Grow(48 * kMiB));
    const VolumeStats after = v->stats();
    EXPECT_EQ(after.capacity_bytes, 48 * kMiB);
    EXPECT_EQ(after.free_bytes, before.free_bytes + 32 * kMiB);
    for (int i = 0; i < 20; ++i) {  // the new room takes puts
      ASSERT_OK(v->Put("new" + std::to_string(i), Pattern("new" + std::to_string(i), 1, kMiB),
                       Durability::kDurable));
    }
    ASSERT_OK(v->Grow(16 * kMiB));  // smaller: nothing to do
    EXPECT_EQ(v->stats().capacity_bytes, 48 * kMiB);
    for (int i = 0; i < stored; ++i) ExpectContent(*v, "obj" + std::to_string(i), 1, kMiB);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
    EXPECT_EQ(v->stats().capacity_bytes, 48 * kMiB);
    ExpectContent(*v, "new19", 1, kMiB);
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean);
    // Interrupted: only the first of the two superblocks of the next grow lands.
    std::vector<std::byte> head(2 * 4096);
    {
      const int fd = ::open(p.path().c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::pread(fd, head.data(), head.size(), 0), static_cast<ssize_t>(head.size()));
      ::close(fd);
    }
    const int live = static_cast<int>(v->stats().generation % 2);
    ASSERT_OK(v->Grow(64 * kMiB));
    v.reset();
    const int fd = ::open(p.path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, head.data() + live * 4096, 4096, live * 4096), 4096);
    ::close(fd);
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  EXPECT_EQ(v->stats().capacity_bytes, 64 * kMiB);
  ExpectContent(*v, "new19", 1, kMiB);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
  EXPECT_TRUE(r.clean);
  ASSERT_FALSE(r.warnings.empty());
  EXPECT_THAT(r.warnings.front(), HasSubstr("a grow that did not finish"));
  ASSERT_OK_AND_ASSIGN(bool repaired, v->RepairSuperblocks());  // the older rewritten
  EXPECT_TRUE(repaired);
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  ASSERT_OK_AND_ASSIGN(r, v->Fsck(false));
  EXPECT_TRUE(r.clean && r.warnings.empty());
  EXPECT_EQ(v->stats().capacity_bytes, 64 * kMiB);
}

TEST(Volume, NamesMetadataAndBuffersAreChecked) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path());
  const auto data = Pattern("x", 1, 10);
  EXPECT_THAT(v->Put("", data, Durability::kDurable), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(v->Put(std::string(256, 'n'), data, Durability::kDurable),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..255")));
  EXPECT_OK(v->Put(std::string(255, 'n'), data, Durability::kDurable));
  EXPECT_THAT(v->Put("m", data, Durability::kDurable, std::string(16 * 1024 + 1, 'm')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("metadata")));
  std::vector<std::byte> small(5);
  EXPECT_THAT(v->Get(std::string(255, 'n'), small), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(v->Get("missing", small), StatusIs(absl::StatusCode::kNotFound));
}

TEST(Volume, CompactsTheJournalWhenAHalfFills) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path(), 64 * kMiB, /*journal=*/64 * 1024);  // 8 blocks a half
  for (int round = 1; round <= 6; ++round) {
    for (int i = 0; i < 40; ++i) {
      const std::string name = "n" + std::to_string(i);
      ASSERT_OK(v->Put(name, Pattern(name, static_cast<std::uint64_t>(round), 5000),
                       Durability::kDurable));
    }
  }
  EXPECT_GT(v->stats().compactions, 0u);
  const std::uint64_t used = v->stats().used_bytes;
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  for (int i = 0; i < 40; ++i) ExpectContent(*v, "n" + std::to_string(i), 6, 5000);
  EXPECT_EQ(v->stats().used_bytes, used);
  // More objects than a half can describe: the journal is full, nothing else breaks.
  absl::Status s;
  int i = 0;
  for (; i < 5000 && s.ok(); ++i)
    s = v->Put("many" + std::to_string(i), Pattern("m", 1, 10), Durability::kDurable);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("journal full")));
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  // The journal never traps the user: on a full journal a delete still works (the
  // compaction's snapshot leaves the deleted object out), and so does the put it makes
  // room for.
  const int made = i - 1;  // the last one failed
  // Objects replaced again and again fill the live half and compact each time it is full:
  // the snapshot counts each name once.
  for (int k = 0; k < 200; ++k)
    ASSERT_OK(v->Put("many1", Pattern("m", 1, 10), Durability::kDurable)) << k;
  for (int k = 0; k < 20; ++k) ASSERT_OK(v->Delete("many" + std::to_string(k))) << k;
  ASSERT_OK(v->Put("after", Pattern("after", 1, 10), Durability::kDurable));
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  EXPECT_FALSE(v->Stat("many0").ok());
  EXPECT_TRUE(v->Stat("many" + std::to_string(made - 1)).ok());
  ExpectContent(*v, "after", 1, 10);
  ASSERT_OK_AND_ASSIGN(r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
}

TEST(Volume, ConcurrentPutsShareCommits) {
  ScratchPath p("vol");
  auto v = FormatAndOpen(p.path());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const std::string name = "t" + std::to_string(t) + "." + std::to_string(i);
        EXPECT_OK(v->Put(name, Pattern(name, 1, 20000), Durability::kDurable));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(v->stats().commits, 100u);
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  EXPECT_EQ(v->List().size(), 100u);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean);
}

TEST(Volume, RefusesForeignDataUnlessForced) {
  ScratchPath p("vol");
  {
    const int fd = ::open(p.path().c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 8 * kMiB), 0);
    const unsigned char ext_magic[2] = {0x53, 0xef};
    ASSERT_EQ(::pwrite(fd, ext_magic, 2, 1080), 2);
    ::close(fd);
  }
  VolumeFormatOptions f;
  EXPECT_THAT(Volume::Format(p.path(), f),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ext4")));
  f.force = true;
  ASSERT_OK(Volume::Format(p.path(), f));
  f.force = false;  // now it holds a MemAscend volume: reformatting needs force too
  EXPECT_THAT(Volume::Format(p.path(), f),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("memascend")));
}

TEST(BlockTarget, DetectsSignatures) {
  std::vector<std::byte> head(72 * 1024);
  const auto with = [&](std::size_t off, std::string_view magic) {
    std::vector<std::byte> h = head;
    std::memcpy(h.data() + off, magic.data(), magic.size());
    return DetectSignature(h);
  };
  EXPECT_EQ(DetectSignature(head), std::nullopt);
  EXPECT_EQ(with(1080, "\x53\xef"), "ext4");
  EXPECT_EQ(with(0, "XFSB"), "xfs");
  EXPECT_EQ(with(0x10040, "_BHRfS_M"), "btrfs");
  EXPECT_EQ(with(512, "EFI PART"), "gpt");
  EXPECT_EQ(with(510, "\x55\xaa"), "mbr");
  EXPECT_EQ(with(0, "LUKS\xba\xbe"), "luks");
  EXPECT_EQ(with(4086, "SWAPSPACE2"), "swap");
}

TEST(Volume, OpenOrCreateFormatsOnlyANewOrEmptyFile) {
  ScratchPath p("vol_ooc");
  VolumeFormatOptions f;
  EXPECT_THAT(Volume::OpenOrCreate(p.path(), f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size")));
  f.size = 8 * kMiB;
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::OpenOrCreate(p.path(), f));  // created
    const std::vector<std::byte> data(5000, std::byte{7});
    ASSERT_OK(v->Put("kept", data, Durability::kDurable));
  }
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::OpenOrCreate(p.path(), f));  // opened, not formatted
    ASSERT_OK_AND_ASSIGN(ObjectInfo info, v->Stat("kept"));
    EXPECT_EQ(info.size, 5000u);
    // Held by this process: the second open is told so, distinctly.
    VolumeOpenOptions impatient;
    impatient.lock_wait = std::chrono::milliseconds(20);
    EXPECT_THAT(Volume::OpenOrCreate(p.path(), f, impatient),
                StatusIs(absl::StatusCode::kUnavailable));
  }
  // A file of other content is never formatted, force or not.
  ScratchPath other("vol_ooc_other");
  {
    const int fd = ::open(other.path().c_str(), O_RDWR | O_CREAT, 0600);
    const std::string text(3 * 4096, 'x');
    ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    ::close(fd);
  }
  f.force = true;
  EXPECT_THAT(Volume::OpenOrCreate(other.path(), f),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a MemAscend")));
  struct stat st {};
  ASSERT_EQ(::stat(other.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 3 * 4096);
  // An empty file is ours to format.
  ScratchPath empty("vol_ooc_empty");
  ::close(::open(empty.path().c_str(), O_RDWR | O_CREAT, 0600));
  EXPECT_OK(Volume::OpenOrCreate(empty.path(), f).status());
}

// Note [foreign data]: only an empty target, zeros, or (forced) anything is formatted.
TEST(Volume, FormatRefusesDataItDoesNotKnowAndSizesBeyondTheFreeSpace) {
  auto write_file = [](const std::string& path, std::uint64_t size, std::uint64_t at,
                       std::string_view bytes) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at)),
              static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  };
  VolumeFormatOptions f;
  f.size = 8 * kMiB;
  ScratchPath text("fmt_text");
  write_file(text.path(), 5000, 0, "my notes, not a volume\n");
  EXPECT_THAT(Volume::Format(text.path(), f),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("5000 bytes"), HasSubstr("offset 0"), HasSubstr("force"))));
  struct stat st {};
  ASSERT_EQ(::stat(text.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 5000) << "a refused format changed the file";
  // Zeros at the head, data at the end (a sparse data file): still refused.
  ScratchPath tail("fmt_tail");
  write_file(tail.path(), 4 * kMiB, 4 * kMiB - 3, "end");
  EXPECT_THAT(Volume::Format(tail.path(), f), StatusIs(absl::StatusCode::kFailedPrecondition));
  // Zeros throughout: ours to format; and anything with force.
  ScratchPath zeros("fmt_zeros");
  write_file(zeros.path(), 4 * kMiB, 0, "");
  EXPECT_OK(Volume::Format(zeros.path(), f));
  f.force = true;
  EXPECT_OK(Volume::Format(text.path(), f));
  f.force = false;
  // Beyond the free space: refused before anything is created.
  ScratchPath huge("fmt_huge");
  f.size = std::uint64_t{1} << 62;
  EXPECT_THAT(Volume::Format(huge.path(), f),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("free")));
  EXPECT_NE(::stat(huge.path().c_str(), &st), 0) << "a refused format left a file";
}

// Note [foreign data]: any non-zero byte in the sampled ranges is data, whatever the file's
// size: a file shorter than a block (its head rounds down to no block), one whose middle
// sample falls inside the head (72..144 KiB), and a large sparse one. Each size is checked
// with data in its last byte, its middle block and (small ones) its first byte, and as
// zeros throughout (then it is formatted).
TEST(Volume, FormatFindsDataAtEverySize) {
  const auto make = [](const std::string& path, std::uint64_t size, std::uint64_t at) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    if (at < size) {
      ASSERT_EQ(::pwrite(fd, "P", 1, static_cast<off_t>(at)), 1);
    }
    ::close(fd);
  };
  const auto bytes_of = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : ~0ull;
  };
  VolumeFormatOptions f;
  f.size = 8 * kMiB;
  const std::uint64_t sizes[] = {
      1, 4095, 4096, 4097, 100 * 1024, 96 * 1024 + 8, 144 * 1024, 144 * 1024 + 1, 6 * kMiB + 123};
  for (const std::uint64_t size : sizes) {
    for (const std::uint64_t at : {std::uint64_t{0}, size / 2, size - 1}) {
      ScratchPath p("fmt_sizes");
      make(p.path(), size, at);
      EXPECT_THAT(Volume::Format(p.path(), f),
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           AllOf(HasSubstr(fmt::format("offset {}", at)), HasSubstr("--force"))))
          << "a file of " << size << " bytes with data at " << at;
      EXPECT_EQ(bytes_of(p.path()), size) << "a refused format changed the file";
    }
    ScratchPath zeros("fmt_sizes_zeros");
    make(zeros.path(), size, size);  // zeros throughout
    const absl::Status formatted = Volume::Format(zeros.path(), f);
    EXPECT_TRUE(formatted.ok()) << size << " bytes of zeros: " << formatted;
  }
  // The reviewer's case: 100 KiB with data at 96 KiB (the last block, past the head).
  ScratchPath mid("fmt_100k");
  make(mid.path(), 100 * 1024, 96 * 1024);
  EXPECT_THAT(Volume::Format(mid.path(), f), StatusIs(absl::StatusCode::kFailedPrecondition));
  // A large sparse file: data in its middle block, or only in its last byte.
  for (const std::uint64_t at : {std::uint64_t{512} * kMiB, 1024 * kMiB - 1}) {
    ScratchPath sparse("fmt_sparse");
    make(sparse.path(), 1024 * kMiB, at);
    VolumeFormatOptions g;
    EXPECT_THAT(
        Volume::Format(sparse.path(), g),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(fmt::format("offset {}", at))));
  }
  // An empty file is formatted (nothing to lose).
  ScratchPath empty("fmt_empty");
  make(empty.path(), 0, 0);
  EXPECT_OK(Volume::Format(empty.path(), f));
}

// A journal size near 2^64 wrapped 2 * half and the data offset, passed the size check and
// cleared past the target: every size beyond the target is refused, naming --journal, and
// nothing is created or grown.
TEST(Volume, FormatRefusesAJournalBeyondTheTarget) {
  struct stat st {};
  for (const std::uint64_t journal :
       {~std::uint64_t{0}, ~std::uint64_t{0} / 2 + 1, std::uint64_t{1} << 40, 9 * kMiB}) {
    ScratchPath p("fmt_journal");
    VolumeFormatOptions f;
    f.size = 8 * kMiB;
    f.journal_bytes = journal;
    EXPECT_THAT(Volume::Format(p.path(), f),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--journal")))
        << journal;
    EXPECT_NE(::stat(p.path().c_str(), &st), 0) << "a refused format left a file";
    // An existing file of zeros, formatted at its own size: refused against its capacity,
    // and left at its size.
    ScratchPath q("fmt_journal_existing");
    const int fd = ::open(q.path().c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_EQ(::ftruncate(fd, 8 * kMiB), 0);
    ::close(fd);
    f.size = 0;
    EXPECT_THAT(Volume::Format(q.path(), f),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--journal")))
        << journal;
    ASSERT_EQ(::stat(q.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_size, static_cast<off_t>(8 * kMiB));
  }
  ScratchPath small("fmt_journal_small");
  VolumeFormatOptions f;
  f.size = 8 * kMiB;
  f.journal_bytes = 16 * 1024;
  EXPECT_THAT(Volume::Format(small.path(), f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--journal")));
  // A new file without a size: the size is named, not "No such file or directory".
  ScratchPath missing("fmt_no_size");
  EXPECT_THAT(Volume::Format(missing.path(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--size")));
}

TEST(Volume, OpenRefusesWhatItCannotOpen) {
  ScratchPath p("vol");
  {
    const int fd = ::open(p.path().c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_EQ(::ftruncate(fd, 8 * kMiB), 0);
    ::close(fd);
  }
  EXPECT_THAT(Volume::Open(p.path(), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a MemAscend")));
  auto v = FormatAndOpen(p.path(), 8 * kMiB);
  VolumeOpenOptions impatient;
  impatient.lock_wait = std::chrono::milliseconds(50);
  EXPECT_THAT(Volume::Open(p.path(), impatient),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("another process")));
  VolumeFormatOptions tiny;
  ScratchPath t("tiny");
  tiny.size = 64 * 1024;
  EXPECT_THAT(Volume::Format(t.path(), tiny),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too small")));
  tiny.size = 8 * kMiB;
  tiny.unit_bytes = 1000;
  EXPECT_THAT(Volume::Format(t.path(), tiny), StatusIs(absl::StatusCode::kInvalidArgument));
  // tmpfs refuses O_DIRECT before Linux 6.6; where it does, so must Format, saying why.
  const std::string shm_path = "/dev/shm/memascend_test_" + std::to_string(getpid());
  const int probe = ::open(shm_path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  const bool shm_refuses = probe < 0 && errno == EINVAL;
  if (probe >= 0) ::close(probe);
  ::unlink(shm_path.c_str());
  if (shm_refuses) {
    VolumeFormatOptions shm;
    shm.size = 8 * kMiB;
    EXPECT_THAT(Volume::Format(shm_path, shm),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("O_DIRECT")));
    ::unlink(shm_path.c_str());
  }
}

// ---- Corruption ----------------------------------------------------------------------

TEST(VolumeCorruption, ADamagedSuperblockIsReportedAndTheOtherUsed) {
  ScratchPath p("vol");
  FormatAndOpen(p.path()).reset();
  FlipByte(p.path(), 4096 + 20);  // superblock 1, the newest at format
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
  EXPECT_FALSE(r.clean);
  ASSERT_FALSE(r.errors.empty());
  EXPECT_THAT(r.errors[0], HasSubstr("superblock 1"));
  v.reset();
  FlipByte(p.path(), 30);  // and superblock 0
  EXPECT_THAT(Volume::Open(p.path(), {}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("both superblocks")));
}

TEST(VolumeCorruption, ADamagedJournalRecordIsDetected) {
  ScratchPath p("vol");
  {
    auto v = FormatAndOpen(p.path());
    for (int i = 0; i < 3; ++i)
      ASSERT_OK(v->Put("j" + std::to_string(i), Pattern("j", 1, 100), Durability::kDurable));
  }
  FlipByte(p.path(), 8192 + 64);  // inside the first commit's record
  // The refusal names what a CLI user can run, and the API's option.
  EXPECT_THAT(Volume::Open(p.path(), {}),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("journal damaged"), HasSubstr("--allow-data-loss"),
                             HasSubstr("VolumeOpenOptions::allow_data_loss"))));
  VolumeOpenOptions lossy;
  lossy.allow_data_loss = true;
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), lossy));
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
  EXPECT_FALSE(r.clean);
  EXPECT_THAT(r.errors[0], HasSubstr("journal"));
}

TEST(VolumeCorruption, DamagedDataIsDataLossNamingTheObject) {
  ScratchPath p("vol");
  std::uint64_t offset = 0;
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("weights", Pattern("weights", 1, 300000), Durability::kDurable));
    ASSERT_OK(v->Put("other", Pattern("other", 1, 1000), Durability::kDurable));
    offset = v->Stat("weights")->extents[0].offset;
  }
  FlipByte(p.path(), offset + 123456, 0x80);
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  std::vector<std::byte> out(300000);
  EXPECT_THAT(v->Get("weights", out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'weights'")));
  ExpectContent(*v, "other", 1, 1000);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(/*verify_data=*/true));
  EXPECT_FALSE(r.clean);
  EXPECT_THAT(r.errors[0], HasSubstr("'weights'"));
  ASSERT_OK_AND_ASSIGN(FsckReport quick, v->Fsck(false));
  EXPECT_TRUE(quick.clean);  // the structures are fine; only a data check sees it
  v.reset();
  VolumeOpenOptions no_verify;
  no_verify.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), no_verify));
  EXPECT_OK(v->Get("weights", out));
}

// ---- Fault injection -----------------------------------------------------------------

// Fails or tears chosen requests by region: the journal [8192, data) or the data.
class VolumeFaults final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest& a, std::int64_t result) override {
    const bool journal = a.offset >= 8192 && a.offset < journal_end.load();
    if (a.op == IoOp::kWrite && journal && fail_journal_writes.load() > 0) {
      --fail_journal_writes;
      return -journal_errno.load();
    }
    if (a.op == IoOp::kWrite && !journal && a.offset >= journal_end.load() &&
        fail_data_writes.load() > 0) {
      --fail_data_writes;
      return -EIO;
    }
    if (a.op == IoOp::kRead && short_reads.load() && result > 4096) return 4096;
    return result;
  }
  // Lets `pass_flushes` flushes through, then fails `fail_flushes` with EIO.
  int AdjustFlush(int, FlushKind, int result) override {
    ++flushes;
    if (pass_flushes.load() > 0) {
      --pass_flushes;
      return result;
    }
    if (fail_flushes.load() > 0) {
      --fail_flushes;
      return -EIO;
    }
    return result;
  }
  std::atomic<int> flushes{0};
  std::atomic<int> pass_flushes{0};
  std::atomic<int> fail_flushes{0};
  std::atomic<std::uint64_t> journal_end{~0ull};
  std::atomic<int> fail_journal_writes{0};
  std::atomic<int> journal_errno{ENOSPC};
  std::atomic<int> fail_data_writes{0};
  std::atomic<bool> short_reads{false};
};

// A thread-pool engine whose every attempt goes through `faults`, and the options that open
// a volume through it. Format() makes a 64 MiB volume there and aims the journal faults at
// its journal region.
struct FaultyVolume {
  std::shared_ptr<VolumeFaults> faults = std::make_shared<VolumeFaults>();
  std::unique_ptr<IoEngine> engine;
  VolumeOpenOptions open;

  absl::Status Start() {
    MEMASCEND_ASSIGN_OR_RETURN(engine, FaultyEngine(faults));
    open.engine = engine.get();
    return absl::OkStatus();
  }
  std::unique_ptr<Volume> Format(const std::string& path) {
    auto v = FormatAndOpen(path, 64 * kMiB, 0, open);
    if (v != nullptr) faults->journal_end = 8192 + 2 * v->stats().journal_bytes;
    return v;
  }
};

TEST(VolumeFaults, ErrorsSurfaceAndCommittedObjectsSurvive) {
  ScratchPath p("vol");
  FaultyVolume fv;
  ASSERT_OK(fv.Start());
  const std::shared_ptr<VolumeFaults>& faults = fv.faults;
  const VolumeOpenOptions& open = fv.open;
  {
    auto v = fv.Format(p.path());
    ASSERT_NE(v, nullptr);
    ASSERT_OK(v->Put("keep", Pattern("keep", 1, 200000), Durability::kDurable));
    const std::uint64_t free_before = v->stats().free_bytes;

    faults->fail_data_writes = 1;  // EIO while writing the new version's data
    EXPECT_THAT(v->Put("keep", Pattern("keep", 2, 200000), Durability::kDurable),
                StatusIs(absl::ErrnoToStatus(EIO, "").code(), HasSubstr("Input/output error")));
    ExpectContent(*v, "keep", 1, 200000);
    EXPECT_EQ(v->stats().free_bytes, free_before);  // its extents went back

    faults->fail_journal_writes = 1;  // ENOSPC while writing the commit record
    EXPECT_THAT(v->Put("keep", Pattern("keep", 3, 200000), Durability::kDurable),
                StatusIs(absl::StatusCode::kResourceExhausted));
    ExpectContent(*v, "keep", 1, 200000);
    EXPECT_EQ(v->stats().free_bytes, free_before);

    faults->short_reads = true;  // every read returns at most 4 KiB: completed by resubmission
    ExpectContent(*v, "keep", 1, 200000);
    faults->short_reads = false;
    ASSERT_OK(v->Put("later", Pattern("later", 1, 5000),
                     Durability::kDurable));  // the journal slot is reused
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), open));
  ExpectContent(*v, "keep", 1, 200000);
  ExpectContent(*v, "later", 1, 5000);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
}

// A journal write that fails after it landed (the fault is reported, the bytes are on disk)
// must not come back on reopen naming extents that were freed and written since: the
// failed commit is sealed off (Note [journal seals]).
TEST(VolumeFaults, AFailedCommitThatLandedDoesNotComeBack) {
  ScratchPath p("vol");
  FaultyVolume fv;
  ASSERT_OK(fv.Start());
  const std::shared_ptr<VolumeFaults>& faults = fv.faults;
  const VolumeOpenOptions& open = fv.open;
  {
    auto v = fv.Format(p.path());
    ASSERT_NE(v, nullptr);
    ASSERT_OK(v->Put("keep", Pattern("keep", 1, 200000), Durability::kDurable));
    faults->journal_errno = EIO;
    faults->fail_journal_writes = 1;  // the commit of version 2 lands, but is reported failed
    EXPECT_FALSE(v->Put("keep", Pattern("keep", 2, 200000), Durability::kDurable).ok());
    // Its extents are free again, and another object's data goes there; then the process
    // ends with nothing more committed.
    ASSERT_OK(v->PutStaged("other", Pattern("other", 1, 200000)));
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), open));
  ExpectContent(*v, "keep", 1, 200000);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
}

// A failed flush leaves what the device holds unknown: the put says so (kDataLoss), the
// volume writes nothing more, and a reopen finds each object whole, at a version committed
// before (the data's flush failed: the commit record was never written) or, where only the
// record's own flush failed, at either version.
TEST(VolumeFaults, AFailedFlushStopsTheVolumeAndAReopenFindsAWholeVersion) {
  for (const int passed : {0, 1}) {  // the data's flush, or the commit record's
    SCOPED_TRACE(passed == 0 ? "the data's flush failed" : "the record's flush failed");
    ScratchPath p("vol");
    FaultyVolume fv;
    ASSERT_OK(fv.Start());
    {
      auto v = fv.Format(p.path());
      ASSERT_NE(v, nullptr);
      ASSERT_OK(v->Put("keep", Pattern("keep", 1, 200000), Durability::kDurable));
      ASSERT_OK(v->PutStaged("staged", Pattern("staged", 1, 5000)));
      const int before = fv.faults->flushes.load();
      fv.faults->pass_flushes = passed;
      fv.faults->fail_flushes = 1;
      EXPECT_THAT(v->Put("keep", Pattern("keep", 2, 200000), Durability::kDurable),
                  StatusIs(absl::StatusCode::kDataLoss,
                           AllOf(HasSubstr("failed to flush"), HasSubstr("Input/output error"),
                                 HasSubstr("reopen it"))));
      EXPECT_EQ(fv.faults->flushes.load(), before + passed + 1);
      // Nothing more is written, a flush included; what it holds in memory is still read.
      EXPECT_THAT(v->Put("other", Pattern("other", 1, 100), Durability::kDurable),
                  StatusIs(absl::StatusCode::kDataLoss, HasSubstr("failed to flush")));
      EXPECT_THAT(v->PutStaged("other", Pattern("other", 1, 100)),
                  StatusIs(absl::StatusCode::kDataLoss));
      EXPECT_THAT(v->Sync(), StatusIs(absl::StatusCode::kDataLoss));
      EXPECT_EQ(fv.faults->flushes.load(), before + passed + 1);
      ExpectContent(*v, "staged", 1, 5000);
    }
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), fv.open));
    if (passed == 0) {
      ExpectContent(*v, "keep", 1, 200000);
    } else {
      std::vector<std::byte> out(200000);
      ASSERT_OK(v->Get("keep", out).status());
      EXPECT_TRUE(out == Pattern("keep", 1, 200000) || out == Pattern("keep", 2, 200000));
    }
    EXPECT_FALSE(v->Stat("staged").ok());  // never committed
    EXPECT_FALSE(v->Stat("other").ok());
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
    ASSERT_OK(v->Put("after", Pattern("after", 1, 100), Durability::kDurable));  // reopened
  }
}

// Note [journal seals]: damage is never a clean end. A damaged last commit (its seal after
// it) and a journal overwritten with other bytes are kDataLoss on open, naming the block;
// allow_data_loss opens what is intact before it.
TEST(VolumeFaults, ADamagedLastCommitOrAnOverwrittenJournalIsDataLoss) {
  ScratchPath p("vol");
  std::uint64_t journal_used = 0;
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, 10000), Durability::kDurable));
    ASSERT_OK(v->Put("b", Pattern("b", 1, 10000), Durability::kDurable));
    journal_used = v->stats().journal_used_bytes;
  }
  FlipByte(p.path(), 8192 + journal_used - 1000, 0x10);  // inside the last commit (b's)
  EXPECT_THAT(Volume::Open(p.path(), {}),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("journal block 1"), HasSubstr("seal"))));
  VolumeOpenOptions lossy;
  lossy.allow_data_loss = true;
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), lossy));
    ExpectContent(*v, "a", 1, 10000);
    EXPECT_FALSE(v->Stat("b").ok());
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
    EXPECT_FALSE(r.clean);
  }
  // The whole journal overwritten with other bytes: not an empty volume.
  ScratchPath q("vol");
  {
    auto v = FormatAndOpen(q.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, 10000), Durability::kDurable));
  }
  {
    const int fd = ::open(q.path().c_str(), O_RDWR);
    const auto junk = Pattern("junk", 1, 64 * 1024);
    ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), 8192), static_cast<ssize_t>(junk.size()));
    ::fsync(fd);
    ::close(fd);
  }
  EXPECT_THAT(Volume::Open(q.path(), {}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("overwritten")));
}

// A lost superblock copy is reported by fsck and rewritten by RepairSuperblocks; two valid
// copies of different volumes are kDataLoss on open (which is right cannot be told).
TEST(VolumeFaults, ALostSuperblockCopyIsRepairedAndADisagreeingOneRefused) {
  ScratchPath p("vol");
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, 10000), Durability::kDurable));
  }
  for (std::uint64_t off = 4096 + 100; off < 4096 + 200; ++off) FlipByte(p.path(), off, 0x5a);
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));  // the other copy serves
    ExpectContent(*v, "a", 1, 10000);
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(false));
    EXPECT_FALSE(r.clean);
    ASSERT_FALSE(r.errors.empty());
    EXPECT_THAT(r.errors[0], AllOf(HasSubstr("superblock 1"), HasSubstr("--repair")));
    ASSERT_OK_AND_ASSIGN(bool repaired, v->RepairSuperblocks());
    EXPECT_TRUE(repaired);
    ASSERT_OK_AND_ASSIGN(r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
    ASSERT_OK_AND_ASSIGN(repaired, v->RepairSuperblocks());
    EXPECT_FALSE(repaired);  // nothing left to do
  }
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
    ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
    EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
    ExpectContent(*v, "a", 1, 10000);
  }
  // Superblock 1 of another volume: both valid, not of one volume.
  ScratchPath q("vol");
  { auto other = FormatAndOpen(q.path()); }
  {
    std::vector<char> block(4096);
    const int from = ::open(q.path().c_str(), O_RDONLY);
    ASSERT_EQ(::pread(from, block.data(), 4096, 4096), 4096);
    ::close(from);
    const int to = ::open(p.path().c_str(), O_RDWR);
    ASSERT_EQ(::pwrite(to, block.data(), 4096, 4096), 4096);
    ::fsync(to);
    ::close(to);
  }
  EXPECT_THAT(Volume::Open(p.path(), {}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("disagree: uuid")));
  VolumeOpenOptions lossy;
  lossy.allow_data_loss = true;
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), lossy));
  EXPECT_THAT(v->RepairSuperblocks(), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(VolumeFaults, ATornLastJournalBlockLosesOnlyThatCommit) {
  ScratchPath p("vol");
  std::uint64_t journal_used = 0;
  {
    auto v = FormatAndOpen(p.path());
    ASSERT_OK(v->Put("a", Pattern("a", 1, 10000), Durability::kDurable));
    ASSERT_OK(v->Put("b", Pattern("b", 1, 10000), Durability::kDurable));
    ASSERT_OK(v->Put("a", Pattern("a", 2, 10000), Durability::kDurable));
    journal_used = v->stats().journal_used_bytes;
  }
  // The last commit's block half-written: its second half never reached the disk; and so
  // no seal after it (Note [journal seals]: one is written only once the commit is durable).
  for (std::uint64_t off = 8192 + journal_used - 2048; off < 8192 + journal_used; off += 97)
    FlipByte(p.path(), off, 0xff);
  ZeroBytes(p.path(), 8192 + journal_used, 4096);
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "a", 1, 10000);  // the previous version, whole
  ExpectContent(*v, "b", 1, 10000);
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  ASSERT_FALSE(r.warnings.empty());
  EXPECT_THAT(r.warnings[0], HasSubstr("incomplete commit"));
  EXPECT_EQ(r.used_bytes, 2 * 65536u);  // the lost version's extents are free again
  ASSERT_OK(v->Put("c", Pattern("c", 1, 100), Durability::kDurable));  // writes over the torn block
  v.reset();
  ASSERT_OK_AND_ASSIGN(v, Volume::Open(p.path(), {}));
  ExpectContent(*v, "c", 1, 100);
}

}  // namespace
}  // namespace memascend
