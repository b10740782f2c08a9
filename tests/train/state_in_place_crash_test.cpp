// Note [state in place]: a child process trains an OffloadedAdam over a state updated in
// place, its parts committed in batches mid-step, and kills itself with SIGKILL at its
// N-th write to the volume, for N swept over every write of its steps: in the backward
// pass (before the gradients are durable), while the gradients are made durable, between
// the batches of parts, in the commit, and while resuming (finishing a torn step). After
// each kill the parent resumes (finishing a torn step if there is one) and finds the
// state of the uninterrupted run at the step it resumed, bit for bit, never older than
// the last step the child saw durable.
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <signal.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <tuple>
#include <unistd.h>

#include <gtest/gtest.h>

#include <memascend/io_engine.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/training_state.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"
#include "train/state_test_util.h"

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;

constexpr std::size_t kPart = std::size_t{1} << 16;

StateLayout Layout() {
  StateLayout l;
  l.groups = {
      {"embed", 3 * kPart + 5'000, false}, {"block", 2 * kPart, true}, {"head", 90'000, true}};
  l.param_dtype = DType::kBF16;
  l.grad_dtype = DType::kBF16;
  l.part_elements = kPart;
  return l;
}

// The staging bound and commit interval of the run under test (set by the test before it
// forks). Both bounds are below the state's 6.8 MiB: several batches a step, the
// gradients written behind the backward pass (Note [gradient write-behind]). 1 MiB is
// under four parts (896 KiB each): one batch at a time; 4 MiB commits each batch in the
// background while the next parts are updated and written behind (Note [batch overlap]
// in training_state.cpp). Unbounded, every third step durable (Note [commit interval]),
// or every step, a whole step staged (memascend-train --staging step).
std::uint64_t staging_bound = 1 << 20;
std::uint32_t commit_every = 1;

struct Config {
  std::uint64_t bound;
  std::uint32_t every;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << "bound " << c.bound << ", every " << c.every << " step(s) durable";
}

void Use(const Config& c) {
  staging_bound = c.bound;
  commit_every = c.every;
}

VersionedTrainingStateOptions StateOptions() {
  VersionedTrainingStateOptions vo;
  vo.max_staged_bytes = staging_bound;
  vo.commit_every = commit_every;
  return vo;
}

OffloadedAdamOptions AdamOptions() {
  OffloadedAdamOptions o;
  o.groups = {{1e-3f, 0.1f}, {3e-3f, 0.0f}, {2e-3f, 0.01f}};
  o.max_grad_norm = 0.5f;
  o.scaler = NoLossScaling();
  o.fingerprint = 41;
  return o;
}

