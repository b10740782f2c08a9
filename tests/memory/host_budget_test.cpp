// Note [default host budget] and Note [store backing]: the choosers on given figures.
#include <string>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/host_budget.h>

#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

MemoryLimit Cgroup(std::uint64_t limit, std::uint64_t usage) {
  MemoryLimit l;
  l.cgroup_version = 1;
  l.cgroup_dir = "/sys/fs/cgroup/memory/job";
  l.cgroup_limit_bytes = limit;
  l.cgroup_limit_file = "/sys/fs/cgroup/memory/job/memory.limit_in_bytes";
  l.cgroup_usage_bytes = usage;
  l.total_bytes = 24 * kGiB;
  l.available_bytes = 20 * kGiB;
  return l;
}

MemoryInfo Lockable(std::uint64_t memlock, bool cap_ipc_lock = false) {
  MemoryInfo m;
  m.page_size = 4096;
  m.memlock_soft_bytes = memlock;
  m.memlock_hard_bytes = memlock;
  m.cap_ipc_lock = cap_ipc_lock;
  return m;
}

HostBudgetRequest Want(std::uint64_t other) {
  HostBudgetRequest r;
  r.minimum_bytes = 100 * kMiB;
  r.maximum_bytes = 20 * kGiB;
  r.other_bytes = other;
  return r;
}

