// The tensor store's eviction policy on its own (store/eviction.h): no memory, no I/O.
#include "store/eviction.h"

#include <vector>

#include <gtest/gtest.h>

namespace memascend::store {
namespace {

EvictionCandidate Idle(int rank, std::uint64_t last_use) {
  EvictionCandidate c;
  c.eligible = c.resident = true;
  c.rank = rank;
  c.last_use = last_use;
  return c;
}

TEST(Eviction, RanksPlainThenKeptThenWanted) {
  EXPECT_EQ(EvictionRank(false, false), 0);
  EXPECT_EQ(EvictionRank(false, true), 1);
  EXPECT_EQ(EvictionRank(true, false), 2);
  EXPECT_EQ(EvictionRank(true, true), 2);  // wanted soon outranks kept
}

TEST(Eviction, LowestRankFirstThenLeastRecentlyUsed) {
  std::vector<EvictionCandidate> c = {Idle(1, 1), Idle(0, 9), Idle(0, 5), Idle(2, 0)};
  EvictionChoice choice = ChooseVictim(c, /*prefetch=*/false);
  EXPECT_EQ(choice.action, EvictionAction::kEvict);
  EXPECT_EQ(choice.victim, 2u);
  c[2].eligible = false;  // leased, or the tensor wanting room
  EXPECT_EQ(ChooseVictim(c, false).victim, 1u);
  c[1].resident = false;  // loading
  c[2].resident = false;
  EXPECT_EQ(ChooseVictim(c, false).victim, 0u);  // a kept one before a wanted one
}

TEST(Eviction, APrefetchNeverEvictsWhatIsWantedOrKept) {
  std::vector<EvictionCandidate> c = {Idle(1, 1), Idle(2, 0)};
  EXPECT_EQ(ChooseVictim(c, /*prefetch=*/true).action, EvictionAction::kRefusePrefetch);
  EXPECT_EQ(ChooseVictim(c, /*prefetch=*/false).action, EvictionAction::kEvict);
  c.push_back(Idle(0, 7));
  EXPECT_EQ(ChooseVictim(c, true).action, EvictionAction::kEvict);
  EXPECT_EQ(ChooseVictim(c, true).victim, 2u);
}

TEST(Eviction, WaitsForALowerRankedWriteBackRatherThanEvictHigher) {
  EvictionCandidate writing;
  writing.eligible = writing.writing = true;
  writing.rank = 0;
  std::vector<EvictionCandidate> c = {Idle(1, 3), writing};
  EXPECT_EQ(ChooseVictim(c, false).action, EvictionAction::kWaitForWriteBack);
  c[1].rank = 1;  // same rank: evict the idle one now
  EXPECT_EQ(ChooseVictim(c, false).action, EvictionAction::kEvict);
  c[1].eligible = false;  // a leased tensor being written does not count
  c[1].rank = 0;
  EXPECT_EQ(ChooseVictim(c, false).action, EvictionAction::kEvict);
}

TEST(Eviction, NothingWhenNothingIsIdle) {
  EXPECT_EQ(ChooseVictim({}, false).action, EvictionAction::kNothing);
  EvictionCandidate leased = Idle(0, 0);
  leased.eligible = false;
  std::vector<EvictionCandidate> c = {leased};
  EXPECT_EQ(ChooseVictim(c, false).action, EvictionAction::kNothing);
}

}  // namespace
}  // namespace memascend::store
