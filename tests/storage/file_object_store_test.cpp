#include <atomic>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include <memascend/object_store.h>
#include <memascend/tensor_store.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::FaultyEngine;
using ::memascend::testing::FlipByte;
using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<std::byte> Read(ObjectStore& s, const std::string& name) {
  auto info = s.Stat(name);
  EXPECT_OK(info.status());
  if (!info.ok()) return {};
  std::vector<std::byte> out(info->size);
  auto n = s.Get(name, out);
  EXPECT_OK(n.status());
  return out;
}

std::unique_ptr<FileObjectStore> OpenOk(const std::string& dir, FileObjectStoreOptions o = {}) {
  auto s = FileObjectStore::Open(dir, o);
  EXPECT_OK(s.status());
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(FileObjectStore, SyncOnlyCommitsTheNamedStagedObjectsAndLeavesTheOthersStaged) {
  ScratchPath p("fos");
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    ASSERT_OK(s->Put("a", Pattern("a", 1, 5000), Durability::kDurable));
    ASSERT_OK(s->Put("b", Pattern("b", 1, 5000), Durability::kDurable));
    ASSERT_OK(s->PutStaged("a", Pattern("a", 2, 5000)));
    ASSERT_OK(s->PutStaged("b", Pattern("b", 2, 5000)));
    ASSERT_OK(s->SyncOnly(std::vector<std::string>{"a", "not-staged"}));
    EXPECT_EQ(Read(*s, "b"), Pattern("b", 2, 5000));  // seen, not committed
  }
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 2, 5000));
  EXPECT_EQ(Read(*s, "b"), Pattern("b", 1, 5000));
}

// ObjectStore::DropStaged: the committed versions are seen again, a new object staged is
// gone (its file too), and a later Sync commits none of it.
TEST(FileObjectStore, DropStagedForgetsEveryStagedObjectAsACrashWould) {
  ScratchPath p("fos");
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    ASSERT_OK(s->Put("a", Pattern("a", 1, 5000), Durability::kDurable));
    ASSERT_OK(s->PutStaged("a", Pattern("a", 2, 5000)));
    ASSERT_OK(s->PutStaged("a", Pattern("a", 3, 6000)));  // staged again
    ASSERT_OK(s->PutStaged("c", Pattern("c", 1, 5000)));
    ASSERT_OK(s->DropStaged(std::vector<std::string>{"a", "c", "not-staged"}));
    EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 5000));
    EXPECT_EQ(s->Stat("c").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(s->List().size(), 1u);
    ASSERT_OK(s->Sync());
  }
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 5000));
  EXPECT_EQ(s->Stat("c").status().code(), absl::StatusCode::kNotFound);
}

TEST(FileObjectStore, DurableAndSyncedObjectsSurviveReopenScratchAndStagedDoNot) {
  ScratchPath p("fos");
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    // Sizes off the 4 KiB block: the tail goes through the staging window.
    ASSERT_OK(s->Put("a", Pattern("a", 1, 200001), Durability::kDurable, "bf16[100000]"));
    ASSERT_OK(s->Put("scratch", Pattern("scratch", 1, 5000), Durability::kScratch));
    ASSERT_OK(s->PutStaged("b", Pattern("b", 1, 8192), "meta-b"));
    EXPECT_EQ(Read(*s, "b"), Pattern("b", 1, 8192));  // visible before Sync()
    ASSERT_OK(s->Sync());
    ASSERT_OK(s->PutStaged("a", Pattern("a", 2, 3000)));  // staged, never synced
    EXPECT_EQ(Read(*s, "a"), Pattern("a", 2, 3000));
    EXPECT_EQ(Read(*s, "scratch"), Pattern("scratch", 1, 5000));
    EXPECT_EQ(s->List().size(), 3u);
  }
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 200001));
  EXPECT_EQ(s->Stat("a")->metadata, "bf16[100000]");
  EXPECT_EQ(Read(*s, "b"), Pattern("b", 1, 8192));
  EXPECT_EQ(s->Stat("b")->metadata, "meta-b");
  EXPECT_THAT(s->Stat("scratch").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(s->List().size(), 2u);
  // Only the objects' files and the marker are left: no .new, no scratch file.
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(p.path())) {
    ++files;
    EXPECT_TRUE(e.path().extension() == ".obj" || e.path().filename() == ".memascend-objects")
        << e.path();
  }
  EXPECT_EQ(files, 3u);
}

