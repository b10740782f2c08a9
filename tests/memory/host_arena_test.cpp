#include <cstring>
#include <random>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/host_arena.h>
#include <memascend/memory_ledger.h>
#include <memascend/system.h>

#include "prim/cuda.h"
#include "testing/process.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;

std::unique_ptr<HostArena> MakeArena(std::size_t budget, std::size_t chunk,
                                     ArenaBacking backing = ArenaBacking::kMlock,
                                     MemoryLedger* ledger = nullptr) {
  HostArenaOptions options;
  options.backing = backing;
  options.budget_bytes = budget;
  options.chunk_bytes = chunk;
  options.ledger = ledger;
  options.debug_checks = true;
  auto arena = HostArena::Create(options);
  EXPECT_OK(arena);
  return arena.ok() ? *std::move(arena) : nullptr;
}

TEST(HostArena, SizesAreRoundedToTheBlockOnlyAndAligned) {
  auto arena = MakeArena(16 * kMiB, 4 * kMiB);
  std::vector<ArenaAllocation> all;
  for (const auto& [ask, want] :
       std::vector<std::pair<std::size_t, std::size_t>>{{1, 4096},
                                                        {4095, 4096},
                                                        {4096, 4096},
                                                        {4097, 8192},
                                                        {10000, 12288},
                                                        {5 * kMiB / 2 + 1, 5 * kMiB / 2 + 4096}}) {
    ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(ask));
    EXPECT_EQ(a.size, want) << ask;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data) % kHostBlockBytes, 0u);
    std::memset(a.data, 0xab, a.size);  // the memory is real and writable
    all.push_back(a);
  }
  EXPECT_OK(arena->CheckInvariants());
  for (const ArenaAllocation& a : all) EXPECT_OK(arena->Free(a.data));
  EXPECT_EQ(arena->stats().allocated_bytes, 0u);
}

TEST(HostArena, NeverRoundsToPowersOfTwo) {
  auto arena = MakeArena(64 * kMiB, 0);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(5 * kMiB + 1));
  EXPECT_EQ(a.size, 5 * kMiB + 4096);
  EXPECT_EQ(arena->stats().mapped_bytes, 5 * kMiB + 4096);  // chunk 0: exactly the request
  EXPECT_OK(arena->Free(a.data));
}

TEST(HostArena, FreesCoalesceWithNeighbours) {
  auto arena = MakeArena(4 * kMiB, 1 * kMiB);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(256 * kKiB));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation b, arena->Allocate(256 * kKiB));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation c, arena->Allocate(256 * kKiB));
  EXPECT_EQ(arena->stats().regions, 1u);
  EXPECT_EQ(arena->stats().largest_free_extent, 256 * kKiB);
  ASSERT_OK(arena->Free(a.data));
  ASSERT_OK(arena->Free(c.data));  // merges with the free tail
  EXPECT_EQ(arena->stats().largest_free_extent, 512 * kKiB);
  ASSERT_OK(arena->Free(b.data));  // merges both sides: one extent, the whole region
  EXPECT_EQ(arena->stats().largest_free_extent, 1 * kMiB);
  EXPECT_OK(arena->CheckInvariants());
  // The coalesced space serves a request as large as the region without growth.
  ASSERT_OK_AND_ASSIGN(ArenaAllocation whole, arena->Allocate(1 * kMiB));
  EXPECT_EQ(arena->stats().regions_mapped_total, 1u);
  EXPECT_OK(arena->Free(whole.data));
}

TEST(HostArena, GrowsInChunksUpToTheBudgetThenFailsCleanly) {
  auto arena = MakeArena(3 * kMiB, 1 * kMiB);
  std::vector<ArenaAllocation> all;
  for (int i = 0; i < 6; ++i) {
    ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(512 * kKiB));
    all.push_back(a);
  }
  EXPECT_EQ(arena->stats().regions, 3u);
  EXPECT_EQ(arena->stats().mapped_bytes, 3 * kMiB);
  const HostArenaStats before = arena->stats();
  EXPECT_THAT(arena->Allocate(4096),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
  EXPECT_THAT(arena->Allocate(4 * kMiB), StatusIs(absl::StatusCode::kResourceExhausted));
  const HostArenaStats after = arena->stats();
  EXPECT_EQ(after.mapped_bytes, before.mapped_bytes);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_OK(arena->CheckInvariants());
  for (const ArenaAllocation& a : all) ASSERT_OK(arena->Free(a.data));
  EXPECT_EQ(arena->ReleaseFreeRegions(), 3 * kMiB);
  EXPECT_EQ(arena->stats().mapped_bytes, 0u);
}

