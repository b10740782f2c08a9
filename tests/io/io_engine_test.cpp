#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/host_arena.h>
#include <memascend/io_engine.h>
#include <memascend/pinned_pool.h>
#include <memascend/system.h>

#include "io/io_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::AlignedBuffer;
using ::memascend::testing::Fill;
using ::memascend::testing::MakeBuffer;
using ::memascend::testing::StatusIs;
using ::memascend::testing::TempFile;
using ::testing::HasSubstr;

constexpr std::size_t kMiB = 1 << 20;

// What the engine will find: the probe as IoEngine::Create runs it, so a run with
// MEMASCEND_DISABLE_IO_URING=1 (CI's second pass over the I/O tests) skips these.
bool UringWorks() { return ProbeSystem(ProbeOptions::FromEnvironment()).io_uring.available; }

std::unique_ptr<IoEngine> MakeEngine(IoBackendChoice backend, unsigned depth = 16,
                                     std::shared_ptr<FaultInjector> faults = nullptr) {
  IoEngineOptions o;
  o.backend = backend;
  o.queue_depth = depth;
  o.threads = 2;
  o.fault_injector = std::move(faults);
  auto engine = IoEngine::Create(o);
  EXPECT_OK(engine);
  return engine.ok() ? *std::move(engine) : nullptr;
}

class IoEngineTest : public ::testing::TestWithParam<IoBackendChoice> {
 protected:
  void SetUp() override {
    if (GetParam() == IoBackendChoice::kIoUring && !UringWorks()) {
      GTEST_SKIP() << "io_uring unavailable: "
                   << ProbeSystem(ProbeOptions::FromEnvironment()).io_uring.unavailable_reason;
    }
  }
};

TEST_P(IoEngineTest, RoundTripsRandomOffsetsAndSizes) {
  TempFile file(16 * kMiB, /*direct=*/true);
  ASSERT_TRUE(file.ok()) << "O_DIRECT file in " << ::testing::TempDir();
  auto engine = MakeEngine(GetParam());
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  ASSERT_OK_AND_ASSIGN(std::size_t align, engine->Alignment(id));
  EXPECT_GE(align, 512u);

  std::mt19937 rng(7);
  struct Piece {
    std::uint64_t offset;
    std::size_t length;
  };
  std::vector<Piece> pieces;
  std::uint64_t cursor = 0;
  while (true) {  // disjoint pieces of 1..64 blocks at random gaps
    const std::uint64_t gap = (rng() % 8) * 4096;
    const std::size_t length = (1 + rng() % 64) * 4096;
    if (cursor + gap + length > 16 * kMiB) break;
    pieces.push_back({cursor + gap, length});
    cursor += gap + length;
  }
  AlignedBuffer out = MakeBuffer(cursor);
  AlignedBuffer in = MakeBuffer(cursor);
  Fill(out.get(), cursor, 11);
  {
    IoBatch batch;
    for (const Piece& p : pieces) {
      batch.Add(engine->Submit({IoOp::kWrite, id, p.offset, out.get() + p.offset, p.length}));
    }
    EXPECT_EQ(batch.WaitAll(), pieces.size());
    EXPECT_OK(batch.FirstError());
  }
  std::vector<IoRequest> reads;
  for (const Piece& p : pieces)
    reads.push_back({IoOp::kRead, id, p.offset, in.get() + p.offset, p.length});
  std::vector<IoTicket> tickets = engine->SubmitBatch(reads);
  for (std::size_t i = 0; i < tickets.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(std::size_t n, tickets[i].Wait());
    EXPECT_EQ(n, pieces[i].length);
    ASSERT_EQ(std::memcmp(in.get() + pieces[i].offset, out.get() + pieces[i].offset, n), 0) << i;
  }
  const IoEngineStats s = engine->stats();
  EXPECT_EQ(s.completed, 2 * pieces.size());
  EXPECT_EQ(s.failed, 0u);
  EXPECT_EQ(engine->backend(), GetParam() == IoBackendChoice::kIoUring ? IoBackendKind::kIoUring
                               : GetParam() == IoBackendChoice::kSync  ? IoBackendKind::kSync
                                                                      : IoBackendKind::kThreadPool);
}

