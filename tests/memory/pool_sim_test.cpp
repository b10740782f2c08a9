#include "sim/pool_sim.h"

#include <bit>
#include <fstream>
#include <random>
#include <unistd.h>

#include <gtest/gtest.h>

#include "sim/zero_swap_buffers.h"
#include "testing/status_matchers.h"

namespace memascend::sim {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

// fp16 bytes: embed 8192 | layer 0: 4096 + 8192 | layer 1: 4096 + 8192 | head 8192.
constexpr const char* kTiny =
    "# tiny: 6 tensors\n"
    "embed\t1024,4\n"
    "layers.0.a\t2048\n"
    "layers.0.b\t4096\n"
    "layers.1.a\t2048\n"
    "layers.1.b\t4096\n"
    "head\t1024,4\n";

ScheduleOptions TinyOptions() {
  ScheduleOptions o;
  o.optimizer_slice_elements = 3072;
  return o;
}

TEST(StepSchedule, MatchesTheHandComputedSchedule) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "tiny"));
  ASSERT_OK_AND_ASSIGN(StepSchedule s, BuildStepSchedule(w, TinyOptions()));
  // Forward: G0+G1, then G1+G2 = 12288 + 12288 at most.
  EXPECT_EQ(s.phase_live_peak_bytes[static_cast<int>(Phase::kForward)], 24576u);
  // Backward of layer 1: its params and grads plus layer 0's prefetched params.
  EXPECT_EQ(s.phase_live_peak_bytes[static_cast<int>(Phase::kBackward)], 36864u);
  // Optimizer: a 3072-element slice of a 4096-element tensor, 4 fp32 arrays.
  EXPECT_EQ(s.phase_live_peak_bytes[static_cast<int>(Phase::kOptimizer)], 49152u);
  EXPECT_EQ(s.live_peak_bytes, 49152u);
  // 6 forward + 12 backward + 10 slices x 4 optimizer requests.
  EXPECT_EQ(s.requests, 58u);
  EXPECT_EQ(s.events.size(), 116u);
  EXPECT_EQ(s.request_sizes, (std::vector<std::size_t>{4096, 8192, 12288}));
  // Every allocation is freed, in the step.
  std::int64_t live = 0;
  for (const ScheduleEvent& e : s.events) {
    live += e.kind == ScheduleEvent::Kind::kAlloc ? static_cast<std::int64_t>(e.bytes)
                                                  : -static_cast<std::int64_t>(e.bytes);
    ASSERT_GE(live, 0);
  }
  EXPECT_EQ(live, 0);
}

TEST(StepSchedule, RejectsZeroSlices) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "tiny"));
  ScheduleOptions o;
  o.optimizer_slice_elements = 0;
  EXPECT_THAT(BuildStepSchedule(w, o), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PoolSim, LedgerAgreesWithTheResult) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "tiny"));
  for (SimPolicy p : {SimPolicy::kMemAscend, SimPolicy::kPow2, SimPolicy::kZero}) {
    MemoryLedger ledger(MemoryLedger::Options{.sample_every_update = false, .sample_rss = false});
    SimOptions o;
    o.schedule = TinyOptions();
    o.ledger = &ledger;
    ASSERT_OK_AND_ASSIGN(SimResult r, RunPoolSim(w, p, o));
    const LedgerSnapshot s = ledger.Snapshot();
    EXPECT_EQ(s.tier(Tier::kPinnedHost).reserved_peak,
              static_cast<std::int64_t>(r.reserved_peak_bytes))
        << ToString(p);
    if (p != SimPolicy::kZero) {  // zero's buffers are live for the whole run
      EXPECT_EQ(s.tier(Tier::kPinnedHost).live_peak, static_cast<std::int64_t>(r.live_peak_bytes))
          << ToString(p);
    }
    EXPECT_EQ(s.tier(Tier::kPinnedHost).reserved, 0) << "everything given back at the end";
    EXPECT_EQ(ledger.underflows(), 0);
    EXPECT_GE(r.reserved_peak_bytes, r.live_peak_bytes);
  }
}