// Note [region guard]: regions are never adjacent, so no range of the arena's runs from one
// region, locked or registered on its own, into the next (mapped one after another, the
// kernel would otherwise place each right below the last).
TEST(HostArena, NoTwoRegionsAreAdjacent) {
  auto arena = MakeArena(8 * kMiB, 1 * kMiB);
  std::vector<ArenaAllocation> all;
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(1 * kMiB));
    all.push_back(a);
  }
  const std::vector<std::span<std::byte>> regions = arena->Regions();
  ASSERT_EQ(regions.size(), 8u);
  for (const auto& a : regions) {
    for (const auto& b : regions) {
      EXPECT_NE(a.data() + a.size(), b.data());
    }
  }
  for (const ArenaAllocation& a : all) ASSERT_OK(arena->Free(a.data));
  EXPECT_EQ(arena->ReleaseFreeRegions(), 8 * kMiB);
}

TEST(HostArena, GrowthClipsTheChunkToTheBudget) {
  auto arena = MakeArena(3 * kMiB / 2, 1 * kMiB);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(1 * kMiB));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation b, arena->Allocate(256 * kKiB));  // 512 KiB left: clipped
  EXPECT_EQ(arena->stats().mapped_bytes, 3 * kMiB / 2);
  EXPECT_OK(arena->Free(a.data));
  EXPECT_OK(arena->Free(b.data));
}

TEST(HostArena, LargeRequestsGetARegionOfTheirOwn) {
  auto arena = MakeArena(16 * kMiB, 1 * kMiB);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(3 * kMiB));
  EXPECT_EQ(arena->stats().mapped_bytes, 3 * kMiB);
  EXPECT_OK(arena->Free(a.data));
}

TEST(HostArena, GrowthGivesBackEmptyRegionsFirst) {
  auto arena = MakeArena(3 * kMiB, 0);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(2 * kMiB));
  ASSERT_OK(arena->Free(a.data));  // an empty 2 MiB region stays mapped ...
  // ... until a request it cannot hold needs the budget.
  ASSERT_OK_AND_ASSIGN(ArenaAllocation b, arena->Allocate(3 * kMiB));
  EXPECT_EQ(arena->stats().mapped_bytes, 3 * kMiB);
  EXPECT_OK(arena->Free(b.data));
}

TEST(HostArena, SplitFreeRegionsFalseLeavesEmptyRegionsWhole) {
  auto arena = MakeArena(8 * kMiB, 0);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(2 * kMiB));
  ASSERT_OK(arena->Free(a.data));
  EXPECT_THAT(arena->AllocateFromFree(1 * kMiB, Use::kStaging, /*split_free_regions=*/false),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation exact,
                       arena->AllocateFromFree(2 * kMiB, Use::kStaging, false));  // exact fit
  EXPECT_EQ(exact.data, a.data);
  ASSERT_OK(arena->Free(exact.data));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation split, arena->AllocateFromFree(1 * kMiB));
  EXPECT_EQ(split.data, a.data);
  EXPECT_OK(arena->Free(split.data));
}

TEST(HostArena, RejectsForeignInteriorAndDoubleFrees) {
  auto arena = MakeArena(4 * kMiB, 1 * kMiB);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(64 * kKiB));
  int on_stack = 0;
  EXPECT_THAT(arena->Free(&on_stack),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not from this arena")));
  EXPECT_THAT(arena->Free(a.data + 4096),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("interior")));
  ASSERT_OK(arena->Free(a.data));
  EXPECT_THAT(arena->Free(a.data), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(arena->CheckInvariants());
}