TEST(FileObjectStore, OverwritesShrinkAndGrowAndDelete) {
  ScratchPath p("fos");
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  for (std::size_t size : {100000u, 10u, 300000u, 4096u}) {
    ASSERT_OK(s->Put("t", Pattern("t", size, size), Durability::kScratch));
    EXPECT_EQ(Read(*s, "t"), Pattern("t", size, size));
    ASSERT_OK(s->Put("d", Pattern("d", size, size), Durability::kDurable));
    EXPECT_EQ(Read(*s, "d"), Pattern("d", size, size));
  }
  ASSERT_OK(s->Delete("d"));
  EXPECT_THAT(s->Get("d", {}).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(s->Delete("d"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(std::filesystem::exists(s->PathOf("d")));
}

TEST(FileObjectStore, NamesAreEscapedIntoFileNames) {
  ScratchPath p("fos");
  const std::vector<std::string> names = {"a/b/../c", ".hidden", "x%y",
                                          "ok.new",   "ok.tmp",  "layers.0.mlp.up.params.p0.v1"};
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    for (const auto& n : names) ASSERT_OK(s->Put(n, Pattern(n, 1, 777), Durability::kDurable));
    for (const auto& n : names)
      EXPECT_EQ(std::filesystem::path(s->PathOf(n)).parent_path(), p.path()) << n;
  }
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  for (const auto& n : names) EXPECT_EQ(Read(*s, n), Pattern(n, 1, 777)) << n;
}

TEST(FileObjectStore, BadInputIsRefusedAndLosesNothing) {
  ScratchPath p("fos");
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  ASSERT_OK(s->Put("a", Pattern("a", 1, 1000), Durability::kDurable));
  const auto bytes = Pattern("x", 1, 10);
  EXPECT_THAT(s->Put("", bytes, Durability::kDurable),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(s->Put(std::string(256, 'n'), bytes, Durability::kDurable),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(s->Put(std::string(200, '/'), bytes, Durability::kDurable),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too long")));
  EXPECT_THAT(s->PutStaged("a", bytes, std::string(16 * 1024 + 1, 'm')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("metadata")));
  std::vector<std::byte> small(999);
  EXPECT_THAT(s->Get("a", small).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1000 bytes")));
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 1000));
}

TEST(FileObjectStore, RefusesWhatIsNotOurs) {
  ScratchPath p("fos");
  std::filesystem::create_directory(p.path());
  { std::ofstream(p.path() + "/notes.txt") << "the user's"; }
  EXPECT_THAT(FileObjectStore::Open(p.path(), {}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("notes.txt")));
  std::ifstream in(p.path() + "/notes.txt");
  std::string kept;
  std::getline(in, kept);
  EXPECT_EQ(kept, "the user's");
  EXPECT_FALSE(std::filesystem::exists(p.path() + "/.memascend-objects"));

  ScratchPath file("fos_file");
  { std::ofstream(file.path()) << "x"; }
  EXPECT_THAT(FileObjectStore::Open(file.path(), {}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a directory")));

  ScratchPath missing("fos_missing");
  FileObjectStoreOptions no_create;
  no_create.create = false;
  EXPECT_THAT(FileObjectStore::Open(missing.path(), no_create).status(),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(FileObjectStore, OneProcessAtATime) {
  ScratchPath p("fos");
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  FileObjectStoreOptions quick;
  quick.lock_wait = std::chrono::milliseconds(20);
  EXPECT_THAT(FileObjectStore::Open(p.path(), quick).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("another process")));
}

TEST(FileObjectStore, CorruptionIsDataLossNamingWhat) {
  ScratchPath p("fos");
  std::string path_a;
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    ASSERT_OK(s->Put("a", Pattern("a", 1, 50000), Durability::kDurable));
    ASSERT_OK(s->Put("b", Pattern("b", 1, 50000), Durability::kDurable));
    path_a = s->PathOf("a");
  }
  FlipByte(path_a, 12345);
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    std::vector<std::byte> out(50000);
    EXPECT_THAT(s->Get("a", out).status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'a'")));
    EXPECT_EQ(Read(*s, "b"), Pattern("b", 1, 50000));
  }
  {
    FileObjectStoreOptions trusting;
    trusting.verify_checksums = false;
    auto s = OpenOk(p.path(), trusting);
    ASSERT_NE(s, nullptr);
    std::vector<std::byte> out(50000);
    EXPECT_OK(s->Get("a", out).status());
  }
  // A damaged trailer: the store does not open, names the file, removes nothing.
  FlipByte(path_a, 53248 + 10);  // the trailer's size field (after 13 data blocks)
  EXPECT_THAT(FileObjectStore::Open(p.path(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path_a)));
  EXPECT_TRUE(std::filesystem::exists(path_a));
}

// The committer syncs while the training loop reads: every read succeeds (a staged object
// renamed between a Get's lookup and its open is looked up again; the window is narrow).
TEST(FileObjectStore, ReadsDuringASyncFindEveryObject) {
  ScratchPath p("fos");
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  for (int round = 0; round < 5; ++round) {
    constexpr int kObjects = 60;
    for (int i = 0; i < kObjects; ++i) {
      const std::string n = "t" + std::to_string(i);
      ASSERT_OK(s->PutStaged(n, Pattern(n, round, 4096 + 100)));
    }
    std::atomic<bool> done{false};
    std::thread reader([&] {
      std::vector<std::byte> out(4096 + 100);
      while (!done.load()) {
        for (int i = 0; i < kObjects; ++i) {
          const std::string n = "t" + std::to_string(i);
          ASSERT_OK(s->Get(n, out).status()) << n;
          ASSERT_EQ(out, Pattern(n, round, out.size())) << n;
        }
      }
    });
    ASSERT_OK(s->Sync());
    done = true;
    reader.join();
  }
}

// Note [file store commits]: a commit running on another thread (a state's committer)
// while an object is staged again, or put durably, over one it is committing: the newest
// bytes are what a read finds, every time, and after a last Sync what a reopen finds, with
// no staged or half-written file left. (Before the commit lock, a commit renamed a file
// staged after its flush and left the entry staged without its file: kNotFound, or
// renamed an older staged file over a Put's: kDataLoss.)
TEST(FileObjectStore, StagingAgainWhileASyncRunsKeepsTheNewestBytes) {
  ScratchPath p("fos");
  constexpr int kObjects = 8;
  constexpr std::size_t kBytes = 4096 + 100;
  std::vector<int> last(kObjects, -1);
  {
    auto s = OpenOk(p.path());
    ASSERT_NE(s, nullptr);
    std::atomic<bool> done{false};
    std::thread committer([&] {
      while (!done.load()) ASSERT_OK(s->Sync());
    });
    struct Join {  // a failed assertion below returns with the committer still running
      std::atomic<bool>& done;
      std::thread& t;
      ~Join() {
        done = true;
        if (t.joinable()) t.join();
      }
    } join{done, committer};
    std::vector<std::byte> out(kBytes);
    for (int round = 0; round < 60; ++round) {
      for (int i = 0; i < kObjects; ++i) {
        const std::string n = "g" + std::to_string(i);
        // Every third round a durable Put over what may be staged and being committed.
        absl::Status put = round % 3 == 2
                               ? s->Put(n, Pattern(n, round, kBytes), Durability::kDurable)
                               : s->PutStaged(n, Pattern(n, round, kBytes));
        ASSERT_OK(put) << n << " round " << round;
        last[i] = round;
        ASSERT_OK(s->Get(n, out).status()) << n << " round " << round;
        ASSERT_EQ(out, Pattern(n, round, kBytes)) << n << " round " << round;
      }
    }
    done = true;
    committer.join();
    ASSERT_OK(s->Sync());
  }
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < kObjects; ++i) {
    const std::string n = "g" + std::to_string(i);
    EXPECT_EQ(Read(*s, n), Pattern(n, last[i], kBytes)) << n;
  }
  for (const auto& e : std::filesystem::directory_iterator(p.path())) {
    EXPECT_NE(e.path().extension(), ".new") << e.path();
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  }
  EXPECT_EQ(s->staged_bytes(), 0u);
}

// staged_bytes(): the staged files' data, each rounded up to a block, as a versioned
// training state's staging bound reads it (Note [state in place]).
TEST(FileObjectStore, StagedBytesCountTheStagedFilesUntilTheyAreCommittedOrDropped) {
  ScratchPath p("fos");
  auto s = OpenOk(p.path());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->staged_bytes(), 0u);
  ASSERT_OK(s->PutStaged("a", Pattern("a", 0, 5000)));
  ASSERT_OK(s->PutStaged("b", Pattern("b", 0, 4096)));
  EXPECT_EQ(s->staged_bytes(), 8192u + 4096u);
  ASSERT_OK(s->PutStaged("a", Pattern("a", 1, 100)));  // staged again: replaces its count
  EXPECT_EQ(s->staged_bytes(), 4096u + 4096u);
  ASSERT_OK(s->Put("b", Pattern("b", 1, 10), Durability::kDurable));  // supersedes
  EXPECT_EQ(s->staged_bytes(), 4096u);
  ASSERT_OK(s->Sync());
  EXPECT_EQ(s->staged_bytes(), 0u);
  ASSERT_OK(s->PutStaged("a", Pattern("a", 2, 9000)));
  ASSERT_OK(s->PutStaged("c", Pattern("c", 0, 1)));
  ASSERT_OK(s->SyncOnly(std::vector<std::string>{"c"}));
  EXPECT_EQ(s->staged_bytes(), 12288u);
  const std::vector<std::string> a{"a"};
  ASSERT_OK(s->DropStaged(a));
  EXPECT_EQ(s->staged_bytes(), 0u);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 100));  // the committed one again
  ASSERT_OK(s->PutStaged("d", Pattern("d", 0, 10)));
  ASSERT_OK(s->Delete("d"));
  EXPECT_EQ(s->staged_bytes(), 0u);
}

// Fails the data writes (offset 0 of a file) while armed.
class WriteFaults final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest& a, std::int64_t result) override {
    if (a.op == IoOp::kWrite && a.offset == 0 && fail_writes.load() > 0) {
      --fail_writes;
      return -EIO;
    }
    return result;
  }
  std::atomic<int> fail_writes{0};
};