TEST_P(IoEngineTest, RejectsMisalignedDirectIoUpFront) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(GetParam());
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer buf = MakeBuffer(3 * 4096);
  const IoRequest bad[] = {
      {IoOp::kRead, id, 100, buf.get(), 4096},        // offset
      {IoOp::kRead, id, 0, buf.get(), 1000},          // length
      {IoOp::kWrite, id, 0, buf.get() + 8, 4096},     // buffer
      {IoOp::kRead, id, 0, buf.get(), 0},             // empty
      {IoOp::kRead, id, 0, nullptr, 4096},            // null
      {IoOp::kRead, FileId{99}, 0, buf.get(), 4096},  // unknown file
  };
  for (const IoRequest& r : bad) {
    IoTicket t = engine->Submit(r);
    EXPECT_TRUE(t.Poll());  // completed without any I/O
    EXPECT_THAT(t.Wait(), StatusIs(absl::StatusCode::kInvalidArgument))
        << r.offset << " " << r.length;
  }
  EXPECT_THAT(engine->Submit({IoOp::kRead, id, 100, buf.get(), 4096}).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
}

TEST_P(IoEngineTest, BufferedFilesTakeAnySize) {
  TempFile file(0, /*direct=*/false);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(GetParam());
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  EXPECT_EQ(*engine->Alignment(id), 1u);
  char text[] = "odd sizes at odd offsets";
  ASSERT_OK(engine->Submit({IoOp::kWrite, id, 3, reinterpret_cast<std::byte*>(text), sizeof(text)})
                .Wait());
  char back[sizeof(text)] = {};
  ASSERT_OK(engine->Submit({IoOp::kRead, id, 3, reinterpret_cast<std::byte*>(back), sizeof(back)})
                .Wait());
  EXPECT_STREQ(back, text);
  // Past the end of the file: a read cannot be completed.
  EXPECT_THAT(
      engine->Submit({IoOp::kRead, id, 10, reinterpret_cast<std::byte*>(back), sizeof(back)})
          .Wait(),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("end of file")));
}

// Fails, shortens or delays chosen requests, by offset.
class ScriptedFaults final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest& attempt, std::int64_t result) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = script_.find(attempt.offset);
    if (it == script_.end()) return result;
    Fault& f = it->second;
    if (f.times == 0) return result;
    --f.times;
    if (f.short_by > 0) return result > 0 ? result - static_cast<std::int64_t>(f.short_by) : result;
    return -f.errnum;
  }
  void Fail(std::uint64_t offset, int errnum, int times = 1) {
    script_[offset] = {errnum, 0, times};
  }
  void Shorten(std::uint64_t offset, std::size_t by, int times = 1) {
    script_[offset] = {0, by, times};
  }

 private:
  struct Fault {
    int errnum;
    std::size_t short_by;
    int times;
  };
  std::mutex mu_;
  std::map<std::uint64_t, Fault> script_;
};

TEST_P(IoEngineTest, FaultsSurfaceOnTheirOwnTicketsAndNothingElseIsLost) {
  TempFile file(4 * kMiB, true);
  ASSERT_TRUE(file.ok());
  auto faults = std::make_shared<ScriptedFaults>();
  auto engine = MakeEngine(GetParam(), 8, faults);
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  constexpr std::size_t kBlock = 64 * 1024;
  constexpr int kCount = 16;
  AlignedBuffer out = MakeBuffer(kBlock * kCount);
  AlignedBuffer in = MakeBuffer(kBlock * kCount);
  Fill(out.get(), kBlock * kCount, 3);
  faults->Fail(2 * kBlock, EIO);
  faults->Fail(5 * kBlock, ENOSPC);
  faults->Shorten(7 * kBlock, 4096 * 3);  // completes by resubmission
  faults->Fail(9 * kBlock, EAGAIN, 3);    // retried
  faults->Fail(11 * kBlock, EINTR, 2);    // retried
  std::vector<IoTicket> writes;
  for (int i = 0; i < kCount; ++i) {
    writes.push_back(
        engine->Submit({IoOp::kWrite, id, i * kBlock, out.get() + i * kBlock, kBlock}));
  }
  for (int i = 0; i < kCount; ++i) {
    absl::StatusOr<std::size_t> r = writes[static_cast<std::size_t>(i)].Wait();
    if (i == 2) {
      EXPECT_THAT(r,
                  StatusIs(absl::ErrnoToStatus(EIO, "").code(), HasSubstr("Input/output error")));
      EXPECT_THAT(r, StatusIs(absl::ErrnoToStatus(EIO, "").code(), HasSubstr("offset 131072")));
    } else if (i == 5) {
      EXPECT_THAT(r, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("No space")));
    } else {
      ASSERT_OK(r) << i;
      EXPECT_EQ(*r, kBlock);
    }
  }
  // Everything but the two failed blocks reads back intact.
  for (int i = 0; i < kCount; ++i) {
    if (i == 2 || i == 5) continue;
    ASSERT_OK(engine->Submit({IoOp::kRead, id, i * kBlock, in.get() + i * kBlock, kBlock}).Wait());
    EXPECT_EQ(std::memcmp(in.get() + i * kBlock, out.get() + i * kBlock, kBlock), 0) << i;
  }
  const IoEngineStats s = engine->stats();
  EXPECT_EQ(s.failed, 2u);
  EXPECT_GE(s.resubmitted_short, 1u);
  EXPECT_EQ(s.retried, 5u);
}

