#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/cuda.h>
#include <memascend/host_arena.h>
#include <memascend/memory_ledger.h>
#include <memascend/pinned_pool.h>
#include <memascend/system.h>
#include <memascend/workload.h>

#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;
constexpr std::size_t RoundUp(std::size_t n) { return (n + 4095) / 4096 * 4096; }

struct Fixture {
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<PinnedPool> pool;
};

Fixture Make(PinnedPoolOptions options, std::size_t budget = 64 * kMiB, std::size_t chunk = 0,
             ArenaBacking backing = ArenaBacking::kMlock, MemoryLedger* ledger = nullptr) {
  HostArenaOptions a;
  a.backing = backing;
  a.budget_bytes = budget;
  a.chunk_bytes = chunk;
  a.ledger = ledger;
  Fixture f;
  auto arena = HostArena::Create(a);
  EXPECT_OK(arena);
  f.arena = *std::move(arena);
  auto pool = PinnedPool::Create(f.arena.get(), std::move(options));
  EXPECT_OK(pool);
  f.pool = *std::move(pool);
  return f;
}

// A fence the test opens by hand.
class ManualFence final : public ReuseFence {
 public:
  explicit ManualFence(std::shared_ptr<std::atomic<bool>> open) : open_(std::move(open)) {}
  bool Ready() override { return open_->load(); }

 private:
  std::shared_ptr<std::atomic<bool>> open_;
};

TEST(PinnedPool, DerivesClassesFromEveryRealWorkload) {
  for (const char* name : {"gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                           "mistral-7b", "opt-13b", "qwen2.5-7b"}) {
    ASSERT_OK_AND_ASSIGN(Workload w, LoadWorkload(std::string(MEMASCEND_TEST_DATA_DIR) +
                                                  "/workloads/" + name + ".tsv"));
    PinnedPoolOptions options;
    std::set<std::size_t> distinct;
    for (const WorkloadTensor& t : w.tensors) {
      options.expected_sizes.push_back(t.numel * 2);
      distinct.insert(RoundUp(t.numel * 2));
    }
    Fixture f = Make(options, kMiB, 0, ArenaBacking::kAccounting);
    // Each expected size gets a class of exactly its 4 KiB-rounded size.
    for (const WorkloadTensor& t : w.tensors) {
      EXPECT_EQ(f.pool->BlockBytesFor(t.numel * 2), RoundUp(t.numel * 2)) << name << " " << t.name;
    }
    // An LLM has a handful of distinct sizes.
    EXPECT_LE(distinct.size(), 12u) << name;
    // A size nobody announced falls into a geometric class: at most 1/9 of it wasted.
    for (std::size_t s : distinct) {
      const std::size_t odd = s + 3 * 4096 + 17;
      const std::size_t block = f.pool->BlockBytesFor(odd);
      EXPECT_GE(block, odd);
      EXPECT_LE(static_cast<double>(block - RoundUp(odd)) / static_cast<double>(block),
                1.0 / 9.0 + 1e-9)
          << name << " " << odd;
    }
  }
}

TEST(PinnedPool, GeometricClassesPerDoubling) {
  PinnedPoolOptions options;
  options.classes_per_doubling = 4;
  Fixture f = Make(options, kMiB, 0, ArenaBacking::kAccounting);
  EXPECT_EQ(f.pool->BlockBytesFor(1), 4096u);
  EXPECT_EQ(f.pool->BlockBytesFor(12288), 12288u);  // 4 KiB steps below 16 KiB
  EXPECT_EQ(f.pool->BlockBytesFor(16385), 20480u);  // 16 KiB + 4 KiB
  EXPECT_EQ(f.pool->BlockBytesFor(kMiB + 1), kMiB + kMiB / 4);
  EXPECT_EQ(f.pool->BlockBytesFor(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(f.pool->BlockBytesFor(0), 0u);
}

TEST(PinnedPool, Pow2FollowsPyTorchRules) {
  PinnedPoolOptions options;
  options.policy = PoolPolicy::kPow2;
  options.expected_sizes = {5000};  // ignored: pow2 knows no workload
  Fixture f = Make(options);
  EXPECT_EQ(f.pool->BlockBytesFor(5000), 8192u);
  EXPECT_EQ(f.pool->BlockBytesFor(3 * kMiB), 4 * kMiB);
  EXPECT_EQ(f.pool->BlockBytesFor(4 * kMiB), 4 * kMiB);
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock big, f.pool->Allocate(kMiB));
    EXPECT_EQ(big.capacity(), kMiB);
  }
  // No splitting: an idle 1 MiB block does not serve 512 KiB, a new block is made.
  ASSERT_OK_AND_ASSIGN(PinnedBlock half, f.pool->Allocate(300 * kKiB));
  EXPECT_EQ(half.capacity(), 512 * kKiB);
  EXPECT_EQ(f.pool->stats().misses, 2u);
  EXPECT_EQ(f.pool->stats().held_bytes, kMiB + 512 * kKiB);
  half.Reset();
  // Cached until emptied.
  EXPECT_EQ(f.pool->stats().held_bytes, kMiB + 512 * kKiB);
  EXPECT_EQ(f.pool->Trim(), kMiB + 512 * kKiB);
  EXPECT_EQ(f.arena->stats().mapped_bytes, 0u);
}

TEST(PinnedPool, HitPathReusesTheBlock) {
  PinnedPoolOptions options;
  options.expected_sizes = {100000};
  Fixture f = Make(options);
  std::byte* first = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(100000, Use::kParameters));
    EXPECT_EQ(b.size(), 100000u);
    EXPECT_EQ(b.capacity(), RoundUp(100000));
    EXPECT_EQ(b.use(), Use::kParameters);
    std::memset(b.data(), 1, b.size());
    first = b.data();
  }
  ASSERT_OK_AND_ASSIGN(PinnedBlock again, f.pool->Allocate(99000));  // same 4 KiB-rounded class
  EXPECT_EQ(again.data(), first);
  const PinnedPoolStats s = f.pool->stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.live_bytes, 99000u);
}