TEST(FileObjectStore, FailedWritesKeepTheOldObjectOrSayItIsLost) {
  ScratchPath p("fos");
  auto faults = std::make_shared<WriteFaults>();
  ASSERT_OK_AND_ASSIGN(auto engine, FaultyEngine(faults));
  FileObjectStoreOptions o;
  o.engine = engine.get();
  auto s = OpenOk(p.path(), o);
  ASSERT_NE(s, nullptr);

  // A durable object: the failed write leaves the old one, in memory and on disk.
  ASSERT_OK(s->Put("d", Pattern("d", 1, 10000), Durability::kDurable));
  faults->fail_writes = 1;
  EXPECT_THAT(s->Put("d", Pattern("d", 2, 10000), Durability::kDurable),
              StatusIs(absl::ErrnoToStatus(EIO, "").code()));
  EXPECT_EQ(Read(*s, "d"), Pattern("d", 1, 10000));

  // A staged version over a staged version: the earlier one stays staged.
  ASSERT_OK(s->PutStaged("d", Pattern("d", 3, 10000)));
  faults->fail_writes = 1;
  EXPECT_FALSE(s->PutStaged("d", Pattern("d", 4, 10000)).ok());
  EXPECT_EQ(Read(*s, "d"), Pattern("d", 3, 10000));
  ASSERT_OK(s->Sync());

  // A scratch object is written in place: a failure says the object is lost.
  ASSERT_OK(s->Put("s", Pattern("s", 1, 10000), Durability::kScratch));
  faults->fail_writes = 1;
  EXPECT_FALSE(s->Put("s", Pattern("s", 2, 10000), Durability::kScratch).ok());
  std::vector<std::byte> out(10000);
  EXPECT_THAT(s->Get("s", out).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("overwritten in place")));
  ASSERT_OK(s->Put("s", Pattern("s", 3, 10000), Durability::kScratch));  // written again
  EXPECT_EQ(Read(*s, "s"), Pattern("s", 3, 10000));

  s.reset();
  auto again = OpenOk(p.path());
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(Read(*again, "d"), Pattern("d", 3, 10000));
}

