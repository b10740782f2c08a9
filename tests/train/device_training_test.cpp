// Parameters to the device and gradients from it (memascend/device_training.h): the
// scheduling over the host emulation everywhere, and the same on a GPU where there is one.
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/device_training.h>
#include <memascend/offloaded_optimizer.h>

#include "prim/cuda_memory.h"
#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"
#include "train/state_test_util.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kPart = std::size_t{1} << 16;

// Five groups of different sizes, bf16 parameters and gradients, every one stored.
StateLayout Layout() {
  StateLayout l;
  l.groups = {{"embed", 3 * kPart + 1000, true},
              {"block.0", kPart + 17, true},
              {"block.1", kPart + 17, true},
              {"block.2", kPart + 17, true},
              {"head", 2 * kPart, true}};
  l.param_dtype = DType::kBF16;
  l.grad_dtype = DType::kBF16;
  l.part_elements = kPart;
  return l;
}

std::size_t GroupBytes(const StateLayout& l, std::size_t g) { return l.groups[g].elements * 2; }

std::vector<float> Values(std::size_t n, std::uint64_t seed, float sd) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<std::uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> out(v.size());
  EXPECT_OK(Convert({v.data(), v.size(), DType::kF32}, {out.data(), out.size(), DType::kBF16}, {}));
  return out;
}

// An optimizer over a store on a file volume, its state initialised (seed `seed`).
struct Trainer : ::memascend::testing::OpenedState {
  ScratchPath path;
  StateLayout layout = Layout();
  KernelThreads threads{2};
  std::unique_ptr<OffloadedAdam> adam;

  explicit Trainer(const std::string& name, std::size_t budget_factor = 4, StateLayout l = Layout())
      : path(name), layout(std::move(l)) {
    TensorStoreOptions so;
    so.host_budget_bytes = budget_factor * OffloadedAdam::MinimumHostBudget(layout) / 2;
    so.defer_prefetches = true;
    EXPECT_OK(::memascend::testing::OpenState(path.path(), 64 << 20, layout, so, this));
    OffloadedAdamOptions o;
    o.lr = 1e-3f;
    o.weight_decay = 0.01f;
    o.scaler.initial_scale = 1.0f;
    o.scaler.min_scale = 1.0f;
    o.scaler.growth_interval = INT64_MAX;
    auto a = OffloadedAdam::Create(state.get(), o, &threads);
    EXPECT_OK(a.status());
    adam = *std::move(a);
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      EXPECT_OK(adam->Initialize(g, Values(layout.groups[g].elements, 7 + g, 0.02f)));
    }
    EXPECT_OK(adam->Commit(0));
  }
  ~Trainer() {
    if (adam) {
      EXPECT_OK(adam->Settle());
    }
    adam.reset();
  }
  std::vector<std::uint16_t> Stored(std::size_t g) {
    std::vector<std::uint16_t> out(layout.groups[g].elements);
    EXPECT_OK(adam->LoadParameters(g, {out.data(), out.size(), DType::kBF16}));
    return out;
  }
  // One step with every group's gradient given by `set` (g, bf16 gradient).
  template <typename Set>
  void Step(int step, Set&& set) {
    adam->BeginBackward();
    for (std::size_t g = layout.groups.size(); g-- > 0;) {  // backward order
      set(g, ToBf16(Values(layout.groups[g].elements, 100 * static_cast<std::uint64_t>(step) + g,
                           0.05f)));
    }
    auto plan = adam->EndBackward();
    ASSERT_OK(plan.status());
    ASSERT_FALSE(plan->skipped);
    ASSERT_OK(adam->UpdateAll());
    ASSERT_OK(adam->Commit(static_cast<std::uint64_t>(step)));
  }
};

DeviceParametersOptions Emulated(std::size_t budget, std::size_t read_ahead = 0) {
  DeviceParametersOptions o;
  o.device_budget_bytes = budget;
  o.read_ahead_bytes = read_ahead;
  o.emulate_on_host = true;
  return o;
}

std::vector<std::uint16_t> Bytes16(const DeviceView& v) {
  std::vector<std::uint16_t> out(v.elements);
  std::memcpy(out.data(), v.data, v.elements * 2);
  return out;
}

