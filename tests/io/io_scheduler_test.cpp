#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include <memascend/io_scheduler.h>

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

// Slows every write attempt down, so a write-back takes long enough to overtake.
class SlowWrites final : public FaultInjector {
 public:
  std::int64_t Adjust(const IoRequest& attempt, std::int64_t result) override {
    if (attempt.op == IoOp::kWrite) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return result;
  }
};

struct Rig {
  std::unique_ptr<TempFile> file;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<IoScheduler> scheduler;
  FileId id;
};

Rig Make(IoBackendChoice backend, std::size_t chunk, unsigned depth,
         std::shared_ptr<FaultInjector> faults = nullptr) {
  Rig s;
  s.file = std::make_unique<TempFile>(32 * kMiB, true);
  EXPECT_TRUE(s.file->ok());
  IoEngineOptions o;
  o.backend = backend;
  o.threads = 2;
  o.queue_depth = 16;
  o.fault_injector = std::move(faults);
  s.engine = *IoEngine::Create(o);
  s.id = *s.engine->RegisterFile(s.file->fd());
  s.scheduler = *IoScheduler::Create(s.engine.get(), {chunk, depth});
  return s;
}

TEST(IoScheduler, SplitsLargeRequestsIntoChunksAndRoundTrips) {
  for (IoBackendChoice b :
       {IoBackendChoice::kThreadPool, IoBackendChoice::kSync, IoBackendChoice::kAuto}) {
    Rig s = Make(b, 256 * 1024, 4);
    AlignedBuffer out = MakeBuffer(8 * kMiB + 4096 * 3);
    AlignedBuffer in = MakeBuffer(8 * kMiB + 4096 * 3);
    const std::size_t n = 8 * kMiB + 4096 * 3;  // not a multiple of the chunk
    Fill(out.get(), n, 9);
    ASSERT_OK_AND_ASSIGN(
        std::size_t w,
        s.scheduler->Submit({IoOp::kWrite, s.id, 4096, out.get(), n}, IoPriority::kWriteBack)
            .Wait());
    EXPECT_EQ(w, n);
    ASSERT_OK(
        s.scheduler->Submit({IoOp::kRead, s.id, 4096, in.get(), n}, IoPriority::kDemand).Wait());
    EXPECT_EQ(std::memcmp(in.get(), out.get(), n), 0);
    const IoSchedulerStats st = s.scheduler->stats();
    EXPECT_EQ(st.of(IoPriority::kWriteBack).chunks, 33u);
    EXPECT_EQ(st.of(IoPriority::kWriteBack).bytes, n);
    EXPECT_EQ(st.of(IoPriority::kDemand).requests, 1u);
    EXPECT_EQ(st.of(IoPriority::kDemand).latency.count, 1u);
    EXPECT_GT(st.of(IoPriority::kDemand).latency.Percentile(50), 0);
    EXPECT_EQ(s.engine->stats().completed, 66u);
  }
}

TEST(IoScheduler, ADemandReadOvertakesALongWriteBack) {
  for (IoBackendChoice b : {IoBackendChoice::kThreadPool, IoBackendChoice::kAuto}) {
    Rig s = Make(b, 128 * 1024, 2, std::make_shared<SlowWrites>());
    AlignedBuffer big = MakeBuffer(16 * kMiB);  // 128 chunks, >= 256 ms of slowed writes
    AlignedBuffer small = MakeBuffer(128 * 1024);
    IoTicket write_back =
        s.scheduler->Submit({IoOp::kWrite, s.id, 0, big.get(), 16 * kMiB}, IoPriority::kWriteBack);
    IoTicket prefetch = s.scheduler->Submit({IoOp::kRead, s.id, 16 * kMiB, small.get(), 128 * 1024},
                                            IoPriority::kPrefetch);
    IoTicket demand = s.scheduler->Submit({IoOp::kRead, s.id, 20 * kMiB, small.get(), 128 * 1024},
                                          IoPriority::kDemand);
    ASSERT_OK(demand.Wait());
    EXPECT_FALSE(write_back.Poll()) << "the demand read waited for the whole write-back";
    ASSERT_OK(prefetch.Wait());
    EXPECT_FALSE(write_back.Poll());
    ASSERT_OK(write_back.Wait());
    const IoSchedulerStats st = s.scheduler->stats();
    EXPECT_LT(st.of(IoPriority::kDemand).latency.MeanMicros(),
              st.of(IoPriority::kWriteBack).latency.MeanMicros());
  }
}