// Fails the next flushes of directories or of files while armed (IoEngine::Flush, Note
// [flushes]), and counts them.
class FlushFaults final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest&, std::int64_t result) override { return result; }
  int AdjustFlush(int fd, FlushKind, int result) override {
    struct stat st {};
    const bool dir = ::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode);
    ++(dir ? dir_flushes : file_flushes);
    std::atomic<int>& fail = dir ? fail_dirs : fail_files;
    if (fail.load() > 0) {
      --fail;
      return -EIO;
    }
    return result;
  }
  std::atomic<int> dir_flushes{0};
  std::atomic<int> file_flushes{0};
  std::atomic<int> fail_dirs{0};
  std::atomic<int> fail_files{0};
};

// A staged file whose flush fails is not committed: the Sync says so, the object stays
// staged (a crash, or a reopen, finds the committed version), and the next Sync commits it.
TEST(FileObjectStore, AStagedFileWhoseFlushFailsStaysStagedUntilASyncSucceeds) {
  ScratchPath p("fos");
  auto faults = std::make_shared<FlushFaults>();
  ASSERT_OK_AND_ASSIGN(auto engine, FaultyEngine(faults));
  FileObjectStoreOptions o;
  o.engine = engine.get();
  const auto eio = absl::ErrnoToStatus(EIO, "").code();
  {
    auto s = OpenOk(p.path(), o);
    ASSERT_NE(s, nullptr);
    ASSERT_OK(s->Put("a", Pattern("a", 1, 10000), Durability::kDurable));
    ASSERT_OK(s->PutStaged("a", Pattern("a", 2, 10000)));
    ASSERT_OK(s->PutStaged("b", Pattern("b", 1, 5000)));
    const std::uint64_t staged = s->staged_bytes();
    faults->fail_files = 1;
    EXPECT_THAT(s->Sync(), StatusIs(eio, HasSubstr("fsync(")));
    EXPECT_EQ(s->staged_bytes(), staged);  // nothing renamed
    EXPECT_EQ(Read(*s, "a"), Pattern("a", 2, 10000));
  }
  {
    auto s = OpenOk(p.path(), o);  // as a crash would find it
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 10000));
    EXPECT_FALSE(s->Stat("b").ok());
    ASSERT_OK(s->PutStaged("a", Pattern("a", 3, 10000)));
    ASSERT_OK(s->PutStaged("b", Pattern("b", 3, 5000)));
    faults->fail_files = 1;
    EXPECT_THAT(s->Sync(), StatusIs(eio));
    ASSERT_OK(s->Sync());
    EXPECT_EQ(s->staged_bytes(), 0u);
  }
  auto s = OpenOk(p.path(), o);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 3, 10000));
  EXPECT_EQ(Read(*s, "b"), Pattern("b", 3, 5000));
}

