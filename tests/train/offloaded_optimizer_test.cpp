// The SDK's offloaded Adam: part by part over a tensor store under a budget far below the
// state, against whole-tensor AdamW written out with the fused kernel (itself checked
// against a scalar reference in kernels/adam_test.cpp).
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/offloaded_optimizer.h>

#include "storage/volume_test_util.h"
#include "store/store_test_util.h"
#include "testing/status_matchers.h"
#include "train/state_test_util.h"

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kPart = std::size_t{1} << 18;

StateLayout Layout(bool derive_first = false) {
  StateLayout l;
  l.groups = {{"embed", 2 * kPart + 75'712, !derive_first},
              {"block", 100'000, true},
              {"head", 300'000, true}};
  l.param_dtype = DType::kBF16;
  l.grad_dtype = DType::kF16;
  l.part_elements = kPart;
  return l;
}

OffloadedAdamOptions Options() {
  OffloadedAdamOptions o;
  o.groups = {{1e-3f, 0.1f}, {3e-3f, 0.0f}, {2e-3f, 0.01f}};
  o.max_grad_norm = 0.5f;
  o.scaler.initial_scale = 1024.0f;
  o.fingerprint = 99;
  return o;
}

std::vector<float> Initial(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> w(n);
  for (float& x : w) x = d(rng);
  return w;
}
// The gradient of group g at `step`, already multiplied by the loss scale.
std::vector<float> Gradient(std::size_t n, std::size_t g, int step, float scale) {
  std::mt19937_64 rng(1000 * g + static_cast<std::uint64_t>(step));
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng) * scale;
  return x;
}

// A tensor store on a file volume with the optimizer's minimum budget (twice what it holds).
struct Offloaded : ::memascend::testing::OpenedState {
  ScratchPath path{"offloaded_adam"};
  explicit Offloaded(const StateLayout& l, bool format = true, const std::string& at = {},
                     const VersionedTrainingStateOptions& vo = {}) {
    TensorStoreOptions so;
    so.host_budget_bytes = OffloadedAdam::MinimumHostBudget(l);
    so.defer_prefetches = true;
    EXPECT_OK(::memascend::testing::OpenState(at.empty() ? path.path() : at, format ? 64 << 20 : 0,
                                              l, so, this, vo));
  }
};

// Whole-tensor AdamW: every group at once, the norm over every group.
struct Reference {
  StateLayout l;
  OffloadedAdamOptions o;
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<std::uint16_t>> params;
  explicit Reference(const StateLayout& layout, const OffloadedAdamOptions& options)
      : l(layout), o(options) {
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      master.push_back(Initial(l.groups[g].elements, g));
      m.emplace_back(l.groups[g].elements, 0.0f);
      v.emplace_back(l.groups[g].elements, 0.0f);
      params.emplace_back(l.groups[g].elements);
      EXPECT_OK(Convert({master[g].data(), master[g].size(), DType::kF32},
                        {params[g].data(), params[g].size(), l.param_dtype}));
    }
  }
  void Step(int step, std::int64_t adam_step, float scale) {
    std::vector<std::vector<std::uint16_t>> grads;
    double sum = 0;
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      const std::size_t n = l.groups[g].elements;
      grads.emplace_back(n);
      const auto f = Gradient(n, g, step, scale);
      ASSERT_OK(Convert({f.data(), n, DType::kF32}, {grads[g].data(), n, l.grad_dtype}));
      const TensorView view[] = {{grads[g].data(), n, l.grad_dtype}};
      sum = SumOfSquares(view, {}, sum);
    }
    const double norm = std::sqrt(sum) / static_cast<double>(scale);
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      const std::size_t n = l.groups[g].elements;
      AdamConfig a;
      a.lr = o.groups[g].lr;
      a.weight_decay = o.groups[g].weight_decay;
      a.step = adam_step;
      a.grad_multiplier = ClipCoefficient(norm, o.max_grad_norm) / scale;
      ASSERT_OK(FusedAdam(a, master[g], m[g], v[g], {grads[g].data(), n, l.grad_dtype},
                          {params[g].data(), n, l.param_dtype}));
    }
  }
};

// The reference's initial weights into the optimizer's state, committed as step 0.
absl::Status Start(OffloadedAdam* adam, const Reference& ref) {
  for (std::size_t g = 0; g < ref.l.groups.size(); ++g)
    MEMASCEND_RETURN_IF_ERROR(adam->Initialize(g, ref.master[g]));
  return adam->Commit(0);
}

// Step `step`'s gradients, part by part, the last group first (as a backward pass).
absl::Status FeedGradients(OffloadedAdam* adam, int step) {
  const StateLayout& l = adam->layout();
  adam->BeginBackward();
  for (std::size_t g = l.groups.size(); g-- > 0;) {
    const auto f = Gradient(l.groups[g].elements, g, step, adam->loss_scale());
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      MEMASCEND_RETURN_IF_ERROR(
          adam->SetGradient(g, p, {f.data() + begin, end - begin, DType::kF32}));
    }
  }
  return absl::OkStatus();
}

absl::Status RunSteps(OffloadedAdam* adam, int first, int last) {
  const StateLayout& l = adam->layout();
  for (int step = first; step <= last; ++step) {
    MEMASCEND_RETURN_IF_ERROR(FeedGradients(adam, step));
    MEMASCEND_ASSIGN_OR_RETURN(StepPlan plan, adam->EndBackward());
    if (plan.skipped) return absl::InternalError("unexpected overflow");
    if (step % 2 == 0) {
      adam->ReadAheadForUpdate();
      for (std::size_t g = 0; g < l.groups.size(); ++g)
        MEMASCEND_RETURN_IF_ERROR(adam->UpdateGroup(g));
    } else {
      MEMASCEND_RETURN_IF_ERROR(adam->UpdateAll());
    }
    // In the background: the next commit settles this one, Settle() the last.
    MEMASCEND_RETURN_IF_ERROR(adam->CommitAsync(static_cast<std::uint64_t>(step)).status());
  }
  return adam->Settle();
}