std::vector<float> Initial(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> w(n);
  for (float& x : w) x = d(rng);
  return w;
}
std::vector<float> Gradient(std::size_t n, std::size_t g, std::uint64_t step) {
  std::mt19937_64 rng(1000 * g + step);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

// The uninterrupted run in memory: the same optimizer over InMemoryTrainingState.
struct Reference {
  std::unique_ptr<InMemoryTrainingState> state;
  std::unique_ptr<OffloadedAdam> adam;
};

// The kill: SIGKILL at the n-th write (counted from the engine's creation; 0: never).
class KillAtWrite final : public FaultInjector {
 public:
  explicit KillAtWrite(std::uint64_t n, std::chrono::milliseconds delay = {})
      : n_(n), delay_(delay) {}
  std::int64_t Adjust(const IoRequest& a, std::int64_t result) override {
    if (a.op != IoOp::kWrite) return result;
    const std::uint64_t count = writes_.fetch_add(1) + 1;
    if (count == n_) ::raise(SIGKILL);
    if (fail_at_.load() != 0 && count == fail_at_.load()) return -EIO;
    if (a.length <= 8192 && delay_.count() > 0) std::this_thread::sleep_for(delay_);
    return result;
  }
  std::uint64_t writes() const { return writes_.load(); }
  // The n-th write from now fails with EIO, once.
  void FailWrite(std::uint64_t n) { fail_at_ = writes_.load() + n; }

 private:
  std::uint64_t n_;
  std::chrono::milliseconds delay_;  // small writes (records, progress) take this longer
  std::atomic<std::uint64_t> writes_{0};
  std::atomic<std::uint64_t> fail_at_{0};
};

struct Opened {
  std::shared_ptr<KillAtWrite> kill;
  std::unique_ptr<IoEngine> engine;
  ::memascend::testing::OpenedState o;
  std::unique_ptr<KernelThreads> threads;
  std::unique_ptr<OffloadedAdam> adam;
};

absl::Status Open(const std::string& path, std::uint64_t kill_at, Opened* r,
                  std::chrono::milliseconds write_delay = {}, std::uint64_t host_budget = 0) {
  IoEngineOptions eo;
  eo.backend = IoBackendChoice::kThreadPool;
  r->kill = std::make_shared<KillAtWrite>(kill_at, write_delay);
  eo.fault_injector = r->kill;
  MEMASCEND_ASSIGN_OR_RETURN(r->engine, IoEngine::Create(eo));
  VolumeOpenOptions vo;
  vo.engine = r->engine.get();
  MEMASCEND_ASSIGN_OR_RETURN(r->o.volume, Volume::Open(path, vo));
  TensorStoreOptions so;
  so.host_budget_bytes =
      host_budget != 0 ? host_budget : 3 * OffloadedAdam::MinimumHostBudget(Layout()) / 2;
  // (the default: evictions mid-step, and write-behind)
  so.write_behind = host_budget == 0;  // (a whole state resident: written at commits only)
  so.defer_prefetches = true;
  MEMASCEND_ASSIGN_OR_RETURN(r->o.store, TensorStore::Open(r->o.volume.get(), so));
  MEMASCEND_ASSIGN_OR_RETURN(
      r->o.state,
      VersionedTrainingState::Open(r->o.store.get(), r->o.volume.get(), Layout(), StateOptions()));
  r->threads = std::make_unique<KernelThreads>(2);
  MEMASCEND_ASSIGN_OR_RETURN(
      r->adam, OffloadedAdam::Create(r->o.state.get(), AdamOptions(), r->threads.get()));
  return absl::OkStatus();
}

absl::Status Start(OffloadedAdam* adam) {
  const StateLayout& l = adam->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g)
    MEMASCEND_RETURN_IF_ERROR(adam->Initialize(g, Initial(l.groups[g].elements, g)));
  return adam->Commit(0);
}

// Step `step`'s backward pass: its gradients, the last group first, then the plan.
absl::Status Backward(OffloadedAdam* adam, std::uint64_t step) {
  const StateLayout& l = adam->layout();
  adam->BeginBackward();
  for (std::size_t g = l.groups.size(); g-- > 0;) {
    const auto f = Gradient(l.groups[g].elements, g, step);
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      MEMASCEND_RETURN_IF_ERROR(
          adam->SetGradient(g, p, {f.data() + begin, end - begin, DType::kF32}));
    }
  }
  MEMASCEND_ASSIGN_OR_RETURN(StepPlan plan, adam->EndBackward());
  if (plan.skipped) return absl::InternalError("unexpected skipped step");
  return absl::OkStatus();
}

// Step `step`: the backward pass, the update, the commit in the background (settled by the
// next step's first gradient).
absl::Status Step(OffloadedAdam* adam, std::uint64_t step) {
  MEMASCEND_RETURN_IF_ERROR(Backward(adam, step));
  MEMASCEND_RETURN_IF_ERROR(adam->UpdateAll());
  return adam->CommitAsync(step).status();
}

[[noreturn]] void Child(const std::string& path, std::uint64_t kill_at, int fd) {
  Opened r;
  if (!Open(path, kill_at, &r).ok()) _exit(10);
  auto last = r.adam->Resume();
  if (!last.ok()) _exit(11);
  std::uint64_t step = 0;
  if (last->has_value()) {
    step = (*last)->step;
  } else if (!Start(r.adam.get()).ok()) {
    _exit(12);
  }
  for (;;) {
    if (!Step(r.adam.get(), ++step).ok()) _exit(13);
    // Every other step's commit runs under the next backward pass (Note [gradient
    // write-behind]: its gradients are staged while the commit runs); the others settle
    // and say which step is durable.
    if (step % 2 == 1) continue;
    if (!r.adam->Settle().ok()) _exit(14);
    const std::string line = std::to_string(r.o.state->durable_step()) + "\n";
    if (::write(fd, line.data(), line.size()) < 0) _exit(15);
  }
}

