#include <algorithm>
#include <fstream>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/memory_ledger.h>

#include "prim/memory.h"

namespace memascend {

struct MemoryLedger::State {
  explicit State(Options o) : options(o), start(std::chrono::steady_clock::now()) {}

  const Options options;
  const std::chrono::steady_clock::time_point start;
  mutable absl::Mutex mu;
  LedgerSnapshot counters ABSL_GUARDED_BY(mu);
  std::vector<LedgerSample> timeline ABSL_GUARDED_BY(mu);
  std::int64_t underflows ABSL_GUARDED_BY(mu) = 0;

  void AppendSampleLocked(std::string_view label) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    LedgerSample s;
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    s.label = std::string(label);
    for (int t = 0; t < kTierCount; ++t) {
      s.live[t] = counters.tiers[t].live;
      s.reserved[t] = counters.tiers[t].reserved;
    }
    if (options.sample_rss) s.rss_bytes = prim::CurrentRssBytes();
    timeline.push_back(std::move(s));
  }
};

MemoryLedger::MemoryLedger() : MemoryLedger(Options{}) {}
MemoryLedger::MemoryLedger(Options options) : state_(std::make_unique<State>(options)) {}
MemoryLedger::~MemoryLedger() = default;

void MemoryLedger::Update(Tier tier, std::initializer_list<LedgerDelta> deltas) {
  const int t = static_cast<int>(tier);
  absl::MutexLock lock(&state_->mu);
  LedgerSnapshot& c = state_->counters;
  const auto apply = [&](std::int64_t& value, std::int64_t delta) {
    value += delta;
    if (value < 0) {
      ++state_->underflows;
      value = 0;
    }
  };
  for (const LedgerDelta& d : deltas) {
    LedgerCounters& u = c.uses[t][static_cast<int>(d.use)];
    apply(u.live, d.live);
    apply(u.reserved, d.reserved);
    u.live_peak = std::max(u.live_peak, u.live);
    u.reserved_peak = std::max(u.reserved_peak, u.reserved);
  }
  LedgerCounters& total = c.tiers[t];
  total.live = 0;
  total.reserved = 0;
  for (const LedgerCounters& u : c.uses[t]) {
    total.live += u.live;
    total.reserved += u.reserved;
  }
  total.live_peak = std::max(total.live_peak, total.live);
  total.reserved_peak = std::max(total.reserved_peak, total.reserved);
  if (state_->options.sample_every_update) state_->AppendSampleLocked("");
}

void MemoryLedger::Sample(std::string_view label) {
  absl::MutexLock lock(&state_->mu);
  state_->AppendSampleLocked(label);
}

LedgerSnapshot MemoryLedger::Snapshot() const {
  LedgerSnapshot s;
  {
    absl::MutexLock lock(&state_->mu);
    s = state_->counters;
  }
  s.rss_bytes = prim::CurrentRssBytes();
  s.peak_rss_bytes = prim::PeakRssBytes();
  return s;
}

std::vector<LedgerSample> MemoryLedger::Timeline() const {
  absl::MutexLock lock(&state_->mu);
  return state_->timeline;
}

std::int64_t MemoryLedger::underflows() const {
  absl::MutexLock lock(&state_->mu);
  return state_->underflows;
}

void MemoryLedger::ResetPeaks() {
  absl::MutexLock lock(&state_->mu);
  LedgerSnapshot& c = state_->counters;
  for (int t = 0; t < kTierCount; ++t) {
    c.tiers[t].live_peak = c.tiers[t].live;
    c.tiers[t].reserved_peak = c.tiers[t].reserved;
    for (LedgerCounters& u : c.uses[t]) {
      u.live_peak = u.live;
      u.reserved_peak = u.reserved;
    }
  }
}

std::string MemoryLedger::TimelineCsv() const {
  std::string out = "seconds,label";
  for (int t = 0; t < kTierCount; ++t) {
    const std::string_view name = ToString(static_cast<Tier>(t));
    out += fmt::format(",{}_live,{}_reserved", name, name);
  }
  out += ",rss_bytes\n";
  for (const LedgerSample& s : Timeline()) {
    // Labels are the caller's: keep the CSV well-formed whatever they contain.
    std::string label = s.label;
    std::replace_if(
        label.begin(), label.end(), [](char ch) { return ch == ',' || ch == '\n' || ch == '"'; },
        ' ');
    out += fmt::format("{:.6f},{}", s.seconds, label);
    for (int t = 0; t < kTierCount; ++t) out += fmt::format(",{},{}", s.live[t], s.reserved[t]);
    out += fmt::format(",{}\n", s.rss_bytes);
  }
  return out;
}

absl::Status MemoryLedger::WriteCsv(const std::string& path) const {
  std::ofstream file(path, std::ios::trunc);
  if (!file) return absl::ErrnoToStatus(errno, fmt::format("open({})", path));
  file << TimelineCsv();
  file.flush();
  if (!file) return absl::ErrnoToStatus(errno, fmt::format("write({})", path));
  return absl::OkStatus();
}

}  // namespace memascend
