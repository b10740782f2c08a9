// OffloadedTraining, the entry point: what Open refuses (and leaves behind), resuming and
// starting over, plain AdamW from plain gradients with the default options (against the
// same optimizer in memory and against AdamW written out by hand), and a Commit that is
// durable when it returns (a child killed right after it).
#include <cmath>
#include <csignal>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <sys/types.h>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/offloaded_training.h>

#include "prim/file.h"
#include "storage/volume_test_util.h"
#include "testing/process.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kPart = std::size_t{1} << 18;

// Group sizes whose parts fill whole 64 KiB extents in fp32, so that layouts of another
// part size need the same volume.
std::vector<StateGroup> Groups() {
  return {{"embed", 2 * kPart + 3 * 16384}, {"head", 19 * 16384}};
}

std::vector<float> Initial(std::size_t n, std::size_t g) {
  std::mt19937_64 rng(7 + g);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> w(n);
  for (float& x : w) x = d(rng);
  return w;
}
// Plain gradients: as a backward pass makes them, no loss scale.
std::vector<float> Gradient(std::size_t n, std::size_t g, std::uint64_t step) {
  std::mt19937_64 rng(1000 * g + step);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

// Default options but for the path, the model (fp32) and the minimum budget,
// far below the state (the store evicts and reads back).
OffloadedTrainingOptions Options(const std::string& path) {
  OffloadedTrainingOptions o;
  o.volume_path = path;
  o.groups = Groups();
  o.dtype = DType::kF32;
  o.part_elements = kPart;
  o.threads = 2;
  auto layout = OffloadedTraining::LayoutOf(o);
  EXPECT_OK(layout.status());
  if (layout.ok()) o.host_budget_bytes = OffloadedAdam::MinimumHostBudget(*layout);
  o.initial_weights = [](std::size_t g, std::span<float> w) {
    const std::vector<float> init = Initial(w.size(), g);
    std::copy(init.begin(), init.end(), w.begin());
    return absl::OkStatus();
  };
  return o;
}

// One step of the entry point: plain gradients of `step`, the update.
absl::Status TrainStep(OffloadedTraining* run, std::uint64_t step) {
  run->BeginStep();
  for (std::size_t g = run->layout().groups.size(); g-- > 0;) {
    const std::vector<float> grad = Gradient(run->layout().groups[g].elements, g, step);
    MEMASCEND_RETURN_IF_ERROR(run->SetGradient(g, {grad.data(), grad.size(), DType::kF32}));
  }
  MEMASCEND_ASSIGN_OR_RETURN(StepPlan plan, run->Step());
  if (plan.skipped || plan.loss_scale != 1.0f) return absl::InternalError("scaled or skipped");
  return absl::OkStatus();
}

std::vector<float> Master(OffloadedAdam* adam, std::size_t g) {
  std::vector<float> w(adam->layout().groups[g].elements);
  EXPECT_OK(adam->ReadState(StateKind::kMaster, g, {w.data(), w.size(), DType::kF32}));
  return w;
}

TEST(OffloadedTraining, PlainGradientsAndDefaultOptionsGiveAdamW) {
  ScratchPath path("training_adamw");
  const OffloadedTrainingOptions o = Options(path.path());
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  EXPECT_FALSE(run->resumed().has_value());
  EXPECT_EQ(run->step(), 0u);
  EXPECT_EQ(run->loss_scale(), 1.0f);
  EXPECT_GE(run->read_ahead_bytes(), OffloadedAdam::MinimumReadAhead(run->layout()));
  constexpr std::uint64_t kSteps = 3;
  for (std::uint64_t step = 1; step <= kSteps; ++step) {
    ASSERT_OK(TrainStep(run.get(), step));
    ASSERT_OK(run->Commit(step));
  }
  EXPECT_GT(run->store()->stats().evictions, 0u);  // the budget was far below the state

  const std::size_t groups = run->layout().groups.size();

  // AdamW written out (PyTorch's torch.optim.AdamW, fp32): within rounding.
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t n = run->layout().groups[g].elements;
    std::vector<float> p = Initial(n, g), m(n, 0.0f), v(n, 0.0f);
    for (std::uint64_t step = 1; step <= kSteps; ++step) {
      const std::vector<float> grad = Gradient(n, g, step);
      const double bc1 = 1 - std::pow(0.9, static_cast<double>(step));
      const double bc2 = 1 - std::pow(0.999, static_cast<double>(step));
      for (std::size_t i = 0; i < n; ++i) {
        p[i] *= 1.0f - 1e-3f * 1e-2f;
        m[i] = 0.9f * m[i] + 0.1f * grad[i];
        v[i] = 0.999f * v[i] + 0.001f * grad[i] * grad[i];
        const double mi = m[i], vi = v[i];
        p[i] -= static_cast<float>(1e-3 / bc1 * mi / (std::sqrt(vi / bc2) + 1e-8));
      }
    }
    const std::vector<float> got = Master(run->optimizer(), g);
    std::vector<float> params(n);
    ASSERT_OK(run->LoadParameters(g, {params.data(), n, DType::kF32}));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got[i], p[i], 1e-6f + 1e-5f * std::fabs(p[i])) << "group " << g << " at " << i;
      ASSERT_EQ(params[i], got[i]) << "fp32 parameters are the master weights";
    }
  }
  ASSERT_OK(run->Close());
}

