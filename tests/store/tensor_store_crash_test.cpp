// A child process updates durable tensors through a store under a tight budget (so
// evictions write back on their own) and flushes now and then; it is killed with
// SIGKILL at random moments. After each kill every tensor must hold a version no older
// than the last flush the child reported, byte for byte.
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <signal.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include <memascend/tensor_store.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;

constexpr int kTensors = 8;
constexpr std::size_t kBytes = 192 * 1024;

std::string NameOf(int k) { return "state." + std::to_string(k); }

TensorSpec SpecOf(int k) {
  TensorSpec s;
  s.name = NameOf(k);
  s.bytes = kBytes;
  s.dtype = DType::kF32;
  s.use = Use::kOptimizerState;
  s.durability = Durability::kDurable;
  return s;
}

TensorStoreOptions Options() {
  TensorStoreOptions o;
  o.host_budget_bytes = 3 * kBytes;
  return o;
}

// Versions continue from what the volume holds (a tensor's version is found by matching).
[[noreturn]] void Child(const std::string& path, int fd, std::map<int, std::uint64_t> version,
                        unsigned seed) {
  auto volume = Volume::Open(path, {});
  if (!volume.ok()) _exit(10);
  auto store = TensorStore::Open(volume->get(), Options());
  if (!store.ok()) _exit(11);
  std::vector<TensorId> ids;
  for (int k = 0; k < kTensors; ++k) ids.push_back(*(*store)->Register(SpecOf(k)));
  std::mt19937 rng(seed);
  std::map<int, bool> touched;  // written by this run: only these does a flush vouch for
  for (int step = 0;; ++step) {
    const int k = static_cast<int>(rng() % kTensors);
    const std::uint64_t v = ++version[k];
    touched[k] = true;
    const std::string w = "W " + std::to_string(k) + " " + std::to_string(v) + "\n";
    if (::write(fd, w.data(), w.size()) < 0) _exit(12);
    auto lease = (*store)->Acquire(ids[static_cast<std::size_t>(k)]);
    if (!lease.ok()) _exit(13);
    const auto p = Pattern(NameOf(k), v, kBytes);
    std::memcpy(lease->data(), p.data(), kBytes);
    lease->MarkDirty();
    lease->Release();
    if (step % 5 == 4) {
      if (!(*store)->Flush().ok()) _exit(14);
      std::string f;
      for (const auto& [i, yes] : touched)
        f += "F " + std::to_string(i) + " " + std::to_string(version[i]) + "\n";
      if (::write(fd, f.data(), f.size()) < 0) _exit(12);
    }
  }
}

TEST(TensorStoreCrash, FlushedTensorsSurviveSigkill) {
  ScratchPath p("storecrash");
  VolumeFormatOptions f;
  f.size = 64 << 20;
  ASSERT_OK(Volume::Format(p.path(), f));
  std::map<int, std::uint64_t> flushed, written;
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      Child(p.path(), fds[1], written, static_cast<unsigned>(round + 1));
    }
    ::close(fds[1]);
    bool killed = false;
    int exit_code = 0;
    const std::string log = ::memascend::testing::KillAndCollect(
        pid, fds[0], std::chrono::milliseconds(30 + rng() % 120), &killed, &exit_code);
    ASSERT_TRUE(killed) << "the child exited with " << exit_code;
    std::istringstream lines(log);
    for (std::string kind; lines >> kind;) {
      if (kind == "W") {
        int k;
        std::uint64_t v;
        lines >> k >> v;
        written[k] = v;
      } else {  // "F k v": tensor k's version v is on stable storage
        int k;
        std::uint64_t v;
        lines >> k >> v;
        flushed[k] = v;
      }
    }
    ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(p.path(), {}));
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Options()));
    for (int k = 0; k < kTensors; ++k) {
      ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(SpecOf(k)));
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      // Some version between the last flushed one and the last one written.
      bool matched = flushed[k] == 0 && lease.data()[0] == std::byte{0};
      for (std::uint64_t v = std::max<std::uint64_t>(flushed[k], 1); !matched && v <= written[k];
           ++v) {
        const auto pat = Pattern(NameOf(k), v, kBytes);
        matched = std::memcmp(lease.data(), pat.data(), kBytes) == 0;
      }
      ASSERT_TRUE(matched) << "round " << round << ": tensor " << k << " lost its flushed version "
                           << flushed[k];
    }
    ASSERT_OK_AND_ASSIGN(FsckReport r, volume->Fsck(true));
    ASSERT_TRUE(r.clean) << "round " << round << ": " << (r.errors.empty() ? "" : r.errors[0]);
  }
}

}  // namespace
}  // namespace memascend
