// A child process runs steps over a VersionedTrainingState (each step writes a whole new
// version whose every element is the step number, then commits it) and is killed with
// SIGKILL at random moments. After each kill the state resumes at a step no older than the
// last one the child saw durable, and every element of it holds that step: never a mix.
#include <chrono>
#include <random>
#include <signal.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include <memascend/training_state.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"
#include "train/state_test_util.h"

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;

StateLayout Layout() {
  StateLayout l;
  l.groups = {{"a", 70000, true}, {"b", 30000, true}, {"c", 50000, false}};
  l.param_dtype = l.grad_dtype = DType::kF16;
  l.part_elements = 16384;
  return l;
}

using Opened = ::memascend::testing::OpenedState;

// The bound on staged bytes (Note [bounded staging]): 0 (only at commit), or 96 KiB (the
// staged tensors committed many times a step, the previous record rewritten first).
std::uint64_t g_max_staged = VersionedTrainingStateOptions{}.max_staged_bytes;

absl::Status Open(const std::string& path, Opened* o) {
  TensorStoreOptions so;
  so.host_budget_bytes = 256 * 1024;  // below one version: evictions write back mid-step
  so.write_behind = true;
  MEMASCEND_ASSIGN_OR_RETURN(o->volume, Volume::Open(path, {}));
  MEMASCEND_ASSIGN_OR_RETURN(o->store, TensorStore::Open(o->volume.get(), so));
  VersionedTrainingStateOptions vo;
  vo.in_place = false;  // two versions; a state in place: state_in_place_crash_test.cpp
  vo.max_staged_bytes = g_max_staged;
  MEMASCEND_ASSIGN_OR_RETURN(
      o->state, VersionedTrainingState::Open(o->store.get(), o->volume.get(), Layout(), vo));
  return absl::OkStatus();
}

constexpr StateKind kKinds[] = {StateKind::kParameters, StateKind::kMaster, StateKind::kExpAvg,
                                StateKind::kExpAvgSq};

[[noreturn]] void Child(const std::string& path, int fd) {
  Opened o;
  if (!Open(path, &o).ok()) _exit(10);
  auto last = o.state->Resume(77);
  if (!last.ok()) _exit(11);
  std::uint64_t step = last->has_value() ? (*last)->step : 0;
  const StateLayout& l = o.state->layout();
  for (;;) {
    ++step;
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t p = 0; p < l.Parts(g); ++p) {
        for (StateKind k : kKinds) {
          if (!l.Stored(k, g)) continue;
          auto b = k == StateKind::kParameters ? o.state->Overwrite(k, g, p, true)
                                               : o.state->Update(k, g, p);
          if (!b.ok()) _exit(12);
          if (k == StateKind::kParameters) {
            for (auto& h : b->as<std::uint16_t>()) h = static_cast<std::uint16_t>(step);
          } else {
            for (float& f : b->as<float>()) f = static_cast<float>(step);
          }
        }
      }
    }
    CommitRecord r;
    r.step = step;
    r.version = 1 - o.state->current_version();
    r.fingerprint = 77;
    r.user = "step " + std::to_string(step);
    if (!o.state->Commit(r).ok() || !o.state->Settle().ok()) _exit(13);
    const std::string line = std::to_string(step) + "\n";
    if (::write(fd, line.data(), line.size()) < 0) _exit(14);
  }
}

class TrainingStateCrash : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(TrainingStateCrash, EveryKillResumesAWholeCommittedStep) {
  g_max_staged = GetParam();
  ScratchPath p("trainstatecrash");
  VolumeFormatOptions f;
  VersionedTrainingStateOptions vo;
  vo.in_place = false;
  vo.max_staged_bytes = g_max_staged;
  f.size = VersionedTrainingState::VolumeBytes(Layout(), vo);
  ASSERT_OK(Volume::Format(p.path(), f));
  std::uint64_t durable = 0;
  std::mt19937 rng(11);
  for (int round = 0; round < 12; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      Child(p.path(), fds[1]);
    }
    ::close(fds[1]);
    bool killed = false;
    int exit_code = 0;
    const std::string log = ::memascend::testing::KillAndCollect(
        pid, fds[0], std::chrono::milliseconds(40 + rng() % 160), &killed, &exit_code);
    ASSERT_TRUE(killed) << "the child exited with " << exit_code;
    std::istringstream lines(log);
    for (std::uint64_t s; lines >> s;) durable = std::max(durable, s);

    Opened o;
    ASSERT_OK(Open(p.path(), &o));
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(77));
    const std::uint64_t step = last.has_value() ? last->step : 0;
    ASSERT_GE(step, durable) << "round " << round << " lost a durable step";
    if (last.has_value()) {
      EXPECT_EQ(last->user, "step " + std::to_string(step));
    }
    const StateLayout& l = o.state->layout();
    if (step == 0) continue;  // nothing committed yet: nothing to compare
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t part = 0; part < l.Parts(g); ++part) {
        for (StateKind k : kKinds) {
          if (!l.Stored(k, g)) continue;
          ASSERT_OK_AND_ASSIGN(StateBuffer b, o.state->Read(k, g, part, false));
          if (k == StateKind::kParameters) {
            for (std::uint16_t h : b.as<std::uint16_t>())
              ASSERT_EQ(h, static_cast<std::uint16_t>(step)) << "round " << round;
          } else {
            for (float v : b.as<float>())
              ASSERT_EQ(v, static_cast<float>(step)) << "round " << round;
          }
        }
      }
    }
    durable = step;
  }
  EXPECT_GT(durable, 0u) << "no step was ever committed";
}

INSTANTIATE_TEST_SUITE_P(Staging, TrainingStateCrash,
                         ::testing::Values(std::uint64_t{0}, std::uint64_t{96} << 10),
                         [](const ::testing::TestParamInfo<std::uint64_t>& i) {
                           return i.param == 0 ? std::string("AtCommit")
                                               : std::string("Bounded96KiB");
                         });

}  // namespace
}  // namespace memascend