TEST(OffloadedTraining, BitsEqualTheSameOptimizerInMemory) {
  ScratchPath path("training_memory");
  OffloadedTrainingOptions o = Options(path.path());
  o.dtype = DType::kBF16;  // rounded gradients and parameters, stored in parts
  o.host_budget_bytes = 0;
  {
    auto layout = OffloadedTraining::LayoutOf(o);
    ASSERT_OK(layout.status());
    o.host_budget_bytes = OffloadedAdam::MinimumHostBudget(*layout);
  }
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto memory, InMemoryTrainingState::Create(run->layout()));
  OffloadedAdamOptions ao;  // the defaults: no loss scaling
  ao.weight_decay = 1e-2f;
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(memory.get(), ao, &threads));
  const StateLayout& l = run->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g)
    ASSERT_OK(adam->Initialize(g, Initial(l.groups[g].elements, g)));
  ASSERT_OK(adam->Commit(0));
  for (std::uint64_t step = 1; step <= 3; ++step) {
    ASSERT_OK(TrainStep(run.get(), step));
    ASSERT_OK(run->Commit(step));
    adam->BeginBackward();
    for (std::size_t g = l.groups.size(); g-- > 0;) {
      const std::vector<float> grad = Gradient(l.groups[g].elements, g, step);
      for (std::size_t p = 0; p < l.Parts(g); ++p) {
        const auto [begin, end] = l.PartRange(g, p);
        ASSERT_OK(adam->SetGradient(g, p, {grad.data() + begin, end - begin, DType::kF32}));
      }
    }
    ASSERT_OK_AND_ASSIGN(StepPlan plan, adam->EndBackward());
    ASSERT_FALSE(plan.skipped);
    ASSERT_OK(adam->UpdateAll());
    ASSERT_OK(adam->Commit(step));
  }
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    const std::vector<float> want = Master(adam.get(), g), got = Master(run->optimizer(), g);
    ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * 4), 0) << "group " << g;
    std::vector<std::uint16_t> pw(want.size()), pg(want.size());
    ASSERT_OK(adam->LoadParameters(g, {pw.data(), pw.size(), DType::kBF16}));
    ASSERT_OK(run->LoadParameters(g, {pg.data(), pg.size(), DType::kBF16}));
    ASSERT_EQ(pw, pg) << "group " << g;
  }
}