TEST(PoolSim, MemAscendHoldsWhatIsInUse) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "tiny"));
  SimOptions o;
  o.schedule = TinyOptions();
  o.steps = 3;
  ASSERT_OK_AND_ASSIGN(SimResult r, RunPoolSim(w, SimPolicy::kMemAscend, o));
  EXPECT_EQ(r.reserved_peak_bytes, r.live_peak_bytes);  // all sizes are 4 KiB multiples
  ASSERT_OK_AND_ASSIGN(SimResult p, RunPoolSim(w, SimPolicy::kPow2, o));
  EXPECT_GT(p.reserved_peak_bytes, r.reserved_peak_bytes);  // 12288 -> 16384 blocks
  EXPECT_EQ(p.regions_mapped_last_step, 0u);                // pow2 caches forever
}

TEST(PoolSim, ZeroPolicySizesBuffersByItsRules) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "tiny"));
  SimOptions o;
  o.schedule = TinyOptions();
  o.zero.param_buffer_elements = 1000;  // raised to the largest tensor: 4096
  o.zero.min_swap_bytes = 8192;
  ASSERT_OK_AND_ASSIGN(SimResult r, RunPoolSim(w, SimPolicy::kZero, o));
  EXPECT_EQ(r.param_buffer_bytes, 8192u);
  EXPECT_EQ(r.optimizer_buffer_bytes, 20480u * 4);  // one sub-group: the whole model
  EXPECT_EQ(r.optimizer_buffers, 4u);
  EXPECT_GE(r.param_buffers, 5u);
  const std::uint64_t buffers = std::bit_ceil(r.param_buffers * r.param_buffer_bytes) +
                                4 * std::bit_ceil(r.optimizer_buffer_bytes);
  EXPECT_GE(r.reserved_peak_bytes, buffers);
}

TEST(ZeroSwapBuffers, SubGroupsPackUntilTheSize) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload("a\t5\nb\t5\nc\t5\n", "x"));
  EXPECT_EQ(ZeroSubGroups(w, 8), (std::vector<std::uint64_t>{10, 5}));
  EXPECT_EQ(ZeroSubGroups(w, 100), (std::vector<std::uint64_t>{15}));
  EXPECT_EQ(ZeroSubGroups(w, 1), (std::vector<std::uint64_t>{5, 5, 5}));
}