// ---- parameters to the device ------------------------------------------------------------

// A group arrives whole, its parts copied as runs of adjacent host blocks (one copy a run).
TEST(DeviceParameters, AGroupIsItsStoredParametersWholeAndContiguous) {
  Trainer t("device_params_whole");
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20));
  ASSERT_OK(params.status());
  std::uint64_t runs = 0, parts = 0;
  for (std::size_t g = 0; g < t.layout.groups.size(); ++g) {
    auto v = (*params)->Acquire(g, {});
    ASSERT_OK(v.status());
    EXPECT_EQ(v->elements, t.layout.groups[g].elements);
    EXPECT_EQ(v->dtype, DType::kBF16);
    EXPECT_EQ(Bytes16(*v), t.Stored(g)) << g;
    ASSERT_OK((*params)->Release(g, {}));
    // Where the parts were read from (resident still: the budget holds the state).
    std::vector<StateBuffer> held;
    for (std::size_t part = 0; part < t.layout.Parts(g); ++part) {
      ASSERT_OK_AND_ASSIGN(StateBuffer b, t.adam->ReadParameters(g, part));
      runs += held.empty() || held.back().data + held.back().bytes != b.data;
      held.push_back(std::move(b));
    }
    parts += held.size();
  }
  const DeviceParametersStats s = (*params)->stats();
  EXPECT_EQ(s.acquires, 5u);
  EXPECT_EQ(s.misses, 5u);  // the first pass records the order: nothing is read ahead
  EXPECT_EQ(s.recorded_groups, 5u);
  EXPECT_EQ(s.copies, runs);
  EXPECT_LT(s.copies, parts);  // the store allocated some group's parts one after another
  std::uint64_t bytes = 0;
  for (std::size_t g = 0; g < t.layout.groups.size(); ++g) bytes += GroupBytes(t.layout, g);
  EXPECT_EQ(s.bytes_to_device, bytes);
}

TEST(DeviceParameters, ReadsAheadAlongTheRecordedOrderInBothDirections) {
  Trainer t("device_params_ahead");
  // Room for every group; read ahead at most the two block groups' bytes.
  const std::size_t ahead = GroupBytes(t.layout, 1) + GroupBytes(t.layout, 2);
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20, ahead));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  for (std::size_t g = 0; g < 5; ++g) {  // the first forward pass: recorded
    ASSERT_OK(p.Acquire(g, {}).status());
    ASSERT_OK(p.Release(g, {}));
  }
  for (std::size_t g = 0; g < 5; ++g) ASSERT_OK(p.Invalidate(g));  // an update
  // The second forward pass: acquiring the embedding reads blocks 0 and 1 ahead (the
  // window's bytes), each acquire after that moves the window on.
  ASSERT_OK(p.Acquire(0, {}).status());
  EXPECT_EQ(p.stats().read_ahead, 2u);
  ASSERT_OK(p.Release(0, {}));
  for (std::size_t g = 1; g < 5; ++g) {
    const auto before = p.stats();
    auto v = p.Acquire(g, {});
    ASSERT_OK(v.status());
    EXPECT_EQ(p.stats().hits, before.hits + 1) << "group " << g << " was read ahead";
    EXPECT_EQ(Bytes16(*v), t.Stored(g));
    ASSERT_OK(p.Release(g, {}));
  }
  // Backward: the reverse of the recorded order.
  for (std::size_t g = 0; g < 5; ++g) ASSERT_OK(p.Invalidate(g));
  const auto before = p.stats();
  ASSERT_OK(p.Acquire(4, {}, PassDirection::kBackward).status());
  ASSERT_OK(p.Release(4, {}));
  EXPECT_EQ(p.stats().misses, before.misses + 1);
  for (std::size_t g = 4; g-- > 1;) {
    const auto b = p.stats();
    ASSERT_OK(p.Acquire(g, {}, PassDirection::kBackward).status());
    EXPECT_EQ(p.stats().hits, b.hits + 1) << "group " << g << " was read ahead backwards";
    ASSERT_OK(p.Release(g, {}));
  }
}

