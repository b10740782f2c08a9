#include <fstream>
#include <sstream>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/memory_ledger.h>

#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;

MemoryLedger::Options Quiet() { return {.sample_every_update = false, .sample_rss = false}; }

TEST(MemoryLedger, PeaksFollowAHandComputedSchedule) {
  MemoryLedger ledger(Quiet());
  constexpr Tier kPinned = Tier::kPinnedHost;
  // t1: params 100 live / 128 reserved
  ledger.Update(kPinned, {{Use::kParameters, 100, 128}});
  // t2: grads 60/64 while params live: tier 160/192
  ledger.Update(kPinned, {{Use::kGradients, 60, 64}});
  // t3: params released to the cache: tier 60/192
  ledger.Update(kPinned, {{Use::kParameters, -100, -128}, {Use::kCached, 0, 128}});
  // t4: optimizer state 150/160 reuses cached bytes: tier 210/192 reserved
  ledger.Update(kPinned, {{Use::kCached, 0, -128}, {Use::kOptimizerState, 150, 160}});
  // t5: everything freed, the cache keeps 224
  ledger.Update(
      kPinned,
      {{Use::kGradients, -60, -64}, {Use::kOptimizerState, -150, -160}, {Use::kCached, 0, 224}});
  ledger.Update(Tier::kNvme, {{Use::kParameters, 1000, 4096}});

  const LedgerSnapshot s = ledger.Snapshot();
  EXPECT_EQ(s.tier(kPinned).live, 0);
  EXPECT_EQ(s.tier(kPinned).reserved, 224);
  EXPECT_EQ(s.tier(kPinned).live_peak, 210);      // t4: 60 + 150
  EXPECT_EQ(s.tier(kPinned).reserved_peak, 224);  // t5
  // The tier's peak is the peak of its sum, not the sum of per-use peaks (100+60+150).
  EXPECT_EQ(s.use(kPinned, Use::kParameters).live_peak, 100);
  EXPECT_EQ(s.use(kPinned, Use::kGradients).live_peak, 60);
  EXPECT_EQ(s.use(kPinned, Use::kOptimizerState).reserved_peak, 160);
  EXPECT_EQ(s.use(kPinned, Use::kCached).reserved_peak, 224);
  EXPECT_EQ(s.tier(Tier::kNvme).reserved, 4096);
  EXPECT_EQ(s.tier(Tier::kGpu).reserved_peak, 0);
  EXPECT_EQ(ledger.underflows(), 0);
}

TEST(MemoryLedger, TransfersWithinOneUpdateRaiseNoPeak) {
  MemoryLedger ledger(Quiet());
  ledger.Update(Tier::kPinnedHost, {{Use::kCached, 0, 4096}});
  for (int i = 0; i < 10; ++i) {
    ledger.Update(Tier::kPinnedHost, {{Use::kCached, 0, -4096}, {Use::kStaging, 4000, 4096}});
    ledger.Update(Tier::kPinnedHost, {{Use::kStaging, -4000, -4096}, {Use::kCached, 0, 4096}});
  }
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kPinnedHost).reserved_peak, 4096);
}

TEST(MemoryLedger, UnderflowIsClampedAndCounted) {
  MemoryLedger ledger(Quiet());
  ledger.Update(Tier::kGpu, {{Use::kActivations, -5, -5}});
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kGpu).live, 0);
  EXPECT_EQ(ledger.underflows(), 2);
}

TEST(MemoryLedger, ResetPeaksStartsFromNow) {
  MemoryLedger ledger(Quiet());
  ledger.Update(Tier::kPinnedHost, {{Use::kStaging, 100, 100}});
  ledger.Update(Tier::kPinnedHost, {{Use::kStaging, -90, -90}});
  ledger.ResetPeaks();
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kPinnedHost).live_peak, 10);
}

TEST(MemoryLedger, TimelineAsCsv) {
  MemoryLedger ledger(MemoryLedger::Options{.sample_every_update = true, .sample_rss = true});
  ledger.Update(Tier::kPinnedHost, {{Use::kParameters, 10, 4096}});
  ledger.Sample("after, \"forward\"\n");
  const std::vector<LedgerSample> timeline = ledger.Timeline();
  ASSERT_EQ(timeline.size(), 2u);
  EXPECT_EQ(timeline[1].live[static_cast<int>(Tier::kPinnedHost)], 10);
  EXPECT_GT(timeline[1].rss_bytes, 0u);
  EXPECT_GE(timeline[1].seconds, timeline[0].seconds);

  const std::string path = ::testing::TempDir() + "/ledger_" + std::to_string(getpid()) + ".csv";
  ASSERT_OK(ledger.WriteCsv(path));
  std::ifstream in(path);
  std::string header, row0, row1, extra;
  std::getline(in, header);
  std::getline(in, row0);
  std::getline(in, row1);
  EXPECT_FALSE(std::getline(in, extra));
  EXPECT_EQ(header,
            "seconds,label,pinned_host_live,pinned_host_reserved,pageable_host_live,"
            "pageable_host_reserved,gpu_live,gpu_reserved,nvme_live,nvme_reserved,rss_bytes");
  // The label's comma, quotes and newline are neutralised: still 11 fields.
  EXPECT_EQ(std::count(row1.begin(), row1.end(), ','), 10);
  EXPECT_NE(row1.find(",10,4096,0,0,0,0,0,0,"), std::string::npos);
  std::remove(path.c_str());
  EXPECT_THAT(ledger.WriteCsv("/nonexistent-dir/x.csv"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(MemoryLedger, ReadsTheProcessRss) {
  MemoryLedger ledger;
  const LedgerSnapshot s = ledger.Snapshot();
  EXPECT_GT(s.rss_bytes, 0u);
  EXPECT_GE(s.peak_rss_bytes, s.rss_bytes);
}

TEST(MemoryLedger, ConcurrentUpdatesBalance) {
  MemoryLedger ledger(Quiet());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) {
        ledger.Update(Tier::kPinnedHost, {{Use::kStaging, 7, 8}});
        ledger.Update(Tier::kPinnedHost, {{Use::kStaging, -7, -8}});
      }
    });
  }
  for (std::thread& th : threads) th.join();
  const LedgerSnapshot s = ledger.Snapshot();
  EXPECT_EQ(s.tier(Tier::kPinnedHost).live, 0);
  EXPECT_LE(s.tier(Tier::kPinnedHost).live_peak, 4 * 7);
  EXPECT_GE(s.tier(Tier::kPinnedHost).live_peak, 7);
  EXPECT_EQ(ledger.underflows(), 0);
}

}  // namespace
}  // namespace memascend