// Every stored part of the state equals the reference's.
void ExpectSame(TrainingStateStorage* got, TrainingStateStorage* want, std::uint64_t step) {
  const StateLayout& l = got->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      for (StateKind k :
           {StateKind::kParameters, StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (!l.Stored(k, g)) continue;
        ASSERT_OK_AND_ASSIGN(StateBuffer a, got->Read(k, g, p, false));
        ASSERT_OK_AND_ASSIGN(StateBuffer b, want->Read(k, g, p, false));
        ASSERT_EQ(a.bytes, b.bytes);
        ASSERT_EQ(std::memcmp(a.data, b.data, a.bytes), 0)
            << ToString(k) << " of group " << g << " part " << p << " at step " << step;
      }
    }
  }
}

class StateInPlaceCrash : public ::testing::TestWithParam<Config> {};

TEST_P(StateInPlaceCrash, AKillAtAnyWriteResumesToTheUninterruptedState) {
  Use(GetParam());
  ScratchPath path("state_in_place_crash");
  VolumeFormatOptions f;
  f.size = VersionedTrainingState::VolumeBytes(Layout(), StateOptions());
  ASSERT_OK(Volume::Format(path.path(), f));
  // The writes of the child's first steps (its start included), counted by a run that is
  // not killed: the sweep covers them.
  std::uint64_t writes_per_step = 0;
  {
    ScratchPath probe("state_in_place_probe");
    ASSERT_OK(Volume::Format(probe.path(), f));
    Opened r;
    ASSERT_OK(Open(probe.path(), 0, &r));
    ASSERT_OK(Start(r.adam.get()));
    ASSERT_OK(Step(r.adam.get(), 1));
    ASSERT_OK(r.adam->Settle());
    const std::uint64_t before = r.kill->writes();
    for (std::uint64_t s = 2; s < 2 + commit_every; ++s) {  // a commit's steps
      ASSERT_OK(Step(r.adam.get(), s));
      ASSERT_OK(r.adam->Settle());
    }
    writes_per_step = r.kill->writes() - before;
  }
  ASSERT_GT(writes_per_step, 20u);

  {  // the initial state, committed: every kill below falls in a step or a resume
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r));
    ASSERT_OK(Start(r.adam.get()));
  }
  Reference ref;
  ASSERT_OK_AND_ASSIGN(ref.state, InMemoryTrainingState::Create(Layout()));
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(ref.adam, OffloadedAdam::Create(ref.state.get(), AdamOptions(), &threads));
  ASSERT_OK(Start(ref.adam.get()));
  std::uint64_t ref_step = 0;

  std::uint64_t durable = 0;
  int torn = 0, whole = 0;
  std::mt19937_64 rng(7);
  // Kill points: 1.5 steps' writes from the child's start (its resume, then its steps), in
  // 40 rounds, each offset a little at random so that no phase falls between them.
  const std::uint64_t stride = std::max<std::uint64_t>(1, (writes_per_step * 3 / 2 + 39) / 40);
  for (std::uint64_t round = 0; round < 40; ++round) {
    const std::uint64_t kill_at = 1 + round * stride + rng() % stride;
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      Child(path.path(), kill_at, fds[1]);
    }
    ::close(fds[1]);
    std::string log;
    char buf[256];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) log.append(buf, n);
    ::close(fds[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "round " << round << ": the child was not killed (exit "
        << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";
    std::istringstream lines(log);
    for (std::uint64_t s; lines >> s;) durable = std::max(durable, s);

    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r));
    ASSERT_OK_AND_ASSIGN(auto at, r.o.state->Resume(AdamOptions().fingerprint));
    ASSERT_TRUE(at.has_value());
    (r.o.state->Unfinished().has_value() ? torn : whole)++;
    ASSERT_OK_AND_ASSIGN(auto last, r.adam->Resume());
    ASSERT_TRUE(last.has_value());
    ASSERT_GE(last->step, durable) << "round " << round << " lost a durable step";
    ASSERT_GE(last->step, ref_step) << "round " << round << " went back";
    while (ref_step < last->step) ASSERT_OK(Step(ref.adam.get(), ++ref_step));
    ExpectSame(r.o.state.get(), ref.state.get(), last->step);
    ASSERT_EQ(r.adam->adam_step(), static_cast<std::int64_t>(last->step));
    durable = last->step;
  }
  std::printf("%llu writes a step; %d kills left a torn step, %d none; resumed up to step %llu\n",
              static_cast<unsigned long long>(writes_per_step), torn, whole,
              static_cast<unsigned long long>(durable));
  if (staging_bound != 0) {
    EXPECT_GT(torn, 3) << "too few kills tore a step (" << whole << " left none)";
  } else {  // unbounded: no step is committed in part
    EXPECT_EQ(torn, 0);
  }
  EXPECT_GT(whole, 3) << "too few kills left no torn step (" << torn << " did)";
  EXPECT_GT(durable, 1u);
}