TEST(DeviceParameters, AGroupReadAheadIsNeverEvictedBeforeItsUse) {
  Trainer t("device_params_keep");
  // Room for the embedding and two blocks; the read-ahead may take two blocks.
  const std::size_t budget = GroupBytes(t.layout, 0) + 2 * GroupBytes(t.layout, 1) + 4096;
  auto params =
      DeviceParameters::Create(t.adam.get(), Emulated(budget, 2 * GroupBytes(t.layout, 1) + 1024));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  for (int pass = 0; pass < 4; ++pass) {
    const bool forward = pass % 2 == 0;
    for (std::size_t i = 0; i < 5; ++i) {
      const std::size_t g = forward ? i : 4 - i;
      auto v = p.Acquire(g, {}, forward ? PassDirection::kForward : PassDirection::kBackward);
      ASSERT_OK(v.status()) << "pass " << pass << " group " << g;
      EXPECT_EQ(Bytes16(*v), t.Stored(g));
      ASSERT_OK(p.Release(g, {}));
    }
  }
  const auto s = p.stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_LE(s.peak_resident_bytes, budget);
  // Every group read ahead was used before it went: as many hits as reads ahead, or more.
  EXPECT_GE(s.hits, s.read_ahead);
}

// A group used twice in a pass (an output head tied to the embedding): the recorded pass
// keeps both uses, so the second is read ahead or kept, not evicted for groups used later.
TEST(DeviceParameters, AGroupUsedTwiceInAPassIsThereForItsSecondUse) {
  Trainer t("device_params_tied");
  // Room for the embedding, two blocks and the head: never for all five.
  const std::size_t budget =
      GroupBytes(t.layout, 0) + 2 * GroupBytes(t.layout, 1) + GroupBytes(t.layout, 4) + 4096;
  auto params =
      DeviceParameters::Create(t.adam.get(), Emulated(budget, 2 * GroupBytes(t.layout, 1) + 1024));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  const std::vector<std::size_t> forward = {0, 1, 2, 3, 4, 0};  // the head is the embedding
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < forward.size(); ++i) {
      const std::size_t g = forward[i];
      const auto before = p.stats();
      auto v = p.Acquire(g, {});
      ASSERT_OK(v.status());
      EXPECT_EQ(Bytes16(*v), t.Stored(g));
      if (step > 0 && i == forward.size() - 1) {
        EXPECT_EQ(p.stats().hits, before.hits + 1) << "step " << step;
      }
      ASSERT_OK(p.Release(g, {}));
    }
    for (std::size_t i = forward.size(); i-- > 0;) {
      const std::size_t g = forward[i];
      auto v = p.Acquire(g, {}, PassDirection::kBackward);
      ASSERT_OK(v.status()) << "step " << step << " group " << g;
      EXPECT_EQ(Bytes16(*v), t.Stored(g));
      ASSERT_OK(p.Release(g, {}));
    }
  }
  const auto s = p.stats();
  EXPECT_EQ(s.recorded_groups, 6u);  // the forward pass, the embedding's two uses in it
  EXPECT_GT(s.evictions, 0u);
  EXPECT_LE(s.peak_resident_bytes, budget);
}

// Forward passes only (an evaluation): the recording ends where the first pass repeats.
TEST(DeviceParameters, ForwardPassesAloneRecordOnePass) {
  Trainer t("device_params_eval");
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  for (int pass = 0; pass < 5; ++pass) {
    for (std::size_t g = 0; g < 5; ++g) {
      ASSERT_OK(p.Acquire(g, {}).status());
      ASSERT_OK(p.Release(g, {}));
    }
  }
  EXPECT_EQ(p.stats().recorded_groups, 5u);
  // Passes that follow no recorded order (each group alone, backward only) change nothing.
  for (std::size_t g = 5; g-- > 0;) {
    ASSERT_OK(p.Acquire(g, {}, PassDirection::kBackward).status());
    ASSERT_OK(p.Release(g, {}));
  }
  EXPECT_EQ(p.stats().recorded_groups, 5u);
}