// Note [flushes]: a flush of any descriptor, its kind and result seen by the injector,
// an error naming the call and what was flushed; a bad descriptor is the kernel's EBADF.
class FlushScript final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest&, std::int64_t result) override { return result; }
  int AdjustFlush(int, FlushKind kind, int result) override {
    kinds.push_back(kind);
    results.push_back(result);
    return fail_with != 0 ? -std::exchange(fail_with, 0) : result;
  }
  std::vector<FlushKind> kinds;
  std::vector<int> results;
  int fail_with = 0;
};

TEST_P(IoEngineTest, FlushesPassTheInjectorAndNameWhatFailed) {
  TempFile file(kMiB, false);
  ASSERT_TRUE(file.ok());
  auto faults = std::make_shared<FlushScript>();
  auto engine = MakeEngine(GetParam(), 8, faults);
  EXPECT_OK(engine->Flush(file.fd(), FlushKind::kData, "the file"));
  faults->fail_with = ENOSPC;
  EXPECT_THAT(engine->Flush(file.fd(), FlushKind::kAll, "the file"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("fsync(the file)")));
  EXPECT_OK(engine->Flush(file.fd(), FlushKind::kAll, "the file"));  // once
  EXPECT_THAT(engine->Flush(-1, FlushKind::kData, "nothing"),
              StatusIs(absl::ErrnoToStatus(EBADF, "").code(), HasSubstr("fdatasync(nothing)")));
  EXPECT_EQ(faults->kinds, (std::vector<FlushKind>{FlushKind::kData, FlushKind::kAll,
                                                   FlushKind::kAll, FlushKind::kData}));
  EXPECT_EQ(faults->results, (std::vector<int>{0, 0, 0, -EBADF}));
}

TEST_P(IoEngineTest, EndlessEagainBecomesUnavailable) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto faults = std::make_shared<ScriptedFaults>();
  faults->Fail(0, EAGAIN, 1000);
  auto engine = MakeEngine(GetParam(), 8, faults);
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer buf = MakeBuffer(4096);
  EXPECT_THAT(engine->Submit({IoOp::kRead, id, 0, buf.get(), 4096}).Wait(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("retries")));
}

TEST_P(IoEngineTest, CallbacksReportEachResult) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(GetParam());
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer buf = MakeBuffer(8192);
  std::atomic<int> ok{0}, bad{0};
  std::atomic<std::size_t> bytes{0};
  const IoCallback count = [&](const absl::Status& s, std::size_t n) {
    (s.ok() ? ok : bad)++;
    bytes += n;
  };
  IoTicket a = engine->Submit({IoOp::kWrite, id, 0, buf.get(), 8192}, count);
  IoTicket b = engine->Submit({IoOp::kWrite, id, 1, buf.get(), 8192}, count);  // misaligned
  ASSERT_OK(a.Wait());
  EXPECT_FALSE(b.Wait().ok());
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(bad.load(), 1);
  EXPECT_EQ(bytes.load(), 8192u);
}