TEST(PinnedPool, EveryBlockIsAlignedToTheDirectIoBlock) {
  Fixture f = Make(PinnedPoolOptions{}, 256 * kMiB, 16 * kMiB);
  std::mt19937 rng(1);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 200; ++i) {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(1 + rng() % (512 * kKiB)));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % kHostBlockBytes, 0u);
    EXPECT_EQ(b.capacity() % kHostBlockBytes, 0u);
    EXPECT_GE(b.capacity(), b.size());
    blocks.push_back(std::move(b));
  }
  EXPECT_OK(f.arena->CheckInvariants());
}

TEST(PinnedPool, BudgetExhaustionReclaimsIdleBlocksAndLeaksNothing) {
  PinnedPoolOptions options;
  options.expected_sizes = {2 * kMiB, 3 * kMiB};
  Fixture f = Make(options, 4 * kMiB);
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock a, f.pool->Allocate(2 * kMiB));
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(2 * kMiB));
    EXPECT_THAT(f.pool->Allocate(2 * kMiB),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
    EXPECT_EQ(f.pool->stats().held_bytes, 4 * kMiB);  // the failure changed nothing
  }
  // Both 2 MiB blocks are idle; a 3 MiB request gets them back from the pool.
  ASSERT_OK_AND_ASSIGN(PinnedBlock c, f.pool->Allocate(3 * kMiB));
  EXPECT_LE(f.arena->stats().mapped_bytes, 4 * kMiB);
  c.Reset();
  f.pool->Trim();
  EXPECT_EQ(f.arena->stats().mapped_bytes, 0u);
  EXPECT_EQ(f.pool->stats().held_bytes, 0u);
}