// A model of units as memascend.torch acquires them: an embedding tied to the output head,
// four decoder layers of three groups each, a norm. Forward: the units in order; backward:
// the units in reverse, a unit's groups still in their forward order (the recorded pass
// reaches a unit at its first group).
struct Units {
  static constexpr std::size_t kLayers = 4;
  static StateLayout Layout() {
    StateLayout l;
    l.groups.push_back({"embed", 2 * kPart, true});
    for (std::size_t i = 0; i < kLayers; ++i) {
      for (std::size_t j = 0; j < 3; ++j) {
        l.groups.push_back(
            {"layer" + std::to_string(i) + "." + std::to_string(j), kPart / 2 + 64 * j, true});
      }
    }
    l.groups.push_back({"norm", 512, true});
    l.param_dtype = DType::kBF16;
    l.grad_dtype = DType::kBF16;
    l.part_elements = kPart;
    return l;
  }
  static std::vector<std::vector<std::size_t>> Forward() {
    std::vector<std::vector<std::size_t>> u = {{0}};
    for (std::size_t i = 0; i < kLayers; ++i) u.push_back({1 + 3 * i, 2 + 3 * i, 3 + 3 * i});
    u.push_back({1 + 3 * kLayers});
    u.push_back({0});  // the tied head
    return u;
  }
  // One pass; the misses it took. `units`: how many of the forward's to run.
  static std::uint64_t Pass(Trainer& t, DeviceParameters& p, bool forward,
                            std::size_t units = SIZE_MAX) {
    const auto before = p.stats().misses;
    auto order = Forward();
    order.resize(std::min(units, order.size()));
    if (!forward) std::reverse(order.begin(), order.end());
    const PassDirection d = forward ? PassDirection::kForward : PassDirection::kBackward;
    for (const auto& unit : order) {
      for (std::size_t g : unit) {
        auto v = p.Acquire(g, {}, d);
        EXPECT_OK(v.status()) << g;
        if (!v.ok()) return 1000;
        EXPECT_EQ(Bytes16(*v), t.Stored(g)) << g;
      }
      for (std::size_t g : unit) EXPECT_OK(p.Release(g, {}));
    }
    return p.stats().misses - before;
  }
  static std::size_t Largest(const StateLayout& l) {
    std::size_t largest = 0;
    for (const auto& unit : Forward()) {
      std::size_t b = 0;
      for (std::size_t g : unit) b += GroupBytes(l, g);
      largest = std::max(largest, b);
    }
    return largest;
  }
  // memascend.torch's default budget: the largest unit twice, and twice more read ahead.
  static std::unique_ptr<DeviceParameters> DefaultBudget(Trainer& t) {
    const std::size_t largest = Largest(t.layout);
    auto params = DeviceParameters::Create(t.adam.get(), Emulated(4 * largest, 2 * largest));
    EXPECT_OK(params.status());
    return params.ok() ? *std::move(params) : nullptr;
  }
};

// memascend.torch's default budget: after the first step every acquire finds its group there,
// backward as forward.
TEST(DeviceParameters, UnitsFindTheirGroupsReadAheadInBothPasses) {
  Trainer t("device_params_units", 4, Units::Layout());
  auto params = Units::DefaultBudget(t);
  ASSERT_NE(params, nullptr);
  DeviceParameters& p = *params;
  for (int step = 0; step < 4; ++step) {
    const std::uint64_t forward = Units::Pass(t, p, true);
    const std::uint64_t backward = Units::Pass(t, p, false);
    if (step > 0) {
      EXPECT_EQ(forward, 0u) << "step " << step;
      EXPECT_EQ(backward, 0u) << "step " << step;
    }
  }
  EXPECT_GT(p.stats().evictions, 0u);
  EXPECT_EQ(p.stats().recorded_groups, 1 + 3 * Units::kLayers + 2);
}