void ExpectState(TrainingStateStorage* s, const Reference& ref) {
  const StateLayout& l = s->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      const std::size_t n = end - begin;
      ASSERT_OK_AND_ASSIGN(StateBuffer master, s->Read(StateKind::kMaster, g, p, false));
      ASSERT_EQ(std::memcmp(master.data, ref.master[g].data() + begin, n * 4), 0)
          << "master of group " << g << " part " << p;
      ASSERT_OK_AND_ASSIGN(StateBuffer v, s->Read(StateKind::kExpAvgSq, g, p, false));
      ASSERT_EQ(std::memcmp(v.data, ref.v[g].data() + begin, n * 4), 0) << g << "." << p;
      if (!l.Stored(StateKind::kParameters, g)) continue;
      ASSERT_OK_AND_ASSIGN(StateBuffer param, s->Read(StateKind::kParameters, g, p, false));
      ASSERT_EQ(std::memcmp(param.data, ref.params[g].data() + begin, n * 2), 0) << g << "." << p;
    }
  }
}

TEST(OffloadedAdam, PartByPartUnderABudgetGivesTheBitsOfWholeTensorAdamW) {
  const StateLayout l = Layout();
  Offloaded off(l);
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  Reference ref(l, Options());
  ASSERT_OK(Start(adam.get(), ref));
  ASSERT_OK(RunSteps(adam.get(), 1, 4));
  for (int step = 1; step <= 4; ++step) ref.Step(step, step, 1024.0f);
  EXPECT_EQ(adam->adam_step(), 4);
  ExpectState(off.state.get(), ref);
  // The budget was far below the state: the store evicted and read back.
  EXPECT_GT(off.store->stats().evictions, 0u);
  EXPECT_LT(OffloadedAdam::MinimumHostBudget(l), l.TotalElements() * 16);
  // Note [step times]: each phase ran and was timed; the kernels are a part of the update.
  const OffloadedAdam::Times& t = adam->times();
  EXPECT_GT(t.gradients, 0);
  EXPECT_GT(t.end_backward, 0);
  EXPECT_GT(t.update_kernels, 0);
  EXPECT_GT(t.update, t.update_kernels);
  EXPECT_GT(t.commit, 0);  // Start's commit of step 0 (the others run in the background)
}

TEST(OffloadedAdam, AResumedRunContinuesAsTheUninterruptedOne) {
  // In two versions (Note [train state versions]): a step not committed is lost.
  const StateLayout l = Layout();
  ScratchPath path("offloaded_adam_resume");
  KernelThreads threads(2);
  Reference ref(l, Options());
  VersionedTrainingStateOptions two;
  two.in_place = false;
  {
    Offloaded off(l, true, path.path(), two);
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));
    ASSERT_OK(RunSteps(adam.get(), 1, 2));
    // A third step's update, half done and never committed: lost with the process.
    adam->BeginBackward();
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t p = 0; p < l.Parts(g); ++p) {
        const auto [begin, end] = l.PartRange(g, p);
        std::vector<float> junk(end - begin, 5.0f);
        ASSERT_OK(adam->SetGradient(g, p, {junk.data(), junk.size(), DType::kF32}));
      }
    }
    ASSERT_OK(adam->EndBackward().status());
    ASSERT_OK(adam->UpdateGroup(0));
    EXPECT_THAT(adam->Commit(3), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("1 of 3 groups updated")));
  }
  Offloaded off(l, false, path.path(), two);
  OffloadedAdamOptions other = Options();
  other.fingerprint = 100;
  {
    ASSERT_OK_AND_ASSIGN(auto wrong, OffloadedAdam::Create(off.state.get(), other, &threads));
    EXPECT_THAT(wrong->Resume(), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  ASSERT_OK_AND_ASSIGN(auto last, adam->Resume());
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->step, 2u);
  EXPECT_EQ(adam->adam_step(), 2);
  ASSERT_OK(RunSteps(adam.get(), 3, 4));
  for (int step = 1; step <= 4; ++step) ref.Step(step, step, 1024.0f);
  ExpectState(off.state.get(), ref);
}

// Note [state in place]: a step whose update began and did not commit (an error, a stop)
// is finished on resume from its durable gradients: the run goes on as if never stopped.
// With a bound below the state (its parts committed in batches during the update) and
// above it (the torn step committed when the state is destroyed).
TEST(OffloadedAdam, AStepTornInPlaceIsFinishedOnResume) {
  const StateLayout l = Layout();
  for (std::uint64_t bound : {std::uint64_t{1} << 20, std::uint64_t{256} << 20}) {
    ScratchPath path("offloaded_adam_torn");
    KernelThreads threads(2);
    Reference ref(l, Options());
    VersionedTrainingStateOptions vo;
    vo.max_staged_bytes = bound;
    {
      Offloaded off(l, true, path.path(), vo);
      ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
      ASSERT_OK(Start(adam.get(), ref));
      ASSERT_OK(RunSteps(adam.get(), 1, 2));
      ASSERT_OK(FeedGradients(adam.get(), 3));
      ASSERT_OK(adam->EndBackward().status());
      ASSERT_OK(adam->UpdateGroup(0));  // its 3 parts of the 6, then the process stops
    }
    Offloaded off(l, false, path.path(), vo);
    ASSERT_OK_AND_ASSIGN(auto at, off.state->Resume(99));
    ASSERT_EQ(at->step, 2u);
    ASSERT_TRUE(off.state->Unfinished().has_value()) << "bound " << bound;
    EXPECT_EQ(off.state->Unfinished()->parts_done, 3u);
    EXPECT_EQ(off.state->Unfinished()->intent.record.step, 3u);
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK_AND_ASSIGN(auto last, adam->Resume());
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 3u);  // finished and committed
    EXPECT_EQ(adam->adam_step(), 3);
    EXPECT_FALSE(off.state->Unfinished().has_value());
    ASSERT_OK(RunSteps(adam.get(), 4, 5));
    for (int step = 1; step <= 5; ++step) ref.Step(step, step, 1024.0f);
    ExpectState(off.state.get(), ref);
  }
  // A torn step's progress object does not outlive a state started over on its volume.
  ScratchPath path("offloaded_adam_torn_restart");
  KernelThreads threads(2);
  Reference ref(l, Options());
  {
    Offloaded off(l, true, path.path());
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));
    ASSERT_OK(FeedGradients(adam.get(), 1));
    ASSERT_OK(adam->EndBackward().status());
    ASSERT_OK(adam->UpdateGroup(0));  // torn at step 1
  }
  {
    Offloaded off(l, false, path.path());
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));  // started over, not resumed: step 0 again
  }
  Offloaded off(l, false, path.path());
  ASSERT_OK_AND_ASSIGN(auto at, off.state->Resume(99));
  EXPECT_EQ(at->step, 0u);
  EXPECT_FALSE(off.state->Unfinished().has_value());
}