// A failed flush of the directory after a commit's renames, a durable Put's or a Delete's
// is returned (whether the names are on stable storage is not known) and retried by the
// next Sync, even one with nothing staged; once it succeeds, a Sync flushes nothing more.
TEST(FileObjectStore, AFailedDirectoryFlushIsReturnedAndRetriedByTheNextSync) {
  ScratchPath p("fos");
  auto faults = std::make_shared<FlushFaults>();
  ASSERT_OK_AND_ASSIGN(auto engine, FaultyEngine(faults));
  FileObjectStoreOptions o;
  o.engine = engine.get();
  const auto eio = absl::ErrnoToStatus(EIO, "").code();
  {
    auto s = OpenOk(p.path(), o);
    ASSERT_NE(s, nullptr);
    const auto retried = [&] {
      const int before = faults->dir_flushes.load();
      EXPECT_OK(s->Sync());
      EXPECT_EQ(faults->dir_flushes.load(), before + 1) << "the directory's flush, again";
      EXPECT_OK(s->Sync());
      EXPECT_EQ(faults->dir_flushes.load(), before + 1) << "nothing left to flush";
    };
    ASSERT_OK(s->PutStaged("a", Pattern("a", 1, 10000)));
    faults->fail_dirs = 1;
    EXPECT_THAT(s->Sync(), StatusIs(eio, HasSubstr(p.path())));
    EXPECT_EQ(s->staged_bytes(), 0u);  // renamed: the object is the new one
    EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 10000));
    retried();

    faults->fail_dirs = 1;
    EXPECT_THAT(s->Put("b", Pattern("b", 1, 3000), Durability::kDurable), StatusIs(eio));
    EXPECT_EQ(Read(*s, "b"), Pattern("b", 1, 3000));
    retried();

    faults->fail_dirs = 1;
    EXPECT_THAT(s->Delete("b"), StatusIs(eio));
    EXPECT_FALSE(s->Stat("b").ok());
    retried();
  }
  auto s = OpenOk(p.path(), o);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Read(*s, "a"), Pattern("a", 1, 10000));
  EXPECT_FALSE(s->Stat("b").ok());
}