// A first forward pass cut short (an out-of-memory error, retried): the next passes add
// what it missed where they meet it, and read ahead along the whole. The head's second use
// of the embedding is not added (a forward pass that meets a group it has passed begins
// anew), so the passes are found again at the norm.
TEST(DeviceParameters, AFirstPassCutShortIsCompletedByTheNext) {
  Trainer t("device_params_cut", 4, Units::Layout());
  auto params = Units::DefaultBudget(t);
  ASSERT_NE(params, nullptr);
  DeviceParameters& p = *params;
  Units::Pass(t, p, true, 2);  // the embedding and one layer
  for (int step = 0; step < 4; ++step) {
    const std::uint64_t forward = Units::Pass(t, p, true);
    const std::uint64_t backward = Units::Pass(t, p, false);
    if (step > 1) {  // of 30 acquires, only around the tied head, whose repeat is unknown
      EXPECT_LE(forward + backward, 2u) << "step " << step;
    }
  }
  EXPECT_EQ(p.stats().recorded_groups, 1 + 3 * Units::kLayers + 1);  // the tied head's repeat
                                                                     // is not known
}

// The group at the cursor acquired again (a tied unit run twice) reads nothing new ahead.
TEST(DeviceParameters, AGroupAcquiredAgainKeepsThePassWhereItIs) {
  Trainer t("device_params_again", 4, Units::Layout());
  auto params = Units::DefaultBudget(t);
  ASSERT_NE(params, nullptr);
  DeviceParameters& p = *params;
  for (int step = 0; step < 2; ++step) {
    Units::Pass(t, p, true);
    Units::Pass(t, p, false);
  }
  const auto before = p.stats();
  ASSERT_OK(p.Acquire(0, {}, PassDirection::kBackward).status());  // the embedding again
  ASSERT_OK(p.Release(0, {}));
  EXPECT_EQ(p.stats().read_ahead, before.read_ahead);
  EXPECT_EQ(p.stats().evictions, before.evictions);
}

TEST(DeviceParameters, ABudgetFullOfAcquiredGroupsSaysSo) {
  Trainer t("device_params_full");
  const std::size_t budget = GroupBytes(t.layout, 0) + GroupBytes(t.layout, 1) + 1024;
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(budget));
  ASSERT_OK(params.status());
  ASSERT_OK((*params)->Acquire(0, {}).status());
  ASSERT_OK((*params)->Acquire(1, {}).status());
  EXPECT_THAT((*params)->Acquire(4, {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("are acquired")));
  // Nothing leaked: after the releases the group fits.
  ASSERT_OK((*params)->Release(0, {}));
  ASSERT_OK((*params)->Release(1, {}));
  EXPECT_OK((*params)->Acquire(4, {}).status());
}