TEST(PinnedPool, HeldBytesFollowThePeakInUseAcrossPhases) {
  PinnedPoolOptions options;
  options.expected_sizes = {3 * kMiB, 1 * kMiB};
  Fixture f = Make(options, 64 * kMiB, 0, ArenaBacking::kAccounting);
  {  // phase A: four 3 MiB blocks
    std::vector<PinnedBlock> a;
    for (int i = 0; i < 4; ++i) a.push_back(*f.pool->Allocate(3 * kMiB));
  }
  {  // phase B: twelve 1 MiB blocks, the same peak in use
    std::vector<PinnedBlock> b;
    for (int i = 0; i < 12; ++i) b.push_back(*f.pool->Allocate(1 * kMiB));
  }
  const PinnedPoolStats s = f.pool->stats();
  EXPECT_EQ(s.in_use_peak_bytes, 12 * kMiB);
  EXPECT_LE(static_cast<double>(f.arena->stats().mapped_peak_bytes), 12 * kMiB * 1.01);
  EXPECT_GT(s.reclaimed_blocks, 0u);
  // Without reclaiming, the idle phase-A blocks would stay on top.
  options.reclaim_idle_on_miss = false;
  Fixture g = Make(options, 64 * kMiB, 0, ArenaBacking::kAccounting);
  {
    std::vector<PinnedBlock> a;
    for (int i = 0; i < 4; ++i) a.push_back(*g.pool->Allocate(3 * kMiB));
  }
  {
    std::vector<PinnedBlock> b;
    for (int i = 0; i < 12; ++i) b.push_back(*g.pool->Allocate(1 * kMiB));
  }
  EXPECT_EQ(g.arena->stats().mapped_peak_bytes, 24 * kMiB);
}