// Note [batch overlap]: a batch committed in the background while the next parts are
// updated carries none of them. With small writes slowed (the progress object's, 300 ms)
// the first batch of the embedding's parts commits after its last part was updated and
// written back; the process then dies before any later commit. The volume holds that
// part as it was.
TEST(StateInPlace, ABatchCommittedInTheBackgroundCarriesNoPartUpdatedAfterIt) {
  Use({std::uint64_t{4} << 20, 1});
  ScratchPath path("state_in_place_overlap");
  VolumeFormatOptions f;
  f.size = VersionedTrainingState::VolumeBytes(Layout(), StateOptions());
  ASSERT_OK(Volume::Format(path.path(), f));
  {
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r));
    ASSERT_OK(Start(r.adam.get()));
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Opened r;
    if (!Open(path.path(), 0, &r, std::chrono::milliseconds(300)).ok()) _exit(10);
    if (!r.adam->Resume().ok()) _exit(11);
    if (!Backward(r.adam.get(), 1).ok()) _exit(12);
    // The embedding's four parts: the first three pass the batch's bytes and commit in the
    // background; the fourth is updated meanwhile and written back at once.
    if (!r.adam->UpdateGroup(0).ok()) _exit(14);
    auto last = r.o.state->Tensor(StateKind::kMaster, 0, 3, 0);
    if (!last.ok() || !r.o.store->WriteBack(*last).ok()) _exit(15);
    if (!r.o.state->Settle().ok()) _exit(16);
    _exit(0);  // as a crash: nothing more is committed
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  Opened r;
  ASSERT_OK(Open(path.path(), 0, &r));
  ASSERT_OK_AND_ASSIGN(auto at, r.o.state->Resume(AdamOptions().fingerprint));
  ASSERT_TRUE(at.has_value());
  ASSERT_TRUE(r.o.state->Unfinished().has_value());
  EXPECT_EQ(r.o.state->Unfinished()->parts_done, 3u);  // the first batch, and no more
  const StateLayout& l = r.adam->layout();
  const auto initial = Initial(l.groups[0].elements, 0);
  const auto [begin, end] = l.PartRange(0, 3);
  ASSERT_OK_AND_ASSIGN(StateBuffer master, r.o.state->Read(StateKind::kMaster, 0, 3, false));
  ASSERT_EQ(master.bytes, (end - begin) * sizeof(float));
  EXPECT_EQ(std::memcmp(master.data, initial.data() + begin, master.bytes), 0)
      << "the fourth part's master weights were committed with the first batch";
}

// Every stored kind of every part, as the state reads it.
std::map<std::tuple<int, std::size_t, std::size_t>, std::string> Snapshot(TrainingStateStorage* s) {
  std::map<std::tuple<int, std::size_t, std::size_t>, std::string> out;
  const StateLayout& l = s->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      for (StateKind k :
           {StateKind::kParameters, StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (!l.Stored(k, g)) continue;
        auto b = s->Read(k, g, p, false);
        EXPECT_TRUE(b.ok()) << b.status();
        if (b.ok())
          out[{static_cast<int>(k), g, p}] =
              std::string(reinterpret_cast<const char*>(b->data), b->bytes);
      }
    }
  }
  return out;
}