TEST(IoScheduler, CancelDropsChunksNotYetDispatched) {
  Rig s = Make(IoBackendChoice::kThreadPool, 64 * 1024, 1, std::make_shared<SlowWrites>());
  AlignedBuffer big = MakeBuffer(8 * kMiB);
  IoTicket t =
      s.scheduler->Submit({IoOp::kWrite, s.id, 0, big.get(), 8 * kMiB}, IoPriority::kWriteBack);
  ASSERT_OK(t.Cancel());
  EXPECT_THAT(t.Wait(), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_LT(s.engine->stats().bytes_written, 8 * kMiB);
  EXPECT_THAT(t.Cancel(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Fails the chunk at one offset.
class FailAt final : public FaultInjector {
 public:
  explicit FailAt(std::uint64_t offset) : offset_(offset) {}
  std::int64_t Adjust(const IoRequest& attempt, std::int64_t result) override {
    return attempt.offset == offset_ ? -EIO : result;
  }

 private:
  std::uint64_t offset_;
};

TEST(IoScheduler, AChunkErrorFailsItsRequestOnly) {
  Rig s = Make(IoBackendChoice::kThreadPool, 64 * 1024, 4, std::make_shared<FailAt>(192 * 1024));
  AlignedBuffer buf = MakeBuffer(kMiB);
  IoTicket bad =
      s.scheduler->Submit({IoOp::kWrite, s.id, 0, buf.get(), 512 * 1024}, IoPriority::kWriteBack);
  IoTicket good = s.scheduler->Submit({IoOp::kWrite, s.id, kMiB, buf.get(), 512 * 1024},
                                      IoPriority::kWriteBack);
  EXPECT_THAT(bad.Wait(),
              StatusIs(absl::ErrnoToStatus(EIO, "").code(), HasSubstr("offset 196608")));
  EXPECT_OK(good.Wait());
  EXPECT_EQ(s.scheduler->stats().of(IoPriority::kWriteBack).failed, 1u);
}

TEST(IoScheduler, RejectsBadRequestsAndOptions) {
  Rig s = Make(IoBackendChoice::kSync, 64 * 1024, 4);
  AlignedBuffer buf = MakeBuffer(kMiB);
  EXPECT_THAT(
      s.scheduler->Submit({IoOp::kRead, s.id, 100, buf.get(), 4096}, IoPriority::kDemand).Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
  EXPECT_THAT(
      s.scheduler->Submit({IoOp::kRead, FileId{42}, 0, buf.get(), 4096}, IoPriority::kDemand)
          .Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(IoScheduler::Create(s.engine.get(), {1000, 4}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(IoScheduler::Create(s.engine.get(), {4096, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(IoScheduler::Create(nullptr, {}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(IoScheduler, ManyThreadsSubmitting) {
  Rig s = Make(IoBackendChoice::kAuto, 64 * 1024, 8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer buf = MakeBuffer(256 * 1024);
      Fill(buf.get(), 256 * 1024, static_cast<std::uint32_t>(t));
      for (int i = 0; i < 20; ++i) {
        const std::uint64_t off = (static_cast<std::uint64_t>(t) * 20 + i) * 256 * 1024;
        EXPECT_OK(s.scheduler
                      ->Submit({IoOp::kWrite, s.id, off, buf.get(), 256 * 1024},
                               static_cast<IoPriority>(i % 3))
                      .Wait());
      }
    });
  }
  for (auto& th : threads) th.join();
  std::uint64_t bytes = 0;
  for (const auto& p : s.scheduler->stats().priorities) bytes += p.bytes;
  EXPECT_EQ(bytes, 4u * 20 * 256 * 1024);
}

TEST(LatencyHistogram, Percentiles) {
  LatencyHistogram h;
  for (int i = 0; i < 90; ++i) h.Record(3);     // bucket [2, 4)
  for (int i = 0; i < 10; ++i) h.Record(1000);  // bucket [512, 1024)
  EXPECT_EQ(h.Percentile(50), 4);
  EXPECT_EQ(h.Percentile(90), 4);
  EXPECT_EQ(h.Percentile(99), 1024);
  EXPECT_NEAR(h.MeanMicros(), (90 * 3 + 10 * 1000) / 100.0, 1e-9);
}

}  // namespace
}  // namespace memascend