TEST(DeviceParameters, MisuseIsRefusedWithAReason) {
  Trainer t("device_params_misuse");
  EXPECT_THAT(DeviceParameters::Create(t.adam.get(), Emulated(1024)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("largest group")));
  {  // no budget: CopyTo only
    auto copy_only = DeviceParameters::Create(t.adam.get(), Emulated(0));
    ASSERT_OK(copy_only.status());
    EXPECT_THAT((*copy_only)->Acquire(0, {}),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CopyTo only")));
    std::vector<std::uint16_t> out(t.layout.groups[1].elements);
    ASSERT_OK((*copy_only)->CopyTo(1, reinterpret_cast<std::byte*>(out.data()), {}));
    EXPECT_EQ(out, t.Stored(1));
  }
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  EXPECT_THAT(p.Acquire(5, {}), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(p.Release(1, {}), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(p.Acquire(1, {}).status());
  EXPECT_THAT(p.Invalidate(1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("while acquired")));
  ASSERT_OK(p.Release(1, {}));
  EXPECT_OK(p.Invalidate(1));
  EXPECT_THAT(p.CopyTo(1, nullptr, {}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DeviceParameters, DerivedParametersAreRefused) {
  ScratchPath path("device_params_derived");
  StateLayout l = Layout();
  l.groups[2].store_parameters = false;
  ::memascend::testing::OpenedState o;
  TensorStoreOptions so;
  so.host_budget_bytes = 2 * OffloadedAdam::MinimumHostBudget(l);
  ASSERT_OK(::memascend::testing::OpenState(path.path(), 64 << 20, l, so, &o));
  KernelThreads threads(1);
  auto adam = OffloadedAdam::Create(o.state.get(), {}, &threads);
  ASSERT_OK(adam.status());
  EXPECT_THAT(DeviceParameters::Create(adam->get(), Emulated(8 << 20)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("block.1")));
}

TEST(DeviceParameters, AfterAnUpdateTheNewParametersArrive) {
  Trainer t("device_params_update");
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  std::vector<std::vector<std::uint16_t>> kept(5);  // parameters the caller keeps itself
  for (std::size_t g = 0; g < 5; ++g) {
    auto v = p.Acquire(g, {});
    ASSERT_OK(v.status());
    kept[g] = Bytes16(*v);
    ASSERT_OK(p.Release(g, {}));
  }
  t.Step(1, [&](std::size_t g, const std::vector<std::uint16_t>& grad) {
    for (std::size_t part = 0; part < t.layout.Parts(g); ++part) {
      const auto [b, e] = t.layout.PartRange(g, part);
      ASSERT_OK(t.adam->SetGradient(g, part, {grad.data() + b, e - b, DType::kBF16}));
    }
  });
  for (std::size_t g = 0; g < 5; ++g) {
    ASSERT_OK(p.Invalidate(g));
    const std::vector<std::uint16_t> now = t.Stored(g);
    EXPECT_NE(now, kept[g]);
    auto v = p.Acquire(g, {});
    ASSERT_OK(v.status());
    EXPECT_EQ(Bytes16(*v), now);
    ASSERT_OK(p.Release(g, {}));
    ASSERT_OK(p.CopyTo(g, reinterpret_cast<std::byte*>(kept[g].data()), {}));
    EXPECT_EQ(kept[g], now);
  }
  EXPECT_EQ(p.stats().invalidations, 5u);
}

// Note [optimizer overlap]: the update of step s interleaved with the forward pass of step
// s + 1, group by group. A group the update has reached comes with its new parameters
// (before the commit); the read-ahead stops at the first group it has not reached.
TEST(DeviceParameters, AnUpdateInterleavedWithThePassGivesTheNewParameters) {
  Trainer t("device_params_overlap");
  auto params = DeviceParameters::Create(t.adam.get(), Emulated(8 << 20));
  ASSERT_OK(params.status());
  DeviceParameters& p = **params;
  for (std::size_t g = 0; g < 5; ++g) {  // the first pass: the order recorded
    ASSERT_OK(p.Acquire(g, {}).status());
    ASSERT_OK(p.Release(g, {}));
  }
  std::vector<std::vector<std::uint16_t>> before(5);
  for (std::size_t g = 0; g < 5; ++g) before[g] = t.Stored(g);
  t.adam->BeginBackward();
  for (std::size_t g = 0; g < 5; ++g) {
    const auto grad = ToBf16(Values(t.layout.groups[g].elements, 500 + g, 0.05f));
    for (std::size_t part = 0; part < t.layout.Parts(g); ++part) {
      const auto [b, e] = t.layout.PartRange(g, part);
      ASSERT_OK(t.adam->SetGradient(g, part, {grad.data() + b, e - b, DType::kBF16}));
    }
  }
  ASSERT_OK(t.adam->EndBackward().status());
  const std::uint64_t ahead_before = p.stats().read_ahead;
  for (std::size_t g = 0; g < 5; ++g) {
    EXPECT_TRUE(t.adam->UpdatePendingFor(g));
    ASSERT_OK(t.adam->UpdateGroup(g));
    EXPECT_FALSE(t.adam->UpdatePendingFor(g));
    ASSERT_OK(p.Invalidate(g));
    auto v = p.Acquire(g, {});
    ASSERT_OK(v.status());
    const std::vector<std::uint16_t> now = t.Stored(g);  // LoadParameters: the newest
    EXPECT_NE(now, before[g]);
    EXPECT_EQ(Bytes16(*v), now) << g;
    ASSERT_OK(p.Release(g, {}));
  }
  // Every group read ahead would have been read before its update: none was.
  EXPECT_EQ(p.stats().read_ahead, ahead_before);
  ASSERT_OK(t.adam->Commit(1));
  for (std::size_t g = 0; g < 5; ++g) {
    auto v = p.Acquire(g, {});
    ASSERT_OK(v.status());
    EXPECT_EQ(Bytes16(*v), t.Stored(g));
    ASSERT_OK(p.Release(g, {}));
  }
}

// ---- gradients from the device ---------------------------------------------------------

DeviceGradientsOptions EmulatedGradients(std::size_t inflight = 0) {
  DeviceGradientsOptions o;
  o.max_inflight_bytes = inflight;
  o.emulate_on_host = true;
  return o;
}

// Three steps with gradients offloaded against three with SetGradient: the same bits.
void ExpectOffloadTrainsAsSetGradient(std::size_t inflight, const char* set_name,
                                      const char* offload_name) {
  Trainer a(set_name), b(offload_name);
  auto grads = DeviceGradients::Create(b.adam.get(), EmulatedGradients(inflight));
  ASSERT_OK(grads.status());
  for (int step = 1; step <= 3; ++step) {
    a.Step(step, [&](std::size_t g, const std::vector<std::uint16_t>& grad) {
      for (std::size_t part = 0; part < a.layout.Parts(g); ++part) {
        const auto [lo, hi] = a.layout.PartRange(g, part);
        ASSERT_OK(a.adam->SetGradient(g, part, {grad.data() + lo, hi - lo, DType::kBF16}));
      }
    });
    std::vector<std::vector<std::uint16_t>> device(5);  // "device" memory, kept to the end
    b.Step(step, [&](std::size_t g, const std::vector<std::uint16_t>& grad) {
      device[g] = grad;
      auto fence = (*grads)->Offload(g, {device[g].data(), grad.size(), DType::kBF16}, {});
      ASSERT_OK(fence.status());
      if (g == 0) {
        ASSERT_OK((*grads)->Finish());
      }
    });
  }
  for (std::size_t g = 0; g < 5; ++g) EXPECT_EQ(a.Stored(g), b.Stored(g)) << g;
  const auto s = (*grads)->stats();
  EXPECT_EQ(s.groups, 15u);
  EXPECT_EQ(s.bytes_from_device, 3 * 2 * a.layout.TotalElements());
}

TEST(DeviceGradients, OffloadedGradientsTrainAsSetGradient) {
  ExpectOffloadTrainsAsSetGradient(0, "device_grads_set", "device_grads_offload");
}

TEST(DeviceGradients, OnePartInFlightStillTrainsTheSame) {
  ExpectOffloadTrainsAsSetGradient(kPart * 2, "device_grads_one_set", "device_grads_one_offload");
}

TEST(DeviceGradients, MisuseIsRefusedWithAReason) {
  Trainer t("device_grads_misuse");
  auto grads = DeviceGradients::Create(t.adam.get(), EmulatedGradients());
  ASSERT_OK(grads.status());
  std::vector<std::uint16_t> g1(t.layout.groups[1].elements);
  std::vector<float> f1(t.layout.groups[1].elements);
  t.adam->BeginBackward();
  EXPECT_THAT((*grads)->Offload(7, {g1.data(), g1.size(), DType::kBF16}, {}),
              StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT((*grads)->Offload(1, {g1.data(), g1.size() - 1, DType::kBF16}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("elements")));
  EXPECT_THAT((*grads)->Offload(1, {f1.data(), f1.size(), DType::kF32}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("convert it on the device")));
  ASSERT_OK((*grads)->Offload(1, {g1.data(), g1.size(), DType::kBF16}, {}).status());
  EXPECT_THAT((*grads)->Offload(1, {g1.data(), g1.size(), DType::kBF16}, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("twice")));
  ASSERT_OK((*grads)->Finish());
  // A step's group is sent once (OffloadedAdam Note [every part once]), Finish or not.
  EXPECT_THAT((*grads)->Offload(1, {g1.data(), g1.size(), DType::kBF16}, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("twice this step")));
  ASSERT_OK((*grads)->Finish());
}

// ---- the same on a GPU -----------------------------------------------------------------

#if MEMASCEND_HAVE_CUDA
struct Streams {
  cudaStream_t compute = nullptr, copy = nullptr;
  Streams() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Streams() {
    cudaStreamDestroy(compute);
    cudaStreamDestroy(copy);
  }
};

bool HaveGpu() { return prim::CudaDeviceCount() > 0; }

TEST(DeviceTrainingOnGpu, ParametersArriveThroughTheCopyStreamInBothDirections) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Trainer t("gpu_params");
  Streams s;
  DeviceParametersOptions o;
  o.device_budget_bytes = GroupBytes(t.layout, 0) + 2 * GroupBytes(t.layout, 1) + 4096;
  o.read_ahead_bytes = 2 * GroupBytes(t.layout, 1) + 1024;
  o.copy_stream = CudaStreamView(s.copy);
  auto params = DeviceParameters::Create(t.adam.get(), o);
  ASSERT_OK(params.status());
  const CudaStreamView compute(s.compute);
  for (int pass = 0; pass < 4; ++pass) {
    const bool forward = pass % 2 == 0;
    for (std::size_t i = 0; i < 5; ++i) {
      const std::size_t g = forward ? i : 4 - i;
      auto v = (*params)->Acquire(g, compute,
                                  forward ? PassDirection::kForward : PassDirection::kBackward);
      ASSERT_OK(v.status());
      // What a kernel on the compute stream sees: the copy is ordered before it.
      std::vector<std::uint16_t> seen(v->elements);
      ASSERT_EQ(
          cudaMemcpyAsync(seen.data(), v->data, v->elements * 2, cudaMemcpyDeviceToHost, s.compute),
          cudaSuccess);
      ASSERT_OK((*params)->Release(g, compute));
      ASSERT_EQ(cudaStreamSynchronize(s.compute), cudaSuccess);
      EXPECT_EQ(seen, t.Stored(g)) << "pass " << pass << " group " << g;
    }
  }
  EXPECT_GT((*params)->stats().read_ahead, 0u);
  EXPECT_GT((*params)->stats().evictions, 0u);
  ASSERT_OK((*params)->Synchronize());
}

TEST(DeviceTrainingOnGpu, GradientsFromTheDeviceTrainAsFromTheHost) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Trainer a("gpu_grads_set"), b("gpu_grads_offload");
  Streams s;
  DeviceGradientsOptions o;
  o.copy_stream = CudaStreamView(s.copy);
  o.max_inflight_bytes = 3 * kPart * 2;
  auto grads = DeviceGradients::Create(b.adam.get(), o);
  ASSERT_OK(grads.status());
  std::vector<void*> device(5, nullptr);
  for (std::size_t g = 0; g < 5; ++g) {
    ASSERT_EQ(cudaMalloc(&device[g], GroupBytes(b.layout, g)), cudaSuccess);
  }
  for (int step = 1; step <= 2; ++step) {
    a.Step(step, [&](std::size_t g, const std::vector<std::uint16_t>& grad) {
      for (std::size_t part = 0; part < a.layout.Parts(g); ++part) {
        const auto [lo, hi] = a.layout.PartRange(g, part);
        ASSERT_OK(a.adam->SetGradient(g, part, {grad.data() + lo, hi - lo, DType::kBF16}));
      }
    });
    std::vector<std::shared_ptr<ReuseFence>> fences;
    b.Step(step, [&](std::size_t g, const std::vector<std::uint16_t>& grad) {
      // "backward" makes the gradient on the compute stream
      ASSERT_EQ(cudaMemcpyAsync(device[g], grad.data(), grad.size() * 2, cudaMemcpyHostToDevice,
                                s.compute),
                cudaSuccess);
      auto fence =
          (*grads)->Offload(g, {device[g], grad.size(), DType::kBF16}, CudaStreamView(s.compute));
      ASSERT_OK(fence.status());
      fences.push_back(*fence);
      // the compute stream's pageable-source copy returned only after staging; the host
      // vector may go now, the device memory only after the fence
      if (g == 0) {
        ASSERT_OK((*grads)->Finish());
      }
    });
    for (auto& f : fences) EXPECT_TRUE(f->Ready());
  }
  for (std::size_t g = 0; g < 5; ++g) {
    EXPECT_EQ(a.Stored(g), b.Stored(g)) << g;
    cudaFree(device[g]);
  }
}
#endif

}  // namespace
}  // namespace memascend