TEST(HostArena, RejectsBadOptionsAndSizes) {
  HostArenaOptions options;
  EXPECT_THAT(HostArena::Create(options), StatusIs(absl::StatusCode::kInvalidArgument));
  options.budget_bytes = kMiB;
  options.chunk_bytes = 1000;
  EXPECT_THAT(HostArena::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page size")));
  auto arena = MakeArena(kMiB, 0);
  EXPECT_THAT(arena->Allocate(0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(arena->Allocate(2 * kMiB), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(HostArena, AccountingBackingSimulatesHugeBudgetsWithoutMemory) {
  auto arena = MakeArena(std::size_t{1} << 40, 0, ArenaBacking::kAccounting);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(std::size_t{100} << 30));
  EXPECT_EQ(a.size, std::size_t{100} << 30);
  EXPECT_EQ(arena->backing(), ArenaBacking::kAccounting);
  EXPECT_OK(arena->Free(a.data));
}

TEST(HostArena, AutoBackingFollowsTheProbe) {
  auto arena = MakeArena(kMiB, 0, ArenaBacking::kAuto);
  const bool gpu = ProbeSystem(ProbeOptions{}).cuda.device_count > 0;
  EXPECT_EQ(arena->backing(), gpu ? ArenaBacking::kCudaRegistered : ArenaBacking::kMlock);
}

TEST(HostArena, CudaRegisteredBackingNeedsADevice) {
  if (ProbeSystem(ProbeOptions{}).cuda.device_count > 0) {
    auto arena = MakeArena(4 * kMiB, 0, ArenaBacking::kCudaRegistered);
    ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(kMiB));
    std::memset(a.data, 1, a.size);
    EXPECT_OK(arena->Free(a.data));
    return;
  }
  HostArenaOptions options;
  options.backing = ArenaBacking::kCudaRegistered;
  options.budget_bytes = kMiB;
  EXPECT_THAT(HostArena::Create(options), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(HostArena, NumaBinding) {
  const SystemInfo info = ProbeSystem(ProbeOptions{});
  if (!info.numa.available) GTEST_SKIP() << "no NUMA support in this kernel or sandbox";
  HostArenaOptions options;
  options.budget_bytes = 4 * kMiB;
  options.chunk_bytes = 0;
  options.numa_node = 0;
  ASSERT_OK_AND_ASSIGN(auto arena, HostArena::Create(options));
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(kMiB));
  std::memset(a.data, 7, a.size);
  EXPECT_OK(arena->Free(a.data));
  options.numa_node = 4096;
  ASSERT_OK_AND_ASSIGN(auto bad, HostArena::Create(options));
  EXPECT_THAT(bad->Allocate(kMiB), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NUMA")));
}

TEST(HostArena, MlockFailureNamesTheLimitAndTheFix) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer intercepts mlock() and turns it into a no-op";
#endif
  // In a child: a 64 KiB RLIMIT_MEMLOCK and no CAP_IPC_LOCK, then ask for 1 MiB.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (!testing::DropIpcLock()) _exit(3);
    rlimit lim{64 * 1024, 64 * 1024};
    if (setrlimit(RLIMIT_MEMLOCK, &lim) != 0) _exit(4);
    HostArenaOptions options;
    options.backing = ArenaBacking::kMlock;
    options.budget_bytes = 4 * kMiB;
    options.chunk_bytes = 0;
    auto arena = HostArena::Create(options);
    if (!arena.ok()) _exit(5);
    auto a = (*arena)->Allocate(kMiB);
    if (a.ok()) _exit(6);
    const std::string message(a.status().message());
    const bool good = a.status().code() == absl::StatusCode::kResourceExhausted &&
                      message.find("RLIMIT_MEMLOCK") != std::string::npos &&
                      message.find("ulimit -l") != std::string::npos;
    if (!good) _exit(7);
    if ((*arena)->stats().mapped_bytes != 0) _exit(8);  // nothing left behind
    _exit(0);
  }
  EXPECT_EQ(testing::ExitCodeOf(pid), 0)
      << "child step failed (3: capset, 4: setrlimit, 5: create, "
         "6: mlock succeeded, 7: bad error, 8: leak)";
}

// MEMASCEND_DISABLE_CUDA holds for the arena's automatic backing too: mlock, even
// where a CUDA device is present (where none is, kAuto picks mlock anyway).
TEST(HostArena, AutoBackingHonoursMemascendDisableCuda) {
  setenv("MEMASCEND_DISABLE_CUDA", "1", 1);
  HostArenaOptions options;
  options.budget_bytes = 4 * kMiB;
  auto arena = HostArena::Create(options);
  unsetenv("MEMASCEND_DISABLE_CUDA");
  ASSERT_OK(arena.status());
  EXPECT_EQ((*arena)->backing(), ArenaBacking::kMlock);
  ASSERT_OK_AND_ASSIGN(ArenaAllocation a, (*arena)->Allocate(kMiB));
  std::memset(a.data, 1, a.size);
  EXPECT_OK((*arena)->Free(a.data));
}

// Note [cuda and fork]: in a child forked after this process used CUDA, the library
// acts as on a machine without a device, and says why, instead of failing in
// cudaHostRegister. Meaningful on a GPU machine; on others it checks the reason.
TEST(HostArena, AForkedChildOfACudaUserFallsBackToMlockAndSaysWhy) {
  prim::NoteCudaUse();  // as ProbeCuda does before its first runtime call
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const CudaInfo cuda = prim::ProbeCuda(false);
    if (cuda.device_count != 0) _exit(3);
    if (prim::CudaUnusableReason().find("fork") == std::string::npos) _exit(4);
    // (A build without CUDA says that first.)
    if (cuda.built_with_cuda && cuda.status.find("fork") == std::string::npos) _exit(4);
    HostArenaOptions options;
    options.budget_bytes = 4 * kMiB;
    auto arena = HostArena::Create(options);
    if (!arena.ok() || (*arena)->backing() != ArenaBacking::kMlock) _exit(5);
    auto a = (*arena)->Allocate(kMiB);
    if (!a.ok()) _exit(6);
    std::memset(a->data, 1, a->size);
    _exit(0);
  }
  EXPECT_EQ(testing::ExitCodeOf(pid), 0)
      << "child step failed (3: a device was seen, 4: no reason, "
         "5: not mlock, 6: allocation failed)";
  EXPECT_EQ(prim::CudaUnusableReason(), "");  // the parent itself still may use CUDA
}

TEST(HostArena, ReportsToTheLedger) {
  MemoryLedger ledger(MemoryLedger::Options{.sample_every_update = false, .sample_rss = false});
  {
    auto arena = MakeArena(8 * kMiB, 1 * kMiB, ArenaBacking::kMlock, &ledger);
    ASSERT_OK_AND_ASSIGN(ArenaAllocation a, arena->Allocate(10000, Use::kParameters));
    LedgerSnapshot s = ledger.Snapshot();
    EXPECT_EQ(s.tier(Tier::kPinnedHost).reserved, static_cast<std::int64_t>(kMiB));
    EXPECT_EQ(s.tier(Tier::kPinnedHost).live, 10000);
    EXPECT_EQ(s.use(Tier::kPinnedHost, Use::kParameters).reserved, 12288);
    EXPECT_EQ(s.use(Tier::kPinnedHost, Use::kFree).reserved,
              static_cast<std::int64_t>(kMiB - 12288));
    ASSERT_OK(arena->Free(a.data));
    s = ledger.Snapshot();
    EXPECT_EQ(s.tier(Tier::kPinnedHost).live, 0);
    EXPECT_EQ(s.tier(Tier::kPinnedHost).reserved, static_cast<std::int64_t>(kMiB));
  }
  // The arena's destruction leaves the ledger empty, and nothing underflowed.
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kPinnedHost).reserved, 0);
  EXPECT_EQ(ledger.underflows(), 0);
}

TEST(HostArena, ConcurrentAllocateAndFree) {
  auto arena = MakeArena(64 * kMiB, 4 * kMiB);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&arena, t] {
      std::mt19937 rng(t);
      std::vector<ArenaAllocation> mine;
      for (int i = 0; i < 400; ++i) {
        if (mine.size() < 8 && (rng() % 3 != 0 || mine.empty())) {
          auto a = arena->Allocate(1 + rng() % (256 * kKiB));
          if (a.ok()) {
            std::memset(a->data, t, 64);
            mine.push_back(*a);
          }
        } else {
          const std::size_t k = rng() % mine.size();
          EXPECT_EQ(static_cast<int>(mine[k].data[0]), t);  // nobody else wrote here
          EXPECT_OK(arena->Free(mine[k].data));
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (const ArenaAllocation& a : mine) EXPECT_OK(arena->Free(a.data));
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_OK(arena->CheckInvariants());
  EXPECT_EQ(arena->stats().allocated_bytes, 0u);
}

}  // namespace
}  // namespace memascend