// A write of a step's update that fails once (EIO: a batch's write-back, its progress
// object or its journal commit), after which the caller stops and closes the state, then
// the store: the volume holds exactly the parts its progress object names updated, and
// no other part changed. A failed batch is committed again by the state's destructor (a
// reviewer's probe found the store's close committing its parts without their progress).
TEST_P(StateInPlaceCrash, AFailedWriteThenCloseLeavesTheStateItsProgressNames) {
  Use(GetParam());
  int tried = 0;
  for (std::uint64_t n = 1; n <= 80; ++n) {
    ScratchPath path("state_in_place_fail");
    VolumeFormatOptions f;
    f.size = VersionedTrainingState::VolumeBytes(Layout(), StateOptions());
    ASSERT_OK(Volume::Format(path.path(), f));
    std::map<std::tuple<int, std::size_t, std::size_t>, std::string> before;
    {
      Opened r;
      ASSERT_OK(Open(path.path(), 0, &r));
      ASSERT_OK(Start(r.adam.get()));
      before = Snapshot(r.o.state.get());
    }
    absl::Status update;
    std::uint64_t writes = 0;
    {
      Opened r;
      ASSERT_OK(Open(path.path(), 0, &r));
      ASSERT_OK(r.adam->Resume().status());
      ASSERT_OK(Backward(r.adam.get(), 1));
      const std::uint64_t start = r.kill->writes();
      r.kill->FailWrite(n);
      update = r.adam->UpdateAll();
      writes = r.kill->writes() - start;
      // No Commit: the caller stops here, and the state and then the store close.
    }
    if (update.ok() && n > writes) break;  // past the update's writes
    ++tried;
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r));
    ASSERT_OK_AND_ASSIGN(auto at, r.o.state->Resume(AdamOptions().fingerprint));
    ASSERT_TRUE(at.has_value());
    const std::size_t done =
        r.o.state->Unfinished().has_value() ? r.o.state->Unfinished()->parts_done : 0;
    const auto after = Snapshot(r.o.state.get());
    const StateLayout& l = r.adam->layout();
    std::size_t index = 0;
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t p = 0; p < l.Parts(g); ++p, ++index) {
        for (const auto& [key, bytes] : after) {
          if (std::get<1>(key) != g || std::get<2>(key) != p) continue;
          EXPECT_EQ(bytes != before[key], index < done)
              << "write " << n << " failed (" << update << "); " << done << " parts done; kind "
              << std::get<0>(key) << " of group " << g << " part " << p;
        }
      }
    }
  }
  EXPECT_GT(tried, staging_bound == 0 ? 10 : 20);  // unbounded: no batches, fewer writes
}

// ---- Note [commit interval] ---------------------------------------------------------------

// The reference at `step`: a fresh in-memory run stepped there.
void ExpectReferenceAt(TrainingStateStorage* got, std::uint64_t step) {
  auto state = InMemoryTrainingState::Create(Layout());
  ASSERT_OK(state.status());
  KernelThreads threads(2);
  ASSERT_OK_AND_ASSIGN(auto adam, OffloadedAdam::Create(state->get(), AdamOptions(), &threads));
  ASSERT_OK(Start(adam.get()));
  for (std::uint64_t s = 1; s <= step; ++s) ASSERT_OK(Step(adam.get(), s));
  ExpectSame(got, state->get(), step);
}

// A whole state resident: nothing is evicted, so a step between commits writes nothing.
std::uint64_t WholeStateBudget() { return 4 * VersionedTrainingState::StoredBytes(Layout()); }

void IntervalVolume(const ScratchPath& path) {
  VolumeFormatOptions f;
  f.size = VersionedTrainingState::VolumeBytes(Layout(), StateOptions());
  EXPECT_OK(Volume::Format(path.path(), f));
  Opened r;
  EXPECT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
  EXPECT_OK(Start(r.adam.get()));
}

