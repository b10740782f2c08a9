// memascend/memory_ledger.h: where the memory of a training run goes.
//
// The ledger counts, per tier (pinned host, pageable host, GPU, NVMe) and per use
// (parameters, gradients, optimizer state, staging, ...), the bytes *live* (asked for
// by callers) and *reserved* (held on their behalf: block capacity, cached blocks,
// mapped but uncarved arena space), with current values and peaks. Peaks of a tier
// are peaks of the tier's total at one instant, not sums of per-use peaks. It also
// reads the process's resident set size, and keeps an optional timeline of samples
// that can be written as CSV for plotting.
//
//   memascend::MemoryLedger ledger;
//   ledger.Update(memascend::Tier::kPinnedHost,
//                 {{memascend::Use::kParameters, /*live=*/4096, /*reserved=*/4096}});
//   ledger.Sample("after forward");
//   auto s = ledger.Snapshot();  // s.tier(kPinnedHost).live_peak == 4096
//   MEMASCEND_RETURN_IF_ERROR(ledger.WriteCsv("timeline.csv"));
//
// Thread-safety: every method may be called from any thread; Update() applies all of
// its deltas atomically with respect to peaks and snapshots.
// Lifetime: the allocators that report to a ledger hold a pointer to it; the ledger
// must outlive them.
#ifndef MEMASCEND_MEMORY_LEDGER_H_
#define MEMASCEND_MEMORY_LEDGER_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/status.h>

#include <memascend/types.h>

namespace memascend {

// One change: live and reserved bytes of `use` move by these (signed) amounts.
struct LedgerDelta {
  Use use;
  std::int64_t live = 0;
  std::int64_t reserved = 0;
};

struct LedgerCounters {
  std::int64_t live = 0;
  std::int64_t reserved = 0;
  std::int64_t live_peak = 0;
  std::int64_t reserved_peak = 0;
};

struct LedgerSnapshot {
  std::array<LedgerCounters, kTierCount> tiers{};
  std::array<std::array<LedgerCounters, kUseCount>, kTierCount> uses{};
  std::uint64_t rss_bytes = 0;       // now
  std::uint64_t peak_rss_bytes = 0;  // the process's high-water mark (VmHWM)

  const LedgerCounters& tier(Tier t) const { return tiers[static_cast<int>(t)]; }
  const LedgerCounters& use(Tier t, Use u) const {
    return uses[static_cast<int>(t)][static_cast<int>(u)];
  }
};

struct LedgerSample {
  double seconds = 0;  // since the ledger was created
  std::string label;
  std::array<std::int64_t, kTierCount> live{};
  std::array<std::int64_t, kTierCount> reserved{};
  std::uint64_t rss_bytes = 0;
};

class MemoryLedger {
 public:
  struct Options {
    // Append a timeline sample after every Update() (for plots of a whole run; the
    // timeline grows by one sample per allocation and free).
    bool sample_every_update = false;
    // Read the process RSS in every sample (a /proc read; off for simulations).
    bool sample_rss = true;
  };

  MemoryLedger();
  explicit MemoryLedger(Options options);
  ~MemoryLedger();
  MemoryLedger(const MemoryLedger&) = delete;
  MemoryLedger& operator=(const MemoryLedger&) = delete;

  // Applies the deltas to `tier` at once, then updates its peaks. A counter that
  // would go negative is a caller bug: it is clamped at zero and counted in
  // Snapshot-independent underflows().
  void Update(Tier tier, std::initializer_list<LedgerDelta> deltas);

  // Appends a timeline sample with the current totals (and RSS, per Options).
  void Sample(std::string_view label);

  LedgerSnapshot Snapshot() const;
  std::vector<LedgerSample> Timeline() const;
  std::int64_t underflows() const;

  // Starts the peaks again from the current values (e.g. after warm-up).
  void ResetPeaks();

  // CSV with a header: seconds,label,<tier>_live,<tier>_reserved...,rss_bytes.
  std::string TimelineCsv() const;
  absl::Status WriteCsv(const std::string& path) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace memascend

#endif  // MEMASCEND_MEMORY_LEDGER_H_