TEST(OffloadedTraining, ResumesRefusesOrStartsOver) {
  ScratchPath path("training_resume");
  OffloadedTrainingOptions o = Options(path.path());
  std::vector<float> after_two;
  {
    ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
    for (std::uint64_t step = 1; step <= 2; ++step) {
      ASSERT_OK(TrainStep(run.get(), step));
      ASSERT_OK(run->Commit(step, "two"));
    }
    after_two = Master(run->optimizer(), 1);
  }
  // A committed state with neither resume nor overwrite: refused, left as it was.
  EXPECT_THAT(OffloadedTraining::Open(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("holds this model's training state at step 2")));
  o.resume = o.overwrite = true;
  EXPECT_THAT(OffloadedTraining::Open(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.overwrite = false;
  o.run_id = 5;  // another run's state is refused on resume
  EXPECT_THAT(OffloadedTraining::Open(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another run")));
  o.run_id = 0;
  {
    o.initial_weights = nullptr;  // not needed to resume
    ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
    ASSERT_TRUE(run->resumed().has_value());
    EXPECT_EQ(run->resumed()->user, "two");
    EXPECT_EQ(run->step(), 2u);
    EXPECT_EQ(run->optimizer()->adam_step(), 2);
    EXPECT_EQ(Master(run->optimizer(), 1), after_two);
  }
  // Starting over: the initial weights again, at step 0.
  o = Options(path.path());
  o.overwrite = true;
  {
    ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
    EXPECT_FALSE(run->resumed().has_value());
    EXPECT_EQ(run->step(), 0u);
    EXPECT_EQ(Master(run->optimizer(), 1), Initial(Groups()[1].elements, 1));
  }
  o.overwrite = false;
  o.resume = true;
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  ASSERT_TRUE(run->resumed().has_value());
  EXPECT_EQ(run->step(), 0u);
}

TEST(OffloadedTraining, ABudgetBelowTheMinimumIsRefusedBeforeAnythingIsWritten) {
  ScratchPath path("training_budget");
  OffloadedTrainingOptions o = Options(path.path());
  ASSERT_OK_AND_ASSIGN(const StateLayout l, OffloadedTraining::LayoutOf(o));
  o.host_budget_bytes = OffloadedAdam::MinimumHostBudget(l) - 4096;
  EXPECT_THAT(
      OffloadedTraining::Open(o).status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               HasSubstr("give host_budget_bytes " +
                         std::to_string(OffloadedAdam::MinimumHostBudget(l)) + " or more")));
  EXPECT_FALSE(prim::PathExists(path.path()));
  o.host_budget_bytes = OffloadedAdam::MinimumHostBudget(l);  // the minimum itself is enough
  ASSERT_OK(OffloadedTraining::Open(o).status());
}

// Found by a review as a native trainer: each refused before anything is made, where it
// aborted (std::system_error, std::length_error through a Status API), hung (a walk over
// 4e12 parts) or took a number silently.
TEST(OffloadedTraining, OutOfRangeOptionsAreRefusedBeforeAnythingIsMade) {
  ScratchPath path("training_range");
  for (int threads : {-5, 100000}) {
    OffloadedTrainingOptions o = Options(path.path());
    o.threads = threads;
    EXPECT_THAT(OffloadedTraining::Open(o).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[0, 1024]")));
  }
  for (std::size_t n : {std::size_t{1} << 61, (std::size_t{1} << 62) + 1024}) {
    OffloadedTrainingOptions o = Options(path.path());
    o.groups[0].elements = n;
    o.host_budget_bytes = 64 << 20;
    EXPECT_THAT(OffloadedTraining::Open(o).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^48 elements")));
  }
  EXPECT_FALSE(prim::PathExists(path.path()));
}

// OffloadedAdam Note [every part once]: a group left out of a step updated from the last
// step's gradient (or from zeros, part by part as the store had kept it), silently.
TEST(OffloadedTraining, AStepWithAGroupLeftOutIsRefused) {
  ScratchPath path("training_left_out");
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(Options(path.path())));
  ASSERT_OK(TrainStep(run.get(), 1));
  ASSERT_OK(run->Commit(1));
  const std::vector<float> before = Master(run->optimizer(), 1);
  run->BeginStep();
  const std::vector<float> grad = Gradient(run->layout().groups[0].elements, 0, 2);
  ASSERT_OK(run->SetGradient(0, {grad.data(), grad.size(), DType::kF32}));
  EXPECT_THAT(run->Step().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no gradient")));
  EXPECT_EQ(Master(run->optimizer(), 1), before);
  ASSERT_OK(TrainStep(run.get(), 2));  // the step again, whole
  ASSERT_OK(run->Commit(2));
}

TEST(OffloadedTraining, AVolumeTooSmallIsRefusedAtOpen) {
  ScratchPath path("training_small");
  OffloadedTrainingOptions o = Options(path.path());
  ASSERT_OK_AND_ASSIGN(const StateLayout l, OffloadedTraining::LayoutOf(o));
  const std::uint64_t need = OffloadedTraining::RequiredVolumeBytes(l);
  EXPECT_EQ(need, VersionedTrainingState::DataBytes(l));        // Note [volume size]
  EXPECT_LE(need, 2 * VersionedTrainingState::StoredBytes(l));  // never more than twice
  // A new file of a given size: refused, and the file it made is gone.
  o.volume_bytes = need / 2;
  EXPECT_THAT(
      OffloadedTraining::Open(o).status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               HasSubstr("give volume_bytes " +
                         std::to_string(OffloadedTraining::DefaultVolumeBytes(l)) + " or more")));
  EXPECT_FALSE(prim::PathExists(path.path()));
  // An existing volume file too small grows to the default size (Volume Note [volume
  // growth]), what it holds kept.
  VolumeFormatOptions f;
  f.size = need / 2;
  ASSERT_OK(Volume::Format(path.path(), f));
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(path.path(), {}));
    ASSERT_OK(v->Put("mine", Pattern("mine", 1, 4096), Durability::kDurable));
  }
  o.volume_bytes = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto grown, OffloadedTraining::Open(o));
    EXPECT_GE(grown->volume()->stats().data_bytes, need);
    EXPECT_TRUE(grown->volume()->Stat("mine").ok());
  }
  // The default size is enough.
  ScratchPath fresh("training_default_size");
  o.volume_path = fresh.path();
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  EXPECT_GE(run->volume()->stats().data_bytes, need);
}