TEST(CommitInterval, StepsBetweenCommitsWriteNothingAndACrashResumesAtTheLastDurableOne) {
  Use({0, 3});
  ScratchPath path("commit_interval");
  IntervalVolume(path);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Opened r;
    if (!Open(path.path(), 0, &r, {}, WholeStateBudget()).ok()) _exit(10);
    if (!r.adam->Resume().ok()) _exit(11);
    for (std::uint64_t s = 1; s <= 5; ++s) {
      const std::uint64_t before = r.kill->writes();
      if (!Step(r.adam.get(), s).ok() || !r.adam->Settle().ok()) _exit(12);
      const std::uint64_t wrote = r.kill->writes() - before;
      // Steps 1, 2, 4 and 5 stay in memory; step 3's commit writes the state.
      if ((s % 3 == 0) != (wrote > 0)) _exit(20 + static_cast<int>(s));
      if (r.o.state->durable_step() != s / 3 * 3 || r.o.state->deferred_steps() != s % 3)
        _exit(30 + static_cast<int>(s));
    }
    _exit(0);  // as a crash: no destructor commits steps 4 and 5
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit " << WEXITSTATUS(status);
  {
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
    ASSERT_OK_AND_ASSIGN(auto last, r.adam->Resume());
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 3u);
    ExpectReferenceAt(r.o.state.get(), 3);
    // Steps 4 and 5 again, then a close: it makes them durable.
    ASSERT_OK(Step(r.adam.get(), 4));
    ASSERT_OK(Step(r.adam.get(), 5));
    EXPECT_EQ(r.o.state->deferred_steps(), 2u);
  }
  Opened r;
  ASSERT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
  ASSERT_OK_AND_ASSIGN(auto last, r.adam->Resume());
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->step, 5u);
  ExpectReferenceAt(r.o.state.get(), 5);
  // Persist makes a step between commits durable at once.
  ASSERT_OK(Step(r.adam.get(), 6));
  EXPECT_EQ(r.o.state->durable_step(), 5u);
  ASSERT_OK(r.adam->Persist());
  EXPECT_EQ(r.o.state->durable_step(), 6u);
  EXPECT_EQ(r.o.state->deferred_steps(), 0u);
}

// A step's update torn while two steps wait in memory (the caller stops mid-update): the
// state's destruction commits them with the torn step, which Resume finishes.
// With the whole state resident, and with a budget of three parts (the steps' parts
// evicted and staged): Persist and Resume refuse mid-update, saying why.
TEST(CommitInterval, ATornStepAfterStepsInMemoryIsFinishedOnResume) {
  Use({0, 3});
  for (std::uint64_t budget : {WholeStateBudget(), std::uint64_t{0}}) {
    SCOPED_TRACE(budget == 0 ? "parts evicted" : "the whole state resident");
    ScratchPath path("commit_interval_torn");
    IntervalVolume(path);
    {
      Opened r;
      ASSERT_OK(Open(path.path(), 0, &r, {}, budget));
      ASSERT_OK(r.adam->Resume().status());
      ASSERT_OK(Step(r.adam.get(), 1));
      ASSERT_OK(Step(r.adam.get(), 2));
      ASSERT_OK(Backward(r.adam.get(), 3));
      ASSERT_OK(r.adam->UpdateGroup(0));  // then the caller stops
      EXPECT_EQ(r.adam->Persist().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(r.o.state->Resume(AdamOptions().fingerprint).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r, {}, budget));
    ASSERT_OK_AND_ASSIGN(auto at, r.o.state->Resume(AdamOptions().fingerprint));
    ASSERT_TRUE(at.has_value());
    EXPECT_EQ(at->step, 2u);
    ASSERT_TRUE(r.o.state->Unfinished().has_value());
    EXPECT_EQ(r.o.state->Unfinished()->parts_done, r.adam->layout().Parts(0));
    ASSERT_OK_AND_ASSIGN(auto last, r.adam->Resume());
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 3u);
    ExpectReferenceAt(r.o.state.get(), 3);
  }
}