// Holds every completion of the request at offset 0 until opened (blocks the engine's
// completion path, so later requests stay queued).
class Gate final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest& attempt, std::int64_t result) override {
    if (attempt.offset == 0) {
      std::unique_lock<std::mutex> lock(mu_);
      entered_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    return result;
  }
  void WaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

TEST_P(IoEngineTest, CancelsRequestsThatHaveNotStarted) {
  if (GetParam() == IoBackendChoice::kSync) GTEST_SKIP() << "kSync completes inside Submit()";
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto gate = std::make_shared<Gate>();
  IoEngineOptions o;
  o.backend = GetParam();
  o.queue_depth = 1;
  o.threads = 1;
  o.fault_injector = gate;
  ASSERT_OK_AND_ASSIGN(auto engine, IoEngine::Create(o));
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer buf = MakeBuffer(2 * 4096);
  IoTicket first = engine->Submit({IoOp::kRead, id, 0, buf.get(), 4096});
  gate->WaitEntered();  // the engine is busy with `first`
  IoTicket second = engine->Submit({IoOp::kRead, id, 4096, buf.get() + 4096, 4096});
  EXPECT_THAT(first.WaitFor(std::chrono::milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(second.Poll());
  ASSERT_OK(second.Cancel());
  EXPECT_THAT(second.Wait(), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(first.Cancel(), StatusIs(absl::StatusCode::kFailedPrecondition));
  gate->Open();
  EXPECT_OK(first.Wait());
  EXPECT_THAT(first.Cancel(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_P(IoEngineTest, BatchWaitsForAMinimumCount) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(GetParam());
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer buf = MakeBuffer(16 * 4096);
  IoBatch batch;
  for (int i = 0; i < 16; ++i) {
    batch.Add(engine->Submit({IoOp::kRead, id, i * 4096ull, buf.get() + i * 4096, 4096}));
  }
  EXPECT_GE(batch.Wait(4), 4u);
  EXPECT_EQ(batch.Wait(100), 16u);  // clamped to the batch's size
  EXPECT_OK(batch.FirstError());
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest,
                         ::testing::Values(IoBackendChoice::kIoUring, IoBackendChoice::kThreadPool,
                                           IoBackendChoice::kSync),
                         [](const auto& param_info) {
                           switch (param_info.param) {
                             case IoBackendChoice::kIoUring:
                               return std::string("IoUring");
                             case IoBackendChoice::kThreadPool:
                               return std::string("ThreadPool");
                             case IoBackendChoice::kSync:
                               return std::string("Sync");
                             default:
                               return std::string("Auto");
                           }
                         });

TEST(IoEngine, FallsBackToThreadsWithANotice) {
  setenv("MEMASCEND_DISABLE_IO_URING", "1", 1);
  std::string notice;
  IoEngineOptions o;
  o.notice = [&](std::string_view n) { notice = std::string(n); };
  auto engine = IoEngine::Create(o);
  IoEngineOptions strict;
  strict.backend = IoBackendChoice::kIoUring;
  auto refused = IoEngine::Create(strict);
  unsetenv("MEMASCEND_DISABLE_IO_URING");
  ASSERT_OK(engine);
  EXPECT_EQ((*engine)->backend(), IoBackendKind::kThreadPool);
  EXPECT_THAT(notice, HasSubstr("io_uring unavailable"));
  EXPECT_THAT(notice, HasSubstr("MEMASCEND_DISABLE_IO_URING"));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("io_uring")));
}

TEST(IoEngine, AutoPicksIoUringWhereItWorks) {
  if (!UringWorks()) GTEST_SKIP() << "io_uring unavailable here";
  auto engine = MakeEngine(IoBackendChoice::kAuto);
  EXPECT_EQ(engine->backend(), IoBackendKind::kIoUring);
}

TEST(IoEngine, RejectsBadOptions) {
  IoEngineOptions o;
  o.queue_depth = 0;
  EXPECT_THAT(IoEngine::Create(o), StatusIs(absl::StatusCode::kInvalidArgument));
  o.queue_depth = 8;
  o.threads = 0;
  EXPECT_THAT(IoEngine::Create(o), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(IoEngine, FixedBuffersAreUsedInsideRegisteredRanges) {
  if (!UringWorks()) GTEST_SKIP() << "io_uring unavailable here";
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(IoBackendChoice::kIoUring);
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  AlignedBuffer registered = MakeBuffer(256 * 1024);
  AlignedBuffer plain = MakeBuffer(256 * 1024);
  const std::span<std::byte> ranges[] = {{registered.get(), 256 * 1024}};
  ASSERT_OK(engine->RegisterBuffers(ranges));
  Fill(registered.get(), 256 * 1024, 5);
  ASSERT_OK(engine->Submit({IoOp::kWrite, id, 0, registered.get(), 256 * 1024}).Wait());
  ASSERT_OK(engine->Submit({IoOp::kRead, id, 0, plain.get(), 256 * 1024}).Wait());
  EXPECT_EQ(std::memcmp(plain.get(), registered.get(), 256 * 1024), 0);
  ASSERT_OK(engine->Submit({IoOp::kRead, id, 4096, registered.get() + 8192, 8192}).Wait());
  EXPECT_EQ(engine->stats().fixed_buffer_ops, 2u);
  EXPECT_OK(engine->RegisterBuffers({}));
}

TEST(IoEngine, PinnedPoolBlocksUseTheArenasRegionsAsFixedBuffers) {
  if (!UringWorks()) GTEST_SKIP() << "io_uring unavailable here";
  TempFile file(4 * kMiB, true);
  ASSERT_TRUE(file.ok());
  HostArenaOptions a;
  a.backing = ArenaBacking::kMlock;
  a.budget_bytes = 8 * kMiB;
  a.chunk_bytes = 4 * kMiB;
  ASSERT_OK_AND_ASSIGN(auto arena, HostArena::Create(a));
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(arena.get(), PinnedPoolOptions{}));
  ASSERT_OK_AND_ASSIGN(PinnedBlock block, pool->Allocate(kMiB));
  auto engine = MakeEngine(IoBackendChoice::kIoUring);
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  ASSERT_OK(engine->RegisterBuffers(arena->Regions()));
  Fill(block.data(), kMiB, 21);
  ASSERT_OK(engine->Submit({IoOp::kWrite, id, 0, block.data(), kMiB}).Wait());
  AlignedBuffer check = MakeBuffer(kMiB);
  ASSERT_OK(engine->Submit({IoOp::kRead, id, 0, check.get(), kMiB}).Wait());
  EXPECT_EQ(std::memcmp(check.get(), block.data(), kMiB), 0);
  EXPECT_EQ(engine->stats().fixed_buffer_ops, 1u);
}

TEST(IoEngine, SqpollRoundTrip) {
  if (!UringWorks()) GTEST_SKIP() << "io_uring unavailable here";
  IoEngineOptions o;
  o.backend = IoBackendChoice::kIoUring;
  o.sqpoll = true;
  auto engine = IoEngine::Create(o);
  if (!engine.ok()) GTEST_SKIP() << "SQPOLL refused here: " << engine.status();
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  ASSERT_OK_AND_ASSIGN(FileId id, (*engine)->RegisterFile(file.fd()));
  AlignedBuffer out = MakeBuffer(64 * 1024), in = MakeBuffer(64 * 1024);
  Fill(out.get(), 64 * 1024, 4);
  ASSERT_OK((*engine)->Submit({IoOp::kWrite, id, 0, out.get(), 64 * 1024}).Wait());
  ASSERT_OK((*engine)->Submit({IoOp::kRead, id, 0, in.get(), 64 * 1024}).Wait());
  EXPECT_EQ(std::memcmp(in.get(), out.get(), 64 * 1024), 0);
}

TEST(IoEngine, UnregisteredFilesAreRefused) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  auto engine = MakeEngine(IoBackendChoice::kThreadPool);
  ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
  ASSERT_OK(engine->UnregisterFile(id));
  EXPECT_THAT(engine->UnregisterFile(id), StatusIs(absl::StatusCode::kInvalidArgument));
  AlignedBuffer buf = MakeBuffer(4096);
  EXPECT_THAT(engine->Submit({IoOp::kRead, id, 0, buf.get(), 4096}).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not registered")));
  EXPECT_THAT(engine->RegisterFile(-1), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(IoEngine, DroppedTicketsAndTheEngineWaitForTheirRequests) {
  TempFile file(kMiB, true);
  ASSERT_TRUE(file.ok());
  AlignedBuffer buf = MakeBuffer(kMiB);
  for (IoBackendChoice b : {IoBackendChoice::kThreadPool, IoBackendChoice::kIoUring}) {
    if (b == IoBackendChoice::kIoUring && !UringWorks()) continue;
    auto engine = MakeEngine(b);
    ASSERT_OK_AND_ASSIGN(FileId id, engine->RegisterFile(file.fd()));
    { IoTicket dropped = engine->Submit({IoOp::kWrite, id, 0, buf.get(), kMiB}); }
    EXPECT_EQ(engine->stats().completed, 1u);
    for (int i = 0; i < 32; ++i) {
      engine->Submit({IoOp::kRead, id, 0, buf.get(), 4096}).Detach();
    }
    engine.reset();  // waits for the detached requests
  }
}

}  // namespace
}  // namespace memascend