// A storage whose one Update of a given part fails: the rest is the state's.
class FailingOnce final : public TrainingStateStorage {
 public:
  FailingOnce(TrainingStateStorage* s, std::size_t g, std::size_t part)
      : s_(s), g_(g), part_(part) {}
  const StateLayout& layout() const override { return s_->layout(); }
  absl::StatusOr<StateBuffer> Read(StateKind k, std::size_t g, std::size_t p, bool n) override {
    return s_->Read(k, g, p, n);
  }
  absl::StatusOr<StateBuffer> Overwrite(StateKind k, std::size_t g, std::size_t p,
                                        bool n) override {
    return s_->Overwrite(k, g, p, n);
  }
  absl::StatusOr<StateBuffer> Update(StateKind k, std::size_t g, std::size_t p) override {
    if (k == StateKind::kExpAvgSq && g == g_ && p == part_ && !failed_) {
      failed_ = true;
      return absl::UnavailableError("injected: the read of exp_avg_sq failed");
    }
    return s_->Update(k, g, p);
  }
  void Prefetch(StateKind k, std::size_t g, std::size_t p) override { s_->Prefetch(k, g, p); }
  absl::Status Discard(StateKind k, std::size_t g, std::size_t p) override {
    return s_->Discard(k, g, p);
  }
  absl::Status BeginUpdate(const StepIntent& i) override { return s_->BeginUpdate(i); }
  absl::Status PartUpdated(std::size_t g, std::size_t p) override { return s_->PartUpdated(g, p); }
  std::optional<UnfinishedStep> Unfinished() const override { return s_->Unfinished(); }
  absl::Status Commit(const CommitRecord& r) override { return s_->Commit(r); }
  absl::Status Settle() override { return s_->Settle(); }
  absl::StatusOr<std::optional<CommitRecord>> Resume(std::uint64_t f) override {
    return s_->Resume(f);
  }

 private:
  TrainingStateStorage* s_;
  std::size_t g_, part_;
  bool failed_ = false;
};

// Note [gradient write-behind]: a step committed in batches (a bound below the state) has
// its gradients written as the backward pass hands each over, before the update begins and
// within the bound; a step that fits the bound writes none. Either way the run is the
// reference's.
TEST(OffloadedAdam, ABatchedStepWritesItsGradientsUnderTheBackwardPass) {
  const StateLayout l = Layout();
  for (std::uint64_t bound : {std::uint64_t{1} << 20, std::uint64_t{256} << 20}) {
    SCOPED_TRACE(bound);
    ScratchPath path("offloaded_adam_write_behind");
    KernelThreads threads(2);
    Reference ref(l, Options());
    VersionedTrainingStateOptions vo;
    vo.max_staged_bytes = bound;
    TensorStoreOptions so;
    so.host_budget_bytes = 64 << 20;  // the whole state: nothing is evicted
    so.defer_prefetches = true;
    ::memascend::testing::OpenedState off;
    ASSERT_OK(::memascend::testing::OpenState(path.path(), 64 << 20, l, so, &off, vo));
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));
    ASSERT_OK(RunSteps(adam.get(), 1, 1));
    ASSERT_OK(adam->Settle());
    const std::uint64_t before = off.store->stats().write_backs;
    ASSERT_OK(FeedGradients(adam.get(), 2));
    const std::uint64_t parts = 6;
    if (bound == std::uint64_t{1} << 20) {
      // The writes are the store's threads': each gradient was queued when handed over.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (off.store->stats().write_backs - before < parts &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_EQ(off.store->stats().write_backs - before, parts);
      // What is staged stays within the bound and a part (GradientWritten; VolumeBytes
      // leaves room for both). Exactly the bound was asserted before, which held only by
      // timing: a loaded machine staged 1.19 MiB (a CPU hog beside the test, 3 in 200).
      EXPECT_LE(off.volume->staged_bytes(), bound + kPart * SizeOf(l.grad_dtype));
    } else {
      EXPECT_EQ(off.store->stats().write_backs, before);
    }
    ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
    ASSERT_FALSE(plan.skipped);
    const std::uint64_t before_update = off.store->stats().write_backs;
    ASSERT_OK(adam->UpdateAll());
    ASSERT_OK(adam->Commit(2));
    // Each kind of each part (parameters, master weights, both moments) written once: a
    // batch committed under the part's leases wrote its last part twice, past the room the
    // volume is sized for (Note [write-back under a writer]).
    EXPECT_EQ(off.store->stats().write_backs - before_update, 4 * parts);
    ASSERT_OK(RunSteps(adam.get(), 3, 3));
    for (int step = 1; step <= 3; ++step) ref.Step(step, step, 1024.0f);
    ExpectState(off.state.get(), ref);
  }
}

// A step whose state fits the staging bound and whose gradients with it do not is not
// committed in batches: its gradients still in host memory were evicted by the update
// and staged beside their committed copies, past the bound and the room VolumeBytes
// leaves (OffloadedTraining's defaults filled their own volume at the second step with
// 252 MiB of state and 84 MiB of gradients). They are committed before the update now.
TEST(OffloadedAdam, AStepWhoseGradientsPassTheBoundStagesItsStateAlone) {
  StateLayout l;
  l.groups = {{"a", 4 * kPart, false}, {"b", 12 * kPart, false}};
  l.param_dtype = DType::kBF16;  // derived from the master weights: 3 kinds a part
  l.grad_dtype = DType::kF16;
  l.part_elements = kPart;
  const std::uint64_t state = 16 * kPart * 12;  // and 16 parts of gradients, 2 B each
  OffloadedAdamOptions o = Options();
  o.groups.resize(2);
  ScratchPath path("offloaded_adam_gradients_past_the_bound");
  KernelThreads threads(2);
  Reference ref(l, o);
  VersionedTrainingStateOptions vo;
  vo.max_staged_bytes = state;  // the state fits; with its gradients it does not
  TensorStoreOptions so;
  so.host_budget_bytes = OffloadedAdam::MinimumHostBudget(l);  // gradients are evicted
  so.defer_prefetches = true;
  ::memascend::testing::OpenedState off;
  ASSERT_OK(::memascend::testing::OpenState(path.path(), VersionedTrainingState::VolumeBytes(l, vo),
                                            l, so, &off, vo));
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), o, &threads));
  ASSERT_OK(Start(adam.get(), ref));
  std::uint64_t most = 0;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_OK(FeedGradients(adam.get(), step));
    ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
    ASSERT_FALSE(plan.skipped);
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      ASSERT_OK(adam->UpdateGroup(g));
      most = std::max(most, off.volume->staged_bytes());
    }
    ASSERT_OK(adam->Commit(step));
    ref.Step(step, step, 1024.0f);
  }
  EXPECT_LE(most, state);  // 49.5 MiB of 48 before, with 1.5 MiB of gradients evicted
  ExpectState(off.state.get(), ref);
}