TEST(ChooseHostBudget, TheCgroupLessAMarginAndTheRunsOtherNeeds) {
  ASSERT_OK_AND_ASSIGN(HostBudget b,
                       ChooseHostBudget(Want(2 * kGiB), Cgroup(4 * kGiB, 0), Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 4 * kGiB - kGiB / 2 - 2 * kGiB);
  EXPECT_TRUE(b.locked);
  EXPECT_FALSE(b.given);
  EXPECT_TRUE(b.warning.empty());
  EXPECT_THAT(b.reason, HasSubstr("cgroup memory.limit_in_bytes of "
                                  "/sys/fs/cgroup/memory/job/memory.limit_in_bytes = 4.00 GiB"));
  EXPECT_THAT(b.reason, HasSubstr("other needs (2.00 GiB"));
}

TEST(ChooseHostBudget, UsageOfTheCgroupCountsButNotItsReclaimableCache) {
  MemoryLimit l = Cgroup(4 * kGiB, 2 * kGiB);
  l.cgroup_reclaimable_bytes = kGiB;
  ASSERT_OK_AND_ASSIGN(HostBudget b, ChooseHostBudget(Want(0), l, Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, (3 * kGiB) / 8 * 7);
}

TEST(ChooseHostBudget, MemAvailableWhenItIsLess) {
  MemoryLimit l = Cgroup(kUnlimited, 0);
  l.cgroup_limit_file.clear();
  l.available_bytes = 8 * kGiB;
  ASSERT_OK_AND_ASSIGN(HostBudget b, ChooseHostBudget(Want(kGiB), l, Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 7 * kGiB - kGiB);
  EXPECT_THAT(b.reason, HasSubstr("MemAvailable of /proc/meminfo = 8.00 GiB"));
}

TEST(ChooseHostBudget, NeverMoreThanTheStateCanHold) {
  HostBudgetRequest r = Want(kGiB);
  r.maximum_bytes = 300 * kMiB;
  ASSERT_OK_AND_ASSIGN(HostBudget b,
                       ChooseHostBudget(r, Cgroup(16 * kGiB, 0), Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 300 * kMiB);
  EXPECT_THAT(b.reason, HasSubstr("all the training state can hold"));
}

TEST(ChooseHostBudget, AMinimumThatDoesNotFitIsRefusedWithTheFigures) {
  HostBudgetRequest r = Want(3 * kGiB);
  r.minimum_bytes = 600 * kMiB;
  EXPECT_THAT(ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(kUnlimited)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("600.00 MiB (629145600 bytes), does not fit: cgroup "
                                 "memory.limit_in_bytes of /sys/fs/cgroup/memory/job/")));
}

TEST(ChooseHostBudget, BelowTheMemlockLimitItIsUnlockedWithOneWarning) {
  ASSERT_OK_AND_ASSIGN(HostBudget b,
                       ChooseHostBudget(Want(kGiB), Cgroup(4 * kGiB, 0), Lockable(8 * kMiB)));
  EXPECT_EQ(b.bytes, 4 * kGiB - kGiB / 2 - kGiB);
  EXPECT_FALSE(b.locked);
  EXPECT_THAT(b.reason, HasSubstr("unlocked memory: RLIMIT_MEMLOCK is 8.00 MiB"));
  EXPECT_THAT(b.warning, HasSubstr("ulimit -l"));
  EXPECT_THAT(b.warning, HasSubstr("LimitMEMLOCK="));
  EXPECT_THAT(b.warning, HasSubstr("--ulimit memlock=-1"));
}

TEST(ChooseHostBudget, MemlockBindsNeitherCapIpcLockNorCudaRegisteredMemory) {
  ASSERT_OK_AND_ASSIGN(HostBudget cap, ChooseHostBudget(Want(kGiB), Cgroup(4 * kGiB, 0),
                                                        Lockable(8 * kMiB, /*cap_ipc_lock=*/true)));
  EXPECT_TRUE(cap.locked);
  EXPECT_TRUE(cap.warning.empty());
  HostBudgetRequest r = Want(kGiB);
  r.backing = HostBackingKind::kCudaRegistered;
  ASSERT_OK_AND_ASSIGN(HostBudget cuda,
                       ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(8 * kMiB)));
  EXPECT_TRUE(cuda.locked);
}

TEST(ChooseHostBudget, AGivenBudgetIsKeptCappedOrRefused) {
  HostBudgetRequest r = Want(kGiB);
  r.given_bytes = 3 * kGiB;  // more than the default would take: still the caller's
  ASSERT_OK_AND_ASSIGN(HostBudget b,
                       ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 3 * kGiB);
  EXPECT_TRUE(b.given);
  EXPECT_TRUE(b.locked);

  r.maximum_bytes = 2 * kGiB;  // capped at the state, as before
  ASSERT_OK_AND_ASSIGN(b, ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 2 * kGiB);
  EXPECT_THAT(b.reason, HasSubstr("capped"));

  r.maximum_bytes = 20 * kGiB;
  r.given_bytes = 5 * kGiB;
  EXPECT_THAT(ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(kUnlimited)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("host budget of 5.00 GiB (5368709120 bytes) is more than the "
                                 "memory limit, cgroup memory.limit_in_bytes of "
                                 "/sys/fs/cgroup/memory/job/memory.limit_in_bytes = 4.00 GiB")));

  r.given_bytes = kGiB;  // held with mlock past RLIMIT_MEMLOCK: refused, not unlocked
  EXPECT_THAT(ChooseHostBudget(r, Cgroup(4 * kGiB, 0), Lockable(8 * kMiB)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("ulimit -l")));
}

TEST(ChooseHostBudget, NoLimitKnownTakesTheWholeState) {
  MemoryLimit none;
  ASSERT_OK_AND_ASSIGN(HostBudget b, ChooseHostBudget(Want(kGiB), none, Lockable(kUnlimited)));
  EXPECT_EQ(b.bytes, 20 * kGiB);
}

TEST(ChooseStoreBacking, AutoWithoutAGpuTierIsUnlockedPastTheMemlockLimitWithOneWarning) {
  ASSERT_OK_AND_ASSIGN(StoreBacking s, ChooseStoreBacking(ArenaBacking::kAuto, 512 * kMiB,
                                                          /*gpu_tier=*/false, Lockable(8 * kMiB)));
  EXPECT_EQ(s.backing, ArenaBacking::kUnlocked);
  EXPECT_THAT(s.warning, HasSubstr("RLIMIT_MEMLOCK (8.00 MiB) is below the host budget of "
                                   "512.00 MiB"));
  EXPECT_THAT(s.warning, HasSubstr("ulimit -l"));

  // Within the limit, with CAP_IPC_LOCK, or with a GPU tier (CUDA-registered): as asked.
  for (const auto& [budget, memory, gpu_tier] :
       {std::tuple{8 * kMiB, Lockable(8 * kMiB), false},
        std::tuple{512 * kMiB, Lockable(8 * kMiB, /*cap_ipc_lock=*/true), false},
        std::tuple{512 * kMiB, Lockable(8 * kMiB), true}}) {
    ASSERT_OK_AND_ASSIGN(s, ChooseStoreBacking(ArenaBacking::kAuto, budget, gpu_tier, memory));
    EXPECT_EQ(s.backing, ArenaBacking::kAuto);
    EXPECT_TRUE(s.warning.empty());
  }
}

TEST(ChooseStoreBacking, AnExplicitMlockPastTheLimitIsRefusedUpFront) {
  EXPECT_THAT(ChooseStoreBacking(ArenaBacking::kMlock, 512 * kMiB, false, Lockable(8 * kMiB)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("host budget of 512.00 MiB (536870912 bytes) is more than this "
                                 "process may page-lock (RLIMIT_MEMLOCK 8388608 bytes")));
  ASSERT_OK_AND_ASSIGN(StoreBacking s, ChooseStoreBacking(ArenaBacking::kMlock, 8 * kMiB, false,
                                                          Lockable(8 * kMiB)));
  EXPECT_EQ(s.backing, ArenaBacking::kMlock);
  // What does not lock is kept as asked.
  for (ArenaBacking b : {ArenaBacking::kUnlocked, ArenaBacking::kCudaRegistered}) {
    ASSERT_OK_AND_ASSIGN(s, ChooseStoreBacking(b, 512 * kMiB, false, Lockable(8 * kMiB)));
    EXPECT_EQ(s.backing, b);
    EXPECT_TRUE(s.warning.empty());
  }
}

}  // namespace
}  // namespace memascend