TEST(ZeroSwapBuffers, EnforcesBufferSizeAndCount) {
  HostArenaOptions a;
  a.backing = ArenaBacking::kAccounting;
  a.budget_bytes = std::size_t{1} << 40;
  a.chunk_bytes = 0;
  ASSERT_OK_AND_ASSIGN(auto arena, HostArena::Create(a));
  PinnedPoolOptions p;
  p.policy = PoolPolicy::kPow2;
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(arena.get(), p));
  ZeroSwapConfig config;
  config.param_buffer_count = 2;
  config.optimizer_buffer_count = 1;
  ASSERT_OK_AND_ASSIGN(auto z, ZeroSwapBuffers::Create(pool.get(), config, 10, 300'000'000));
  EXPECT_EQ(z->param_buffer_bytes(), 200'000'000u);  // 1e8 elements, fp16
  // One pinned allocation of 2 x 200 MB rounded to 512 MiB, and one of 1.2 GB -> 2 GiB.
  EXPECT_EQ(arena->stats().mapped_bytes, (std::size_t{512} << 20) + (std::size_t{2} << 30));
  EXPECT_THAT(z->Acquire(ZeroSwapBuffers::Kind::kParameter, 200'000'001),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("More elements")));
  ASSERT_OK_AND_ASSIGN(auto b0, z->Acquire(ZeroSwapBuffers::Kind::kParameter, 100));
  ASSERT_OK_AND_ASSIGN(auto b1, z->Acquire(ZeroSwapBuffers::Kind::kParameter, 100));
  EXPECT_EQ(b1.data - b0.data, 200'000'000);
  EXPECT_THAT(z->Acquire(ZeroSwapBuffers::Kind::kParameter, 100),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("buffer_count")));
  ASSERT_OK(z->Release(b0));
  EXPECT_THAT(z->Release(b0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(z->Release(b1));
}

// The targets of the host-memory issue, on every shipped workload: deterministic
// accounting, so an exact check rather than a timed one.
TEST(PoolSim, TargetsOnTheShippedWorkloads) {
  for (const char* name : {"gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                           "mistral-7b", "opt-13b", "qwen2.5-7b"}) {
    ASSERT_OK_AND_ASSIGN(Workload w, LoadWorkload(std::string(MEMASCEND_TEST_DATA_DIR) +
                                                  "/workloads/" + name + ".tsv"));
    ASSERT_OK_AND_ASSIGN(SimResult m, RunPoolSim(w, SimPolicy::kMemAscend, SimOptions{}));
    ASSERT_OK_AND_ASSIGN(SimResult p, RunPoolSim(w, SimPolicy::kPow2, SimOptions{}));
    ASSERT_OK_AND_ASSIGN(SimResult z, RunPoolSim(w, SimPolicy::kZero, SimOptions{}));
    EXPECT_EQ(m.live_peak_bytes, z.live_peak_bytes);
    EXPECT_LE(static_cast<double>(m.reserved_peak_bytes),
              1.02 * static_cast<double>(m.live_peak_bytes))
        << name;
    EXPECT_LE(static_cast<double>(m.reserved_peak_bytes),
              0.40 * static_cast<double>(z.reserved_peak_bytes))
        << name;
    EXPECT_LT(m.reserved_peak_bytes, p.reserved_peak_bytes) << name;
  }
}

// Models the pool was never told about: random shapes, written as workload files.
TEST(PoolSim, AdaptsToWorkloadsItHasNeverSeen) {
  for (unsigned seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    const auto pick = [&](int lo, int hi) { return lo + static_cast<int>(rng() % (hi - lo + 1)); };
    const int hidden = 128 * pick(4, 40);
    const int ffn = hidden * pick(2, 4) + 64 * pick(0, 8);
    const int vocab = pick(1000, 160000);
    const int layers = pick(2, 40);
    const std::string path = ::testing::TempDir() + "/unseen_" + std::to_string(getpid()) + "_" +
                             std::to_string(seed) + ".tsv";
    {
      std::ofstream f(path);
      f << "# unseen-" << seed << ": random model\n";
      f << "embed.weight\t" << vocab << "," << hidden << "\n";
      for (int l = 0; l < layers; ++l) {
        f << "blocks." << l << ".attn.qkv\t" << 3 * hidden << "," << hidden << "\n";
        f << "blocks." << l << ".attn.out\t" << hidden << "," << hidden << "\n";
        f << "blocks." << l << ".mlp.up\t" << ffn << "," << hidden << "\n";
        f << "blocks." << l << ".mlp.down\t" << hidden << "," << ffn << "\n";
        f << "blocks." << l << ".norm\t" << hidden << "\n";
      }
      f << "head.weight\t" << vocab << "," << hidden << "\n";
    }
    ASSERT_OK_AND_ASSIGN(Workload w, LoadWorkload(path));
    std::remove(path.c_str());
    ASSERT_OK_AND_ASSIGN(SimResult m, RunPoolSim(w, SimPolicy::kMemAscend, SimOptions{}));
    EXPECT_LE(static_cast<double>(m.reserved_peak_bytes),
              1.02 * static_cast<double>(m.live_peak_bytes))
        << "seed " << seed << " hidden " << hidden << " ffn " << ffn << " vocab " << vocab;
  }
}

}  // namespace
}  // namespace memascend::sim