// Note [failed update]: an update that fails part-way is not run again (its parts updated
// in place would be updated twice); the state commits what it updated as a torn step when
// it closes, and the reopened run finishes it. A step in place commits as the last plus one.
TEST(OffloadedAdam, AnUpdateFailedPartWayIsNotRetriedAndResumeFinishesIt) {
  const StateLayout l = Layout();
  ScratchPath path("offloaded_adam_failed");
  KernelThreads threads(2);
  Reference ref(l, Options());
  VersionedTrainingStateOptions vo;
  vo.max_staged_bytes = 1 << 20;  // parts committed in batches
  {
    Offloaded off(l, true, path.path(), vo);
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));
    ASSERT_OK(RunSteps(adam.get(), 1, 1));
    // Step 2 numbered otherwise is refused before anything is committed.
    ASSERT_OK(FeedGradients(adam.get(), 2));
    ASSERT_OK(adam->EndBackward().status());
    ASSERT_OK(adam->UpdateAll());
    EXPECT_THAT(adam->Commit(7),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("commits as step 2")));
    ASSERT_OK(adam->Commit(2));
    FailingOnce failing(off.state.get(), 2, 1);  // the head's second part
    ASSERT_OK_AND_ASSIGN(auto broken, OffloadedAdam::Create(&failing, Options(), &threads));
    ASSERT_OK(broken->Resume().status());
    ASSERT_OK(FeedGradients(broken.get(), 3));
    ASSERT_OK(broken->EndBackward().status());
    EXPECT_THAT(broken->UpdateAll(), StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_THAT(broken->UpdateGroup(2),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("failed part-way")));
    EXPECT_THAT(broken->Commit(3),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("failed part-way")));
  }
  Offloaded off(l, false, path.path(), vo);
  ASSERT_OK_AND_ASSIGN(auto at, off.state->Resume(99));
  EXPECT_EQ(at->step, 2u);
  ASSERT_TRUE(off.state->Unfinished().has_value());
  EXPECT_EQ(off.state->Unfinished()->parts_done, 5u);  // all but the head's second part
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  ASSERT_OK_AND_ASSIGN(auto last, adam->Resume());
  EXPECT_EQ(last->step, 3u);
  ASSERT_OK(RunSteps(adam.get(), 4, 4));
  for (int step = 1; step <= 4; ++step) ref.Step(step, step, 1024.0f);
  ExpectState(off.state.get(), ref);
}