// A reviewer's probe: the n-th write of the state's close fails (of its last commit, or
// a write-behind before it, or the store's close after it), with parts of the steps in
// memory evicted and staged; the volume object lives on and a new state is opened on it
// in this process (a caller's retry), then closed. The new state and the volume reopened
// from disk find one whole step, the same: 2 (the commit held) or 0 (it failed), never a
// part of steps 1 and 2 under step 0's record: a failed state forgets what it staged
// (ObjectStore::DropStaged).
TEST(CommitInterval, AFailedLastCommitLeavesNothingStagedForALaterCommit) {
  Use({0, 3});
  int staged = 0, failed = 0;
  for (std::uint64_t n = 1; n <= 200; ++n) {
    SCOPED_TRACE("the last commit's write " + std::to_string(n) + " fails");
    ScratchPath path("commit_interval_retry");
    IntervalVolume(path);
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r));  // three parts' budget: evictions
    ASSERT_OK(r.adam->Resume().status());
    ASSERT_OK(Step(r.adam.get(), 1));
    ASSERT_OK(Step(r.adam.get(), 2));
    ASSERT_OK(r.adam->Settle());
    staged += r.o.volume->staged_bytes() > 0;
    r.kill->FailWrite(n);
    const std::uint64_t before = r.kill->writes();
    r.adam.reset();
    r.o.state.reset();
    r.o.store.reset();
    if (r.kill->writes() - before < n) break;  // past the close's writes
    const std::uint64_t leftover = r.o.volume->staged_bytes();
    std::uint64_t step = 0;
    {
      TensorStoreOptions so;
      so.host_budget_bytes = WholeStateBudget();
      ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(r.o.volume.get(), so));
      ASSERT_OK_AND_ASSIGN(auto state, VersionedTrainingState::Open(store.get(), r.o.volume.get(),
                                                                    Layout(), StateOptions()));
      ASSERT_OK_AND_ASSIGN(auto at, state->Resume(AdamOptions().fingerprint));
      ASSERT_TRUE(at.has_value());
      step = at->step;
      ASSERT_TRUE(step == 0 || step == 2) << step;
      if (step == 0) {
        ++failed;
        EXPECT_EQ(leftover, 0u) << "the failed state left staged objects";
      }
      ExpectReferenceAt(state.get(), step);
    }
    r.o.volume.reset();
    Opened again;
    ASSERT_OK(Open(path.path(), 0, &again));
    ASSERT_OK_AND_ASSIGN(auto last, again.adam->Resume());
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, step);
    ExpectReferenceAt(again.o.state.get(), step);
  }
  EXPECT_GT(staged, 0) << "no run staged parts of the steps in memory";
  EXPECT_GT(failed, 3) << "too few failed writes failed the last commit";
}

// The state's last commit fails (EIO at its first write): neither it nor the store's
// close commits anything, and the volume holds the last durable step whole.
TEST(CommitInterval, AFailedLastCommitLeavesTheLastDurableStep) {
  Use({0, 3});
  ScratchPath path("commit_interval_fail");
  IntervalVolume(path);
  {
    Opened r;
    ASSERT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
    ASSERT_OK(r.adam->Resume().status());
    ASSERT_OK(Step(r.adam.get(), 1));
    ASSERT_OK(Step(r.adam.get(), 2));
    r.kill->FailWrite(1);
    r.adam.reset();
    r.o.state.reset();
    // The store outlives the failed state, and is flushed (a caller's own flush): the
    // state's parts of steps 1 and 2 were dropped with it, so none is committed.
    ASSERT_OK(r.o.store->Flush());
  }
  Opened r;
  ASSERT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
  ASSERT_OK_AND_ASSIGN(auto last, r.adam->Resume());
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->step, 0u);
  EXPECT_FALSE(r.o.state->Unfinished().has_value());
  ExpectReferenceAt(r.o.state.get(), 0);
}