TEST(OffloadedTraining, AnotherLayoutIsRefusedAtOpen) {
  ScratchPath path("training_layout");
  OffloadedTrainingOptions o = Options(path.path());
  ASSERT_OK(OffloadedTraining::Open(o).status());
  o.part_elements = 2 * kPart;  // a changed part size
  o.host_budget_bytes *= 2;     // (the least budget for its parts)
  o.resume = true;
  EXPECT_THAT(OffloadedTraining::Open(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another layout (groups, sizes, dtypes or part size)")));
  o.groups[1].elements += 16384;  // a changed model
  o.part_elements = kPart;
  EXPECT_THAT(OffloadedTraining::Open(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overwrite")));
  o.resume = false;
  o.overwrite = true;  // starts over with the new layout
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  EXPECT_EQ(run->layout().groups[1].elements, Groups()[1].elements + 16384);
}

TEST(OffloadedTraining, ANewStateNeedsItsWeights) {
  ScratchPath path("training_weights");
  OffloadedTrainingOptions o = Options(path.path());
  o.initial_weights = nullptr;
  o.resume = true;  // nothing to resume
  EXPECT_THAT(OffloadedTraining::Open(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial_weights")));
  EXPECT_FALSE(prim::PathExists(path.path()));
}

// Weights given a part at a time (no group whole in memory) start the state whole ones
// would: every part asked for once, in order, and the same bits through a step. Both
// ways at once are refused before anything is made.
TEST(OffloadedTraining, WeightsGivenAPartAtATimeStartTheSameState) {
  ScratchPath whole_path("training_whole"), parts_path("training_parts");
  const OffloadedTrainingOptions whole = Options(whole_path.path());
  OffloadedTrainingOptions parts = Options(parts_path.path());
  parts.initial_weights = nullptr;
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> asked;
  parts.initial_weights_part = [&](std::size_t g, std::size_t begin, std::span<float> w) {
    asked.emplace_back(g, begin, w.size());
    const std::vector<float> init = Initial(whole.groups[g].elements, g);
    std::copy_n(init.begin() + static_cast<std::ptrdiff_t>(begin), w.size(), w.begin());
    return absl::OkStatus();
  };
  ASSERT_OK_AND_ASSIGN(auto a, OffloadedTraining::Open(whole));
  ASSERT_OK_AND_ASSIGN(auto b, OffloadedTraining::Open(parts));
  const StateLayout& l = b->layout();
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> expected;
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      expected.emplace_back(g, begin, end - begin);
    }
  }
  EXPECT_EQ(asked, expected);
  EXPECT_GT(expected.size(), l.groups.size());  // some group in several parts
  ASSERT_OK(TrainStep(a.get(), 1));
  ASSERT_OK(TrainStep(b.get(), 1));
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    std::vector<float> x(l.groups[g].elements), y(l.groups[g].elements);
    ASSERT_OK(a->LoadParameters(g, {x.data(), x.size(), DType::kF32}));
    ASSERT_OK(b->LoadParameters(g, {y.data(), y.size(), DType::kF32}));
    EXPECT_EQ(x, y) << "group " << g;
  }
  ScratchPath both_path("training_both");
  OffloadedTrainingOptions both = parts;
  both.volume_path = both_path.path();
  both.initial_weights = whole.initial_weights;
  EXPECT_THAT(OffloadedTraining::Open(both).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exclude each other")));
  EXPECT_FALSE(prim::PathExists(both_path.path()));
}

// Commit returns once the step is durable: a child killed with SIGKILL right after it
// returned leaves that step to resume.
TEST(OffloadedTraining, ACommitIsDurableWhenItReturns) {
  ScratchPath path("training_durable");
  const OffloadedTrainingOptions o = Options(path.path());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto run = OffloadedTraining::Open(o);
    if (!run.ok()) _exit(10);
    for (std::uint64_t step = 1; step <= 2; ++step) {
      if (!TrainStep(run->get(), step).ok()) _exit(11);
      if (!(*run)->Commit(step, "durable").ok()) _exit(12);
    }
    ::kill(::getpid(), SIGKILL);  // no destructor, no settle
    _exit(13);
  }
  EXPECT_EQ(::memascend::testing::ExitCodeOf(child), -1) << "the child was not killed";
  OffloadedTrainingOptions again = o;
  again.resume = true;
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(again));
  ASSERT_TRUE(run->resumed().has_value());
  EXPECT_EQ(run->resumed()->step, 2u);
  EXPECT_EQ(run->optimizer()->adam_step(), 2);
}

TEST(OffloadedTraining, CommitAsyncReturnsATicket) {
  ScratchPath path("training_async");
  OffloadedTrainingOptions o = Options(path.path());
  {
    ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
    ASSERT_OK(TrainStep(run.get(), 1));
    ASSERT_OK_AND_ASSIGN(CommitTicket ticket, run->CommitAsync(1));
    EXPECT_TRUE(ticket.valid());
    EXPECT_EQ(ticket.step(), 1u);
    CommitTicket moved = std::move(ticket);
    EXPECT_FALSE(ticket.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_OK(ticket.Wait());
    EXPECT_OK(moved.Wait());
    EXPECT_OK(moved.Wait());  // repeatable
    // A ticket dropped unwaited: the next step's update and Close settle the commit.
    ASSERT_OK(TrainStep(run.get(), 2));
    ASSERT_OK(run->CommitAsync(2, "async").status());
    EXPECT_EQ(run->step(), 2u);
    ASSERT_OK(run->Close());
    EXPECT_EQ(run->optimizer(), nullptr);
    EXPECT_THAT(run->Commit(3), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  o.resume = true;
  ASSERT_OK_AND_ASSIGN(auto run, OffloadedTraining::Open(o));
  ASSERT_TRUE(run->resumed().has_value());
  EXPECT_EQ(run->resumed()->step, 2u);
  EXPECT_EQ(run->resumed()->user, "async");
}

}  // namespace
}  // namespace memascend
