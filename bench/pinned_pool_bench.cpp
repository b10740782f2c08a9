// Pinned pool hit path vs what a caller does without a pool: malloc + mlock, then
// munlock + free, for the same size. Single thread and two threads (real time).
// After the runs it prints the ratio baseline / pool per size and thread count.
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <sys/mman.h>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/memory_ledger.h>
#include <memascend/pinned_pool.h>

namespace memascend {
namespace {

struct Shared {
  MemoryLedger ledger{MemoryLedger::Options{.sample_every_update = false, .sample_rss = false}};
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<PinnedPool> pool;
  Shared() {
    HostArenaOptions a;
    a.backing = ArenaBacking::kMlock;
    a.budget_bytes = std::size_t{1} << 30;
    a.chunk_bytes = 0;
    a.ledger = &ledger;
    arena = *HostArena::Create(a);
    PinnedPoolOptions p;
    p.expected_sizes = {64 << 10, 1 << 20, 32 << 20};
    pool = *PinnedPool::Create(arena.get(), p);
  }
};

Shared& Get() {
  static Shared* shared = new Shared();  // benchmark-only process state
  return *shared;
}

void BM_PoolHit(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  PinnedPool& pool = *Get().pool;
  {  // warm the class so the loop measures the hit path
    auto warm = pool.Allocate(bytes);
    if (!warm.ok()) state.SkipWithError(std::string(warm.status().message()).c_str());
  }
  for (auto _ : state) {
    auto block = pool.Allocate(bytes, Use::kStaging);
    benchmark::DoNotOptimize(block->data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

void BM_MallocMlock(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    if (p == nullptr || mlock(p, bytes) != 0) {
      state.SkipWithError("malloc/mlock failed (raise RLIMIT_MEMLOCK)");
      std::free(p);
      break;
    }
    benchmark::DoNotOptimize(p);
    munlock(p, bytes);
    std::free(p);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

void Sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t s : {64 << 10, 1 << 20, 32 << 20}) b->Arg(s);
  b->Threads(1)->Threads(2)->UseRealTime();
}
BENCHMARK(BM_PoolHit)->Apply(Sizes);
BENCHMARK(BM_MallocMlock)->Apply(Sizes);

// Console output as usual, plus the per-iteration real time of every run kept aside.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Iteration && run.iterations > 0 && !run.error_occurred) {
        ns_[run.benchmark_name()] = run.GetAdjustedRealTime();
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void PrintRatios() const {
    fmt::print("\n{:<10} {:>8} {:>14} {:>18} {:>10}\n", "size", "threads", "pool hit (ns)",
               "malloc+mlock (ns)", "ratio");
    for (const char* size : {"65536", "1048576", "33554432"}) {
      for (const char* threads : {"1", "2"}) {
        const std::string suffix = fmt::format("/{}/real_time/threads:{}", size, threads);
        const auto pool = ns_.find("BM_PoolHit" + suffix);
        const auto base = ns_.find("BM_MallocMlock" + suffix);
        if (pool == ns_.end() || base == ns_.end()) continue;
        fmt::print("{:<10} {:>8} {:>14.1f} {:>18.1f} {:>9.1f}x\n", size, threads, pool->second,
                   base->second, base->second / pool->second);
      }
    }
  }

 private:
  std::map<std::string, double> ns_;
};

}  // namespace
}  // namespace memascend

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  memascend::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