// A step the overflow check skips (no update) is committed in memory like any other step
// between the interval's commits: it writes nothing.
TEST(CommitInterval, ASkippedStepWaitsForTheIntervalToo) {
  Use({0, 3});
  ScratchPath path("commit_interval_skipped");
  IntervalVolume(path);
  Opened r;
  ASSERT_OK(Open(path.path(), 0, &r, {}, WholeStateBudget()));
  ASSERT_OK(r.adam->Resume().status());
  ASSERT_OK(Step(r.adam.get(), 1));
  ASSERT_OK(r.adam->Settle());
  const std::uint64_t before = r.kill->writes();
  const StateLayout& l = r.adam->layout();
  r.adam->BeginBackward();
  for (std::size_t g = l.groups.size(); g-- > 0;) {
    auto f = Gradient(l.groups[g].elements, g, 2);
    f[0] = std::numeric_limits<float>::infinity();
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      const auto [begin, end] = l.PartRange(g, p);
      ASSERT_OK(r.adam->SetGradient(g, p, {f.data() + begin, end - begin, DType::kF32}));
    }
  }
  ASSERT_OK_AND_ASSIGN(StepPlan plan, r.adam->EndBackward());
  ASSERT_TRUE(plan.skipped);
  ASSERT_OK(r.adam->Commit(2));
  EXPECT_EQ(r.kill->writes(), before);
  EXPECT_EQ(r.o.state->deferred_steps(), 2u);
  EXPECT_EQ(r.o.state->durable_step(), 0u);
  ASSERT_OK(Step(r.adam.get(), 3));  // the interval's commit
  ASSERT_OK(r.adam->Settle());
  EXPECT_GT(r.kill->writes(), before);
  EXPECT_EQ(r.o.state->durable_step(), 3u);
}

TEST(CommitInterval, OpenRefusesAnIntervalItCannotKeep) {
  ScratchPath path("commit_interval_refused");
  Use({0, 1});
  VolumeFormatOptions f;
  f.size = VersionedTrainingState::VolumeBytes(Layout(), StateOptions());
  ASSERT_OK(Volume::Format(path.path(), f));
  ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(path.path(), {}));
  TensorStoreOptions so;
  so.host_budget_bytes = WholeStateBudget();
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), so));
  const auto refused = [&](VersionedTrainingStateOptions vo, std::string_view says) {
    auto s = VersionedTrainingState::Open(store.get(), volume.get(), Layout(), vo);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(std::string(s.status().message()).find(says), std::string::npos) << s.status();
  };
  VersionedTrainingStateOptions vo;
  vo.commit_every = 0;
  refused(vo, "out of range");
  vo.commit_every = 2'000'000;
  refused(vo, "out of range");
  vo.commit_every = 3;  // the default bound: batches
  refused(vo, "bounded at");
  vo.max_staged_bytes = 0;
  vo.in_place = false;
  refused(vo, "two versions");

  // A volume with room for the state and 4 MiB staged (an earlier run's, of batches): not
  // for a whole version (7.7 MiB with the gradients).
  ScratchPath small("commit_interval_small");
  VolumeFormatOptions sf;
  sf.size = VersionedTrainingState::StoredBytes(Layout()) + (std::uint64_t{6} << 20);
  ASSERT_OK(Volume::Format(small.path(), sf));
  ASSERT_OK_AND_ASSIGN(auto v2, Volume::Open(small.path(), {}));
  ASSERT_OK_AND_ASSIGN(auto store2, TensorStore::Open(v2.get(), so));
  VersionedTrainingStateOptions interval;
  interval.max_staged_bytes = 0;
  interval.commit_every = 3;
  auto s = VersionedTrainingState::Open(store2.get(), v2.get(), Layout(), interval);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(std::string(s.status().message()).find("a larger volume"), std::string::npos)
      << s.status();
  // Every step durable, a whole step staged (memascend-train --staging step): the same room.
  interval.commit_every = 1;
  s = VersionedTrainingState::Open(store2.get(), v2.get(), Layout(), interval);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(std::string(s.status().message()).find("stages up to a whole version"),
            std::string::npos)
      << s.status();
  // With a bound it opens there.
  interval.max_staged_bytes = std::uint64_t{4} << 20;
  EXPECT_OK(VersionedTrainingState::Open(store2.get(), v2.get(), Layout(), interval).status());
}

INSTANTIATE_TEST_SUITE_P(Bounds, StateInPlaceCrash,
                         ::testing::Values(Config{std::uint64_t{1} << 20, 1},
                                           Config{std::uint64_t{4} << 20, 1}, Config{0, 3},
                                           Config{0, 1}),
                         [](const auto& c) {
                           return c.param.every > 1    ? std::string("EveryThirdStepDurable")
                                  : c.param.bound == 0 ? std::string("WholeStepStaged")
                                  : c.param.bound == (std::uint64_t{1} << 20)
                                      ? std::string("OneBatchAtATime")
                                      : std::string("BatchesInBackground");
                         });

}  // namespace
}  // namespace memascend
