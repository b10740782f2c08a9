#include "storage/extent_allocator.h"

#include <random>

#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace memascend::storage {
namespace {

using ::memascend::testing::StatusIs;

TEST(ExtentAllocator, BestFitAndCoalescing) {
  ExtentAllocator a(100);
  ASSERT_OK_AND_ASSIGN(auto x, a.Allocate(10));  // [0,10)
  ASSERT_OK_AND_ASSIGN(auto y, a.Allocate(5));   // [10,15)
  ASSERT_OK_AND_ASSIGN(auto z, a.Allocate(20));  // [15,35)
  ASSERT_OK(a.Free(x));
  ASSERT_OK(a.Free(z));  // free: [0,10) [15,100)
  EXPECT_EQ(a.free_extents(), 2u);
  ASSERT_OK_AND_ASSIGN(auto fit, a.Allocate(8));  // best fit: the 10-unit hole, not the tail
  EXPECT_EQ(fit, (std::vector<Extent>{{0, 8}}));
  ASSERT_OK(a.Free(fit));
  ASSERT_OK(a.Free(y));  // all coalesced
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 100u);
  EXPECT_EQ(a.fragmentation(), 0.0);
  EXPECT_OK(a.CheckInvariants());
}

TEST(ExtentAllocator, SplitsAcrossExtentsWhenNoneIsLargeEnough) {
  ExtentAllocator a(30);
  auto a1 = *a.Allocate(10), a2 = *a.Allocate(10), a3 = *a.Allocate(10);
  ASSERT_OK(a.Free(a1));
  ASSERT_OK(a.Free(a3));
  EXPECT_NEAR(a.fragmentation(), 0.5, 1e-9);
  ASSERT_OK_AND_ASSIGN(auto pieces, a.Allocate(15));
  EXPECT_EQ(pieces.size(), 2u);
  EXPECT_EQ(a.free_units(), 5u);
  EXPECT_THAT(a.Allocate(6), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(a.free_units(), 5u);  // the failure changed nothing
  EXPECT_OK(a.CheckInvariants());
  // Four single free units: three of them need three extents.
  ExtentAllocator b(10);
  std::vector<std::vector<Extent>> units;
  for (int i = 0; i < 10; ++i) units.push_back(*b.Allocate(1));
  for (int i : {0, 2, 4, 6}) ASSERT_OK(b.Free(units[static_cast<std::size_t>(i)]));
  EXPECT_THAT(b.Allocate(3, /*max_extents=*/2), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(b.free_units(), 4u);
  ASSERT_OK_AND_ASSIGN(auto three, b.Allocate(3, 3));
  EXPECT_EQ(three.size(), 3u);
}

TEST(ExtentAllocator, RejectsDoubleFreesAndDoubleClaims) {
  ExtentAllocator a(50);
  auto x = *a.Allocate(10);
  ASSERT_OK(a.Free(x));
  EXPECT_THAT(a.Free(x), StatusIs(absl::StatusCode::kInternal));
  EXPECT_THAT(a.Free(std::vector<Extent>{{45, 10}}), StatusIs(absl::StatusCode::kInternal));
  ASSERT_OK(a.Reserve(std::vector<Extent>{{5, 5}}));
  EXPECT_THAT(a.Reserve(std::vector<Extent>{{8, 4}}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(a.Reserve(std::vector<Extent>{{48, 4}}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(a.free_units(), 45u);
}

TEST(ExtentAllocator, RandomWorkloadKeepsExactAccounting) {
  ExtentAllocator a(10000);
  std::mt19937 rng(3);
  std::vector<std::vector<Extent>> live;
  std::uint64_t used = 0;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const std::uint64_t n = 1 + rng() % 200;
      auto got = a.Allocate(n);
      if (got.ok()) {
        live.push_back(*got);
        used += n;
      }
    } else {
      const std::size_t k = rng() % live.size();
      for (const Extent& e : live[k]) used -= e.units;
      ASSERT_OK(a.Free(live[k]));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    ASSERT_EQ(a.free_units(), 10000 - used);
  }
  EXPECT_OK(a.CheckInvariants());
}

}  // namespace
}  // namespace memascend::storage