TEST(OffloadedAdam, AStateExportedAndImportedElsewhereContinuesAsTheOriginal) {
  // Another optimizer's format (PyTorch's state_dict, say) holds the master weights, both
  // moments and the step: read out of one run, written into a fresh volume, the next
  // steps give the bits of the uninterrupted run.
  const StateLayout l = Layout(/*derive_first=*/true);
  KernelThreads threads(2);
  Reference ref(l, Options());
  std::vector<std::vector<float>> exported[3];
  std::vector<std::vector<std::uint16_t>> params;
  std::int64_t step = 0;
  {
    Offloaded off(l);
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
    ASSERT_OK(Start(adam.get(), ref));
    ASSERT_OK(RunSteps(adam.get(), 1, 2));
    step = adam->adam_step();
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      const std::size_t n = l.groups[g].elements;
      int i = 0;
      for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        exported[i].emplace_back(n);
        ASSERT_OK(adam->ReadState(k, g, {exported[i++].back().data(), n, DType::kF32}));
      }
      params.emplace_back(n);
      ASSERT_OK(
          adam->ReadState(StateKind::kParameters, g, {params.back().data(), n, l.param_dtype}));
      std::vector<float> wrong(n + 1);
      EXPECT_THAT(adam->ReadState(StateKind::kMaster, g, {wrong.data(), n + 1, DType::kF32}),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("elements")));
      EXPECT_THAT(adam->ReadState(StateKind::kGradient, g, {wrong.data(), n, DType::kF32}),
                  StatusIs(absl::StatusCode::kInvalidArgument));
    }
  }
  Offloaded fresh(l);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(fresh.state.get(), Options(), &threads));
  EXPECT_THAT(adam->SetAdamStep(-1), StatusIs(absl::StatusCode::kInvalidArgument));
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    const std::size_t n = l.groups[g].elements;
    int i = 0;
    for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq})
      ASSERT_OK(adam->WriteState(k, g, {exported[i++][g].data(), n, DType::kF32}));
    ASSERT_OK(adam->WriteState(StateKind::kParameters, g, {params[g].data(), n, l.param_dtype}));
  }
  ASSERT_OK(adam->SetAdamStep(step));
  ASSERT_OK(adam->Commit(2));
  ASSERT_OK(RunSteps(adam.get(), 3, 4));
  for (int s = 1; s <= 4; ++s) ref.Step(s, s, 1024.0f);
  ExpectState(fresh.state.get(), ref);
  // With an update planned the state is not written.
  ASSERT_OK(FeedGradients(adam.get(), 5));
  ASSERT_OK(adam->EndBackward().status());
  EXPECT_THAT(adam->WriteState(StateKind::kMaster, 0,
                               {exported[0][0].data(), l.groups[0].elements, DType::kF32}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(adam->SetAdamStep(3), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(OffloadedAdam, AStateReadARangeAtATimeIsTheWholeRead) {
  // ReadStateRange: ranges that start and end inside parts, span part boundaries, or are
  // a single element give the whole read's bytes, for every kind a state keeps, derived
  // and stored parameters, in fp32 and in another dtype; a range past a group's end is
  // refused, and so are the gradients.
  const StateLayout l = Layout(/*derive_first=*/true);
  KernelThreads threads(2);
  Reference ref(l, Options());
  Offloaded off(l);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  ASSERT_OK(Start(adam.get(), ref));
  ASSERT_OK(RunSteps(adam.get(), 1, 2));
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    const std::size_t n = l.groups[g].elements;
    for (StateKind k :
         {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kParameters}) {
      for (DType dt : {DType::kF32, DType::kBF16}) {
        const std::size_t es = SizeOf(dt);
        std::vector<std::byte> whole(n * es), ranged(n * es, std::byte{0x5a});
        ASSERT_OK(adam->ReadState(k, g, {whole.data(), n, dt}));
        std::size_t first = 0;
        for (std::size_t i = 0; first < n; ++i) {
          const std::size_t lengths[] = {1, kPart - 3, kPart + 5, 7, 2 * kPart};
          const std::size_t len = std::min(lengths[i % 5], n - first);
          ASSERT_OK(adam->ReadStateRange(k, g, first, {ranged.data() + first * es, len, dt}));
          first += len;
        }
        EXPECT_EQ(whole, ranged) << "group " << g << " kind " << static_cast<int>(k);
      }
    }
    std::vector<float> one(2);
    EXPECT_THAT(adam->ReadStateRange(StateKind::kMaster, g, n - 1, {one.data(), 2, DType::kF32}),
                StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("which has")));
    EXPECT_THAT(adam->ReadStateRange(StateKind::kMaster, g, n + 1, {one.data(), 0, DType::kF32}),
                StatusIs(absl::StatusCode::kOutOfRange));
    EXPECT_THAT(adam->ReadStateRange(StateKind::kGradient, g, 0, {one.data(), 1, DType::kF32}),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
  std::vector<float> one(1);
  EXPECT_THAT(
      adam->ReadStateRange(StateKind::kMaster, l.groups.size(), 0, {one.data(), 1, DType::kF32}),
      StatusIs(absl::StatusCode::kOutOfRange));
}

TEST(OffloadedAdam, GradientsScaledByAnOutsideScalerAreUnscaledByItsScale) {
  // PyTorch's GradScaler scales the loss itself: the optimizer is told the scale.
  const StateLayout l = Layout();
  KernelThreads threads(2);
  OffloadedAdamOptions o = Options();
  o.scaler.initial_scale = 1.0f;
  Reference ref(l, o);
  Offloaded off(l);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), o, &threads));
  ASSERT_OK(Start(adam.get(), ref));
  adam->BeginBackward(/*gradient_scale=*/1024.0f);
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    const auto f = Gradient(l.groups[g].elements, g, 1, 1024.0f);
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      ASSERT_OK(adam->SetGradient(g, p, {f.data() + begin, end - begin, DType::kF32}));
    }
  }
  ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
  EXPECT_EQ(plan.loss_scale, 1024.0f);
  ASSERT_OK(adam->UpdateAll());
  ASSERT_OK(adam->Commit(1));
  ASSERT_OK(adam->Settle());
  ref.Step(1, 1, 1024.0f);
  ExpectState(off.state.get(), ref);
  EXPECT_EQ(adam->loss_scale(), 1.0f);  // the optimizer's own scaler is untouched
}

TEST(OffloadedAdam, AnOverflowSkipsTheStepAndLeavesTheStateAsItWas) {
  const StateLayout l = Layout();
  ASSERT_OK_AND_ASSIGN(auto state, InMemoryTrainingState::Create(l));
  KernelThreads threads(1);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(state.get(), Options(), &threads));
  Reference ref(l, Options());
  ASSERT_OK(Start(adam.get(), ref));
  adam->BeginBackward();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      std::vector<float> grad(end - begin, 0.5f);
      if (g == 1) grad[17] = INFINITY;
      ASSERT_OK(adam->SetGradient(g, p, {grad.data(), grad.size(), DType::kF32}));
    }
  }
  ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
  EXPECT_TRUE(plan.skipped);
  EXPECT_FALSE(adam->update_pending());
  EXPECT_THAT(adam->UpdateGroup(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(adam->Commit(1));
  EXPECT_EQ(adam->adam_step(), 0);
  EXPECT_EQ(adam->scaler().skipped_steps(), 1);
  ExpectState(state.get(), ref);  // nothing moved
  // The next step trains as the first would have.
  ASSERT_OK(RunSteps(adam.get(), 1, 1));
  ref.Step(1, 1, adam->loss_scale());
  ExpectState(state.get(), ref);
}

// Note [one pass]: the fused check is the sum of squares; PyTorch's way is a pass of its
// own. Every kind of overflow skips the step either way, the largest finite value does
// not, and the norm has the same bits.
TEST(OffloadedAdam, TheOverflowCheckInTheNormsPassFindsWhatASeparatePassFinds) {
  const StateLayout l = Layout();  // fp16 gradients: 65504 is the largest finite one
  const float kValues[] = {INFINITY, -INFINITY, NAN, 65504.0f, -65504.0f};
  for (const float value : kValues) {
    double norms[2] = {0, 0};
    for (const auto check : {OffloadedAdamOptions::OverflowCheck::kFused,
                             OffloadedAdamOptions::OverflowCheck::kTemporaries}) {
      SCOPED_TRACE(::testing::Message()
                   << "value " << value << ", check "
                   << (check == OffloadedAdamOptions::OverflowCheck::kFused ? "fused" : "temps"));
      ASSERT_OK_AND_ASSIGN(auto state, InMemoryTrainingState::Create(l));
      KernelThreads threads(3);
      OffloadedAdamOptions o = Options();
      o.overflow_check = check;
      ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(state.get(), o, &threads));
      Reference ref(l, o);
      ASSERT_OK(Start(adam.get(), ref));
      adam->BeginBackward();
      for (std::size_t g = 0; g < l.groups.size(); ++g) {
        const auto f = Gradient(l.groups[g].elements, g, 1, 1024.0f);
        for (std::size_t p = 0; p < l.Parts(g); ++p) {
          const auto [begin, end] = l.PartRange(g, p);
          std::vector<float> grad(f.begin() + static_cast<std::ptrdiff_t>(begin),
                                  f.begin() + static_cast<std::ptrdiff_t>(end));
          // In the last part of the first group, and in the middle group's only one.
          if ((g == 0 && p + 1 == l.Parts(g)) || g == 1) grad[grad.size() / 2] = value;
          ASSERT_OK(adam->SetGradient(g, p, {grad.data(), grad.size(), DType::kF32}));
        }
      }
      ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
      EXPECT_EQ(plan.skipped, !std::isfinite(value));
      if (!plan.skipped) {
        EXPECT_TRUE(std::isfinite(plan.grad_norm));
        EXPECT_GT(plan.grad_norm, 65504.0 / 1024.0);  // two of them, unscaled
        norms[check == OffloadedAdamOptions::OverflowCheck::kFused ? 0 : 1] = plan.grad_norm;
        ASSERT_OK(adam->UpdateAll());
      }
      ASSERT_OK(adam->Commit(1));
    }
    if (std::isfinite(value)) {
      EXPECT_EQ(norms[0], norms[1]);
    }
  }
}

