// memascend pool-sim: replays one offloaded training step's host-buffer schedule over a
// workload file against a pinned-memory policy (memory/pool_sim.h).
#include <fmt/format.h>

#include <memascend/memory_ledger.h>
#include <memascend/workload.h>

#include "args.h"
#include "commands.h"
#include "sim/pool_sim.h"
#include "util/units.h"

namespace memascend::cli {
namespace {

constexpr std::string_view kSummary =
    "replay one training step's pinned-buffer schedule (accounting only, no memory used)";

constexpr OptionSpec kOptions[] = {
    {"workload", true, "workload file: name<TAB>shape per tensor (required)"},
    {"policy", true, "memascend | pow2 | zero | all (default memascend)"},
    {"slice-elements", true, "optimizer-step slice in elements (default 16777216)"},
    {"steps", true, "replay the step this many times (default 1)"},
    {"chunk", true, "arena growth step in bytes (default 0: exactly the request)"},
    {"timeline", true, "write the pinned-tier timeline of the last policy run as CSV"},
    {"json", false, "print one JSON object per policy"},
    {"help", false, "show this help"},
};

void PrintRow(const sim::SimResult& r, std::uint64_t zero_reserved) {
  const double over_live = static_cast<double>(r.reserved_peak_bytes) /
                           static_cast<double>(std::max<std::uint64_t>(r.live_peak_bytes, 1));
  std::string vs_zero = "-";
  if (zero_reserved > 0) {
    vs_zero = fmt::format(
        "{:.3f}", static_cast<double>(r.reserved_peak_bytes) / static_cast<double>(zero_reserved));
  }
  fmt::print("{:<14} {:<10} {:>12} {:>12} {:>9.3f} {:>9} {:>8} {:>9} {:>7}\n", r.workload,
             sim::ToString(r.policy), util::FormatBytes(r.live_peak_bytes),
             util::FormatBytes(r.reserved_peak_bytes), over_live, vs_zero, r.regions_mapped,
             r.regions_mapped_last_step, r.classes_used);
}

}  // namespace

int RunPoolSim(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kOptions);
  if (!args.ok() || (!args->Has("workload") && !args->Has("help"))) {
    fmt::print(stderr, "memascend pool-sim: {}\n{}",
               args.ok() ? "--workload is required" : Message(args.status()),
               Usage("pool-sim", kSummary, kOptions));
    return kExitUsage;
  }
  if (args->Has("help")) {
    fmt::print("{}", Usage("pool-sim", kSummary, kOptions));
    return kExitOk;
  }
  std::vector<sim::SimPolicy> policies;
  const std::string policy = args->Get("policy", "memascend");
  if (policy == "all") {
    policies = {sim::SimPolicy::kMemAscend, sim::SimPolicy::kPow2, sim::SimPolicy::kZero};
  } else {
    auto p = sim::ParseSimPolicy(policy);
    if (!p.ok()) {
      fmt::print(stderr, "memascend pool-sim: {}\n", Message(p.status()));
      return kExitUsage;
    }
    policies = {*p};
  }
  sim::SimOptions options;
  auto slice = args->GetInt("slice-elements",
                            static_cast<std::int64_t>(options.schedule.optimizer_slice_elements));
  auto chunk = args->GetBytes("chunk", 0);
  auto steps = args->GetInt("steps", 1);
  if (!steps.ok() || *steps < 1 || *steps > 1000) {
    fmt::print(stderr, "memascend pool-sim: --steps must be an integer in 1..1000\n");
    return kExitUsage;
  }
  options.steps = static_cast<int>(*steps);
  if (!slice.ok() || !chunk.ok() || *slice <= 0) {
    fmt::print(stderr, "memascend pool-sim: {}\n",
               !slice.ok()   ? Message(slice.status())
               : !chunk.ok() ? Message(chunk.status())
                             : std::string("--slice-elements must be positive"));
    return kExitUsage;
  }
  options.schedule.optimizer_slice_elements = static_cast<std::uint64_t>(*slice);
  options.arena_chunk_bytes = *chunk;

  auto workload = LoadWorkload(args->Get("workload"));
  if (!workload.ok()) {
    fmt::print(stderr, "memascend pool-sim: {}\n", Message(workload.status()));
    return kExitFailure;
  }
  const bool json = args->Has("json");
  if (!json) {
    fmt::print("{:<14} {:<10} {:>12} {:>12} {:>9} {:>9} {:>8} {:>9} {:>7}\n", "workload", "policy",
               "live peak", "reserved", "res/live", "res/zero", "regions", "last step", "classes");
  }
  std::vector<sim::SimResult> results;
  for (sim::SimPolicy p : policies) {
    MemoryLedger ledger(
        MemoryLedger::Options{.sample_every_update = args->Has("timeline"), .sample_rss = false});
    options.ledger = &ledger;
    auto r = sim::RunPoolSim(*workload, p, options);
    if (!r.ok()) {
      fmt::print(stderr, "memascend pool-sim: {} policy: {}\n", sim::ToString(p),
                 Message(r.status()));
      return kExitFailure;
    }
    if (args->Has("timeline")) {
      if (const absl::Status s = ledger.WriteCsv(args->Get("timeline")); !s.ok()) {
        fmt::print(stderr, "memascend pool-sim: {}\n", Message(s));
        return kExitFailure;
      }
    }
    results.push_back(*r);
  }
  std::uint64_t zero_reserved = 0;
  for (const auto& r : results) {
    if (r.policy == sim::SimPolicy::kZero) zero_reserved = r.reserved_peak_bytes;
  }
  for (const auto& r : results) {
    if (json) {
      fmt::print("{}\n", sim::ToJson(r));
    } else {
      PrintRow(r, zero_reserved);
    }
  }
  return kExitOk;
}

}  // namespace memascend::cli