TEST(PinnedPool, ConcurrentAllocateAndFree) {
  PinnedPoolOptions options;
  options.expected_sizes = {64 * kKiB, 256 * kKiB, 1 * kMiB};
  options.debug_checks = true;
  Fixture f = Make(options, 128 * kMiB, 8 * kMiB);
  const std::size_t sizes[] = {64 * kKiB, 256 * kKiB, 1 * kMiB, 100 * kKiB};
  std::atomic<std::uint64_t> allocations{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<PinnedBlock> mine;
      for (int i = 0; i < 2000; ++i) {
        if (mine.size() < 6 && (mine.empty() || rng() % 2 == 0)) {
          ++allocations;
          auto b = f.pool->Allocate(sizes[rng() % 4]);
          ASSERT_OK(b);
          std::memset(b->data(), t + 1, 16);
          mine.push_back(*std::move(b));
        } else {
          const std::size_t k = rng() % mine.size();
          EXPECT_EQ(static_cast<int>(mine[k].data()[15]), t + 1);
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  const PinnedPoolStats s = f.pool->stats();
  EXPECT_EQ(s.live_bytes, 0u);
  for (const PoolClassStats& c : s.classes) EXPECT_EQ(c.in_use, 0u);
  EXPECT_EQ(s.hits + s.misses, allocations.load());
  EXPECT_GT(s.hits, s.misses);
  EXPECT_OK(f.arena->CheckInvariants());
}

TEST(PinnedPool, DebugModeRejectsForeignAndDoubleFrees) {
  PinnedPoolOptions options;
  options.debug_checks = true;
  Fixture f = Make(options);
  ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(10000));
  std::byte* raw = b.Release();
  EXPECT_FALSE(b);
  EXPECT_THAT(f.pool->Free(raw, 9999),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allocated with 10000")));
  ASSERT_OK(f.pool->Free(raw, 10000));
  EXPECT_THAT(f.pool->Free(raw, 10000),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("double free")));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation foreign, f.arena->Allocate(8192));
  EXPECT_THAT(f.pool->Free(foreign.data, 8192), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(f.arena->Free(foreign.data));
  EXPECT_EQ(f.pool->stats().live_bytes, 0u);
}

TEST(PinnedPool, ReleaseModeStillRejectsMisalignedPointers) {
  Fixture f = Make(PinnedPoolOptions{});
  alignas(8) std::byte local[64];
  EXPECT_THAT(f.pool->Free(local + 8, 64), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(f.pool->Free(nullptr, 64), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(f.pool->Allocate(0), StatusIs(absl::StatusCode::kInvalidArgument));
}

#if defined(__SANITIZE_ADDRESS__)
TEST(PinnedPoolDeathTest, DebugModePoisonsIdleBlocks) {
  PinnedPoolOptions options;
  options.debug_checks = true;
  Fixture f = Make(options);
  std::byte* stale = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(4096));
    stale = b.data();
  }
  EXPECT_DEATH({ *reinterpret_cast<volatile char*>(stale) = 1; }, "use-after-poison");
}
#endif

TEST(PinnedPool, FencedBlocksWaitForTheirFence) {
  PinnedPoolOptions options;
  options.expected_sizes = {64 * kKiB};
  Fixture f = Make(options);
  auto open = std::make_shared<std::atomic<bool>>(false);
  std::byte* fenced = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(64 * kKiB));
    fenced = b.data();
    b.SetReuseFence(std::make_unique<ManualFence>(open));
  }  // returned while "the copy" is in flight
  ASSERT_OK_AND_ASSIGN(PinnedBlock other, f.pool->Allocate(64 * kKiB));
  EXPECT_NE(other.data(), fenced);
  EXPECT_EQ(f.pool->Trim(), 0u);  // a fenced block is not idle
  other.Reset();
  open->store(true);
  // Both are reusable now; the pool hands them out again without growing.
  ASSERT_OK_AND_ASSIGN(PinnedBlock x, f.pool->Allocate(64 * kKiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock y, f.pool->Allocate(64 * kKiB));
  EXPECT_TRUE(x.data() == fenced || y.data() == fenced);
  EXPECT_EQ(f.pool->stats().misses, 2u);
}

TEST(PinnedPool, CudaFenceNeedsAGpu) {
  auto fence = RecordCudaFence(CudaStreamView());
  if (ProbeSystem(ProbeOptions{}).cuda.device_count == 0) {
    EXPECT_THAT(fence, StatusIs(absl::StatusCode::kFailedPrecondition));
    return;
  }
  ASSERT_OK(fence);
  while (!(*fence)->Ready()) {
  }
}

TEST(PinnedPool, ReportsLiveAndReservedByUseToTheLedger) {
  MemoryLedger ledger(MemoryLedger::Options{.sample_every_update = false, .sample_rss = false});
  PinnedPoolOptions options;
  options.expected_sizes = {10000};
  Fixture f = Make(options, 8 * kMiB, 1 * kMiB, ArenaBacking::kMlock, &ledger);
  const auto use = [&](Use u) { return ledger.Snapshot().use(Tier::kPinnedHost, u); };
  {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, f.pool->Allocate(10000, Use::kGradients));
    EXPECT_EQ(use(Use::kGradients).live, 10000);
    EXPECT_EQ(use(Use::kGradients).reserved, 12288);
    EXPECT_EQ(use(Use::kCached).reserved, 0);
    EXPECT_EQ(use(Use::kFree).reserved, static_cast<std::int64_t>(kMiB - 12288));
  }
  EXPECT_EQ(use(Use::kGradients).reserved, 0);
  EXPECT_EQ(use(Use::kCached).reserved, 12288);
  const LedgerSnapshot s = ledger.Snapshot();
  EXPECT_EQ(s.tier(Tier::kPinnedHost).reserved,
            static_cast<std::int64_t>(f.arena->stats().mapped_bytes));
  EXPECT_EQ(s.tier(Tier::kPinnedHost).live_peak, 10000);
  f.pool->Trim();
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kPinnedHost).reserved, 0);
  EXPECT_EQ(ledger.underflows(), 0);
}

TEST(PinnedPool, RejectsBadOptions) {
  HostArenaOptions a;
  a.budget_bytes = kMiB;
  ASSERT_OK_AND_ASSIGN(auto arena, HostArena::Create(a));
  PinnedPoolOptions options;
  options.classes_per_doubling = 6;
  EXPECT_THAT(PinnedPool::Create(arena.get(), options),
              StatusIs(absl::StatusCode::kInvalidArgument));
  options.classes_per_doubling = 8;
  options.expected_sizes = {0};
  EXPECT_THAT(PinnedPool::Create(arena.get(), options),
              StatusIs(absl::StatusCode::kInvalidArgument));
  options.expected_sizes = {};
  options.idle_slack = -1;
  EXPECT_THAT(PinnedPool::Create(arena.get(), options),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(PinnedPool::Create(nullptr, PinnedPoolOptions{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace memascend