// A group made a part at a time (a trainer that never holds it whole) starts the run
// the whole group's Initialize would: parameters (stored and derived), master weights and
// moments, through a step.
TEST(OffloadedAdam, InitializingPartByPartIsInitializingWhole) {
  const StateLayout l = Layout(/*derive_first=*/true);
  Offloaded off(l);
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  Reference ref(l, Options());
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = l.Parts(g); p-- > 0;) {  // in any order
      const auto [b, e] = l.PartRange(g, p);
      ASSERT_OK(adam->InitializePart(g, p, {ref.master[g].data() + b, e - b, DType::kF32}));
    }
  }
  ASSERT_OK(adam->Commit(0));
  ExpectState(off.state.get(), ref);
  ASSERT_OK(RunSteps(adam.get(), 1, 1));
  ref.Step(1, 1, 1024.0f);
  ExpectState(off.state.get(), ref);
}

// A step's plan needs its backward pass: EndBackward without a BeginBackward since the
// last would plan an update of the last step's norm from gradients already discarded.
TEST(OffloadedAdam, APlanWithoutABackwardPassIsRefused) {
  const StateLayout l = Layout();
  Offloaded off(l);
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  Reference ref(l, Options());
  ASSERT_OK(Start(adam.get(), ref));
  EXPECT_THAT(adam->EndBackward(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginBackward()")));
  ASSERT_OK(RunSteps(adam.get(), 1, 1));
  EXPECT_THAT(adam->EndBackward(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginBackward()")));
  ASSERT_OK(RunSteps(adam.get(), 2, 2));  // refused, nothing lost: the next step trains
  ref.Step(1, 1, 1024.0f);
  ref.Step(2, 2, 1024.0f);
  ExpectState(off.state.get(), ref);
}

TEST(OffloadedAdam, DerivedParametersAreTheRoundedMasterWeights) {
  const StateLayout l = Layout(/*derive_first=*/true);
  Offloaded off(l);
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  Reference ref(l, Options());
  ASSERT_OK(Start(adam.get(), ref));
  ASSERT_OK(RunSteps(adam.get(), 1, 1));
  ref.Step(1, 1, 1024.0f);
  ExpectState(off.state.get(), ref);
  // Loaded: the rounding of the master weights, which is what the update wrote out.
  const std::size_t n = l.groups[0].elements;
  std::vector<std::uint16_t> loaded(n);
  ASSERT_OK(adam->LoadParameters(0, {loaded.data(), n, DType::kBF16}));
  EXPECT_EQ(loaded, ref.params[0]);
  std::vector<float> as_f32(n), expected(n);
  ASSERT_OK(adam->LoadParameters(0, {as_f32.data(), n, DType::kF32}));
  ASSERT_OK(Convert({ref.params[0].data(), n, DType::kBF16}, {expected.data(), n, DType::kF32}));
  EXPECT_EQ(as_f32, expected);
  // An update writes the same bits to the caller's buffer.
  ASSERT_OK(FeedGradients(adam.get(), 2));
  ASSERT_OK(adam->EndBackward().status());
  std::vector<float> out(n);
  ASSERT_OK(adam->UpdateGroup(0, {out.data(), n, DType::kF32}));
  ASSERT_OK(adam->UpdateGroup(1));
  ASSERT_OK(adam->UpdateGroup(2));
  ASSERT_OK(adam->Commit(2));
  ASSERT_OK(adam->LoadParameters(0, {as_f32.data(), n, DType::kF32}));
  EXPECT_EQ(out, as_f32);
}

TEST(OffloadedAdam, MisuseIsRefusedWithAReason) {
  const StateLayout l = Layout();
  ASSERT_OK_AND_ASSIGN(auto state, InMemoryTrainingState::Create(l));
  KernelThreads threads(1);
  OffloadedAdamOptions o = Options();
  o.groups.pop_back();
  EXPECT_THAT(OffloadedAdam::Create(state.get(), o, &threads),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 group options")));
  o = Options();
  o.beta2 = 1.0f;
  EXPECT_THAT(OffloadedAdam::Create(state.get(), o, &threads),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o = Options();
  o.groups[1].lr = NAN;
  EXPECT_THAT(OffloadedAdam::Create(state.get(), o, &threads),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OffloadedAdam::Create(nullptr, Options(), &threads),
              StatusIs(absl::StatusCode::kInvalidArgument));

  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(state.get(), Options(), &threads));
  std::vector<float> w(10);
  EXPECT_THAT(adam->Initialize(0, w), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(adam->Initialize(7, w), StatusIs(absl::StatusCode::kOutOfRange));
  const TensorView w10{w.data(), w.size(), DType::kF32};
  EXPECT_THAT(adam->InitializePart(0, 0, w10),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not 10")));
  EXPECT_THAT(adam->InitializePart(0, 3, w10),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("has 3 parts")));
  EXPECT_THAT(adam->InitializePart(7, 0, w10), StatusIs(absl::StatusCode::kOutOfRange));
  std::vector<float> g1(100000);
  // A gradient outside a backward pass: its norm and overflow flag would be the last
  // step's. Refused before BeginBackward and again after EndBackward.
  EXPECT_THAT(adam->SetGradient(1, 0, {g1.data(), g1.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginBackward()")));
  adam->BeginBackward();
  EXPECT_THAT(adam->SetGradient(1, 0, {w.data(), w.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("100000 elements")));
  EXPECT_THAT(adam->SetGradient(1, 5, {w.data(), w.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(adam->UpdateGroup(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(adam->EndBackward(-1), StatusIs(absl::StatusCode::kInvalidArgument));
  // Note [every part once]: a step that left a part out updated it from the last step's
  // gradient, or from nothing; a part given twice counted twice in the norm. Both refused.
  EXPECT_THAT(adam->EndBackward(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            HasSubstr("'embed' part 0 has no gradient")));
  ASSERT_OK(FeedGradients(adam.get(), 1));
  EXPECT_THAT(adam->SetGradient(1, 0, {g1.data(), g1.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("twice this step")));
  ASSERT_OK(adam->EndBackward().status());
  EXPECT_THAT(adam->SetGradient(1, 0, {g1.data(), g1.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("outside a backward")));
  EXPECT_THAT(adam->UpdateGroup(1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("out of order")));
  EXPECT_THAT(adam->EndBackward(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(adam->UpdateGroup(0, {w.data(), w.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(adam->LoadParameters(0, {w.data(), w.size(), DType::kF32}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(adam->SetGroupOptions(3, {}), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(adam->SetGroupOptions(0, {-1.0f, 0.0f}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Note [layout shards]: each part has one owner; a rank's shard is its parts, whole.
TEST(LayoutShard, EveryPartHasOneOwnerAndEachRankItsShareOfWholeParts) {
  const StateLayout l = Layout();  // embed: 3 parts, block: 1, head: 2
  for (int world : {1, 2, 3, 6}) {
    std::vector<std::vector<int>> owners;
    std::vector<std::uint64_t> held(static_cast<std::size_t>(world), 0);
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_OK_AND_ASSIGN(LayoutShard s, ShardLayout(l, rank, world));
      ASSERT_OK(s.layout.Validate());
      EXPECT_EQ(s.layout.part_elements, l.part_elements);
      EXPECT_EQ(s.layout.param_dtype, l.param_dtype);
      if (rank == 0) owners = s.owner;
      EXPECT_EQ(s.owner, owners) << "every rank sees the same owners";
      for (std::size_t g = 0; g < l.groups.size(); ++g) {
        const auto [begin, end] = s.range[g];
        std::size_t mine = 0;
        for (std::size_t p = 0; p < l.Parts(g); ++p) {
          if (s.owner[g][p] != rank) continue;
          const auto [pb, pe] = l.PartRange(g, p);
          EXPECT_LE(begin, pb);
          EXPECT_GE(end, pe);
          mine += pe - pb;
        }
        EXPECT_EQ(mine, end - begin) << "contiguous whole parts";
        ASSERT_EQ(s.local[g].has_value(), mine > 0);
        if (!s.local[g]) continue;
        const StateGroup& lg = s.layout.groups[*s.local[g]];
        EXPECT_EQ(lg.name, l.groups[g].name);
        EXPECT_EQ(lg.elements, mine);
        EXPECT_EQ(begin % l.part_elements, 0u) << "parts cut where the whole's are";
        held[static_cast<std::size_t>(rank)] += mine;
      }
    }
    std::uint64_t total = 0;
    for (std::uint64_t h : held) total += h;
    EXPECT_EQ(total, l.TotalElements());
    for (std::size_t g = 0; g < owners.size(); ++g) {
      EXPECT_TRUE(std::is_sorted(owners[g].begin(), owners[g].end()));
      if (g > 0) {
        EXPECT_LE(owners[g - 1].back(), owners[g].front());
      }
    }
  }
  EXPECT_THAT(ShardLayout(l, 0, 7),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("6 parts of up to 262144 elements cannot be shared among 7")));
  EXPECT_THAT(ShardLayout(l, 2, 2), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShardLayout(l, -1, 2), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShardLayout(StateLayout{}, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

// An all-reduce among threads, for ranks simulated in one process.
class ThreadReduce {
 public:
  explicit ThreadReduce(int world) : barrier_(world), slots_(static_cast<std::size_t>(world)) {}
  GradientCheck AllReduce(int rank, const GradientCheck& mine) {
    slots_[static_cast<std::size_t>(rank)] = mine;
    barrier_.arrive_and_wait();
    GradientCheck all;
    for (const GradientCheck& c : slots_) {  // in rank order on every rank: the same sum
      all.overflow = all.overflow || c.overflow;
      all.sum_squares += c.sum_squares;
    }
    barrier_.arrive_and_wait();
    return all;
  }

 private:
  std::barrier<> barrier_;
  std::vector<GradientCheck> slots_;
};

// Note [global gradient check]: ranks that each hold a shard train as one optimizer that
// holds everything, and skip the same steps.
TEST(OffloadedAdam, ShardedRanksTrainAsOneOptimizerOfTheWholeState) {
  const StateLayout l = Layout();
  OffloadedAdamOptions o = Options();
  o.max_grad_norm = 0;  // the norm's sum is in another order: not part of the bits
  constexpr int kWorld = 3;
  constexpr int kSteps = 3;
  Reference ref(l, o);
  // The whole optimizer's plans, for the norm and the overflow.
  std::vector<StepPlan> whole_plans;
  {
    ASSERT_OK_AND_ASSIGN(auto state, InMemoryTrainingState::Create(l));
    KernelThreads threads(1);
    ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(state.get(), o, &threads));
    ASSERT_OK(Start(adam.get(), ref));
    for (int step = 1; step <= kSteps; ++step) {
      ASSERT_OK(FeedGradients(adam.get(), step));
      ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
      whole_plans.push_back(plan);
      ASSERT_OK(adam->UpdateAll());
      ASSERT_OK(adam->Commit(static_cast<std::uint64_t>(step)));
    }
  }
  ThreadReduce reduce(kWorld);
  std::vector<absl::Status> results(kWorld);
  std::vector<std::vector<StepPlan>> plans(kWorld);
  std::vector<std::unique_ptr<InMemoryTrainingState>> states(kWorld);
  std::vector<LayoutShard> shards(kWorld);
  const auto rank_main = [&](int rank) -> absl::Status {
    MEMASCEND_ASSIGN_OR_RETURN(LayoutShard shard, ShardLayout(l, rank, kWorld));
    MEMASCEND_ASSIGN_OR_RETURN(auto state, InMemoryTrainingState::Create(shard.layout));
    KernelThreads threads(1);
    OffloadedAdamOptions ro = o;
    ro.groups.clear();
    for (std::size_t g = 0; g < l.groups.size(); ++g)
      if (shard.local[g]) ro.groups.push_back(o.groups[g]);
    ro.reduce_gradient_check = [&reduce, rank](const GradientCheck& mine) {
      return absl::StatusOr<GradientCheck>(reduce.AllReduce(rank, mine));
    };
    MEMASCEND_ASSIGN_OR_RETURN(auto adam, OffloadedAdam::Create(state.get(), ro, &threads));
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      if (!shard.local[g]) continue;
      const auto [begin, end] = shard.range[g];
      MEMASCEND_RETURN_IF_ERROR(adam->Initialize(
          *shard.local[g], std::span<const float>(ref.master[g]).subspan(begin, end - begin)));
    }
    MEMASCEND_RETURN_IF_ERROR(adam->Commit(0));
    // Step kSteps + 1: one rank's shard overflows, and every rank skips.
    for (int step = 1; step <= kSteps + 1; ++step) {
      adam->BeginBackward();
      for (std::size_t g = 0; g < l.groups.size(); ++g) {
        if (!shard.local[g]) continue;
        auto f = Gradient(l.groups[g].elements, g, step, adam->loss_scale());
        if (step == kSteps + 1 && rank == kWorld - 1) f[shard.range[g].first] = INFINITY;
        const StateLayout& sl = shard.layout;
        const std::size_t lg = *shard.local[g];
        for (std::size_t p = 0; p < sl.Parts(lg); ++p) {
          const auto [begin, end] = sl.PartRange(lg, p);
          MEMASCEND_RETURN_IF_ERROR(adam->SetGradient(
              lg, p, {f.data() + shard.range[g].first + begin, end - begin, DType::kF32}));
        }
      }
      MEMASCEND_ASSIGN_OR_RETURN(StepPlan plan, adam->EndBackward());
      plans[static_cast<std::size_t>(rank)].push_back(plan);
      if (!plan.skipped) MEMASCEND_RETURN_IF_ERROR(adam->UpdateAll());
      MEMASCEND_RETURN_IF_ERROR(adam->Commit(static_cast<std::uint64_t>(step)));
    }
    states[static_cast<std::size_t>(rank)] = std::move(state);
    shards[static_cast<std::size_t>(rank)] = std::move(shard);
    return absl::OkStatus();
  };
  {
    std::vector<std::thread> ranks;
    for (int r = 0; r < kWorld; ++r)
      ranks.emplace_back([&, r] { results[static_cast<std::size_t>(r)] = rank_main(r); });
    for (std::thread& t : ranks) t.join();
  }
  for (int step = 1; step <= kSteps; ++step) ref.Step(step, step, 1024.0f);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_OK(results[static_cast<std::size_t>(r)]);
    const auto& mine = plans[static_cast<std::size_t>(r)];
    ASSERT_EQ(mine.size(), kSteps + 1u);
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_FALSE(mine[step].skipped);
      EXPECT_NEAR(mine[step].grad_norm, whole_plans[step].grad_norm,
                  1e-12 * whole_plans[step].grad_norm);
      EXPECT_EQ(mine[step].grad_norm, plans[0][step].grad_norm) << "every rank the same norm";
    }
    EXPECT_TRUE(mine[kSteps].skipped) << "rank " << r;
    // The shard's state: the bits of the whole's, at its elements.
    const LayoutShard& shard = shards[static_cast<std::size_t>(r)];
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      if (!shard.local[g]) continue;
      const std::size_t lg = *shard.local[g];
      const StateLayout& sl = shard.layout;
      for (std::size_t p = 0; p < sl.Parts(lg); ++p) {
        const auto [begin, end] = sl.PartRange(lg, p);
        const std::size_t at = shard.range[g].first + begin, n = end - begin;
        TrainingStateStorage* st = states[static_cast<std::size_t>(r)].get();
        ASSERT_OK_AND_ASSIGN(StateBuffer master, st->Read(StateKind::kMaster, lg, p, false));
        EXPECT_EQ(std::memcmp(master.data, ref.master[g].data() + at, n * 4), 0) << g << "." << p;
        ASSERT_OK_AND_ASSIGN(StateBuffer v, st->Read(StateKind::kExpAvgSq, lg, p, false));
        EXPECT_EQ(std::memcmp(v.data, ref.v[g].data() + at, n * 4), 0) << g << "." << p;
        ASSERT_OK_AND_ASSIGN(StateBuffer param, st->Read(StateKind::kParameters, lg, p, false));
        EXPECT_EQ(std::memcmp(param.data, ref.params[g].data() + at, n * 2), 0) << g << "." << p;
      }
    }
  }
}

TEST(ParameterStream, LoadsInEitherDirectionAndHasNoDeviceWithoutAGpuTier) {
  const StateLayout l = Layout();
  Offloaded off(l);
  KernelThreads threads(1);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(off.state.get(), Options(), &threads));
  Reference ref(l, Options());
  ASSERT_OK(Start(adam.get(), ref));
  ParameterStream stream(adam.get(), 0, l.groups.size(), 1);
  for (auto dir : {ParameterStream::Direction::kForward, ParameterStream::Direction::kReverse}) {
    for (std::size_t i = 0; i < l.groups.size(); ++i) {
      const std::size_t g =
          dir == ParameterStream::Direction::kForward ? i : l.groups.size() - 1 - i;
      const std::size_t n = l.groups[g].elements;
      std::vector<std::uint16_t> got(n), expected(n);
      ASSERT_OK(stream.Load(g, {got.data(), n, DType::kBF16}, dir));
      ASSERT_OK(
          Convert({ref.master[g].data(), n, DType::kF32}, {expected.data(), n, DType::kBF16}));
      EXPECT_EQ(got, expected) << g;
    }
  }
  EXPECT_GT(off.store->stats().prefetch_hits + off.store->stats().prefetch_misses, 0u);
  EXPECT_THAT(stream.AcquireOnDevice(1, 0, {}), StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace memascend