TEST(FileObjectStore, CarriesATensorStoreThroughEvictionsAndReopen) {
  ScratchPath p("fos");
  TensorStoreOptions so;
  so.host_budget_bytes = 4 << 20;  // one of the two tensors at a time
  std::vector<TensorSpec> specs(2);
  for (int i = 0; i < 2; ++i) {
    specs[i].name = "w" + std::to_string(i);
    specs[i].bytes = (3 << 20) + 100;  // f32 elements: a multiple of 4
    specs[i].shape = {static_cast<std::int64_t>(specs[i].bytes / 4)};
    specs[i].dtype = DType::kF32;
  }
  auto want = [](int i) { return Pattern("w", i, (3 << 20) + 100); };
  {
    auto files = OpenOk(p.path());
    ASSERT_NE(files, nullptr);
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(files.get(), so));
    for (int i = 0; i < 2; ++i) {  // the second evicts the first to its file
      ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(specs[i]));
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->AcquireForOverwrite(id));
      std::memcpy(lease.data(), want(i).data(), want(i).size());
    }
    ASSERT_OK_AND_ASSIGN(TensorId first, store->Find("w0"));
    {
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(first));  // read back
      EXPECT_EQ(std::memcmp(lease.data(), want(0).data(), want(0).size()), 0);
    }
    ASSERT_OK(store->Close());
  }
  auto files = OpenOk(p.path());
  ASSERT_NE(files, nullptr);
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(files.get(), so));
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(specs[i]));
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    EXPECT_EQ(std::memcmp(lease.data(), want(i).data(), want(i).size()), 0) << i;
  }
}

}  // namespace
}  // namespace memascend
