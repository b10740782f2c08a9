// The store's GPU tier. The device pool's carving is tested everywhere (over an address
// range it never touches); the store's device paths run where a CUDA device exists and
// otherwise check that the GPU tier reports kFailedPrecondition while the host tier works.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/system.h>
#include <memascend/tensor_store.h>

#include "storage/volume_test_util.h"
#include "store/device_pool.h"
#include "store/store_test_util.h"
#include "testing/cuda_wait.h"
#include "testing/status_matchers.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend {
namespace {

using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;

bool HaveGpu() { return ProbeSystem(ProbeOptions{}).cuda.device_count > 0; }

// ---- DevicePool carving -------------------------------------------------------------

std::byte* FakeBase() { return reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40); }

TEST(DevicePool, CarvesBestFitAndCoalesces) {
  MemoryLedger ledger(MemoryLedger::Options{.sample_every_update = false, .sample_rss = false});
  store::DevicePool pool(FakeBase(), 1 * kMiB, &ledger);
  ASSERT_OK_AND_ASSIGN(std::byte * a, pool.Allocate(100 * kKiB, Use::kParameters));
  ASSERT_OK_AND_ASSIGN(std::byte * b, pool.Allocate(1000, Use::kGradients));
  ASSERT_OK_AND_ASSIGN(std::byte * c, pool.Allocate(300 * kKiB, Use::kParameters));
  EXPECT_EQ(a, FakeBase());
  EXPECT_EQ(b, a + 100 * kKiB);
  EXPECT_EQ(c, b + 1024);  // 1000 bytes round up to two 512-byte units
  EXPECT_EQ(pool.allocated(), 100 * kKiB + 1024 + 300 * kKiB);
  EXPECT_EQ(ledger.Snapshot().use(Tier::kGpu, Use::kGradients).live, 1024);
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kGpu).reserved, static_cast<std::int64_t>(kMiB));

  // Best fit: a 1000-byte block goes to the 1 KiB hole, not the large tail.
  ASSERT_OK(pool.Free(b));
  ASSERT_OK_AND_ASSIGN(std::byte * d, pool.Allocate(600, Use::kOptimizerState));
  EXPECT_EQ(d, b);
  ASSERT_OK(pool.Free(d));
  ASSERT_OK(pool.Free(a));
  ASSERT_OK(pool.Free(c));
  ASSERT_OK(pool.CheckInvariants());
  EXPECT_EQ(pool.largest_free(), kMiB);  // everything coalesced
  EXPECT_EQ(ledger.Snapshot().tier(Tier::kGpu).live, 0);
}

TEST(DevicePool, RefusesWhatItCannotHoldAndForeignPointers) {
  store::DevicePool pool(FakeBase(), 64 * kKiB, nullptr);
  ASSERT_OK_AND_ASSIGN(std::byte * a, pool.Allocate(40 * kKiB, Use::kParameters));
  EXPECT_THAT(pool.Allocate(40 * kKiB, Use::kParameters),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("largest free extent")));
  EXPECT_THAT(pool.Allocate(0, Use::kParameters), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(pool.Free(a + 512), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(pool.Free(a + 7), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(pool.Free(FakeBase() + 64 * kKiB), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(pool.Free(a));
  EXPECT_THAT(pool.Free(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  ASSERT_OK(pool.CheckInvariants());
}

TEST(DevicePool, RandomAllocationsKeepTheInvariants) {
  store::DevicePool pool(FakeBase(), 4 * kMiB, nullptr);
  std::mt19937_64 rng(7);
  std::vector<std::byte*> live;
  for (int i = 0; i < 3000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      auto b = pool.Allocate(1 + rng() % (200 * kKiB), Use::kParameters);
      if (b.ok()) live.push_back(*b);
    } else {
      const std::size_t k = rng() % live.size();
      ASSERT_OK(pool.Free(live[k]));
      live[k] = live.back();
      live.pop_back();
    }
    if (i % 100 == 0) {
      ASSERT_OK(pool.CheckInvariants()) << i;
    }
  }
  for (std::byte* b : live) ASSERT_OK(pool.Free(b));
  EXPECT_EQ(pool.allocated(), 0u);
  EXPECT_EQ(pool.largest_free(), 4 * kMiB);
}

// ---- the store's GPU tier -------------------------------------------------------------

std::unique_ptr<Volume> MakeVolume(const std::string& path) {
  return testing::MakeVolume(path, 64 * kMiB);
}

TensorSpec Spec(std::string name, std::size_t bytes) {
  return testing::Spec(std::move(name), bytes, DType::kF32, {static_cast<std::int64_t>(bytes / 4)});
}

TEST(GpuTier, WithoutADeviceOrBudgetItReportsAndTheHostTierWorks) {
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 4 * kMiB;
  o.gpu_budget_bytes = HaveGpu() ? 0 : 4 * kMiB;  // with a GPU, the zero budget is the test
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w", 64 * kKiB)));
  EXPECT_THAT(store->Acquire(id, Tier::kGpu), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store->Prefetch(id, Tier::kGpu).Wait(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store->Acquire(id, Tier::kNvme), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store->Evict(id, Tier::kPageableHost), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(store->Evict(id, Tier::kGpu));  // nothing on the GPU: nothing to do
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id, Tier::kPinnedHost));
    EXPECT_EQ(lease.tier(), Tier::kPinnedHost);
    const auto p = Pattern("w", 1, lease.size());
    std::memcpy(lease.data(), p.data(), p.size());
    lease.MarkDirty();
  }
  ASSERT_OK(store->Flush());
  ASSERT_OK(store->Evict(id));
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
  const auto p = Pattern("w", 1, lease.size());
  EXPECT_EQ(std::memcmp(lease.data(), p.data(), p.size()), 0);
  EXPECT_EQ(store->stats().gpu_resident, 0u);
}

#if MEMASCEND_HAVE_CUDA
// Writes Pattern(name, version) into the tensor through a host lease, marked dirty.
void FillOnHost(TensorStore& store, TensorId id, const std::string& name, std::uint64_t version) {
  ASSERT_OK_AND_ASSIGN(TensorLease host, store.Acquire(id));
  const auto p = Pattern(name, version, host.size());
  std::memcpy(host.data(), p.data(), p.size());
  host.MarkDirty();
}

// Non-blocking, as PyTorch's streams are: no implicit ordering with the legacy default
// stream, so only the store's own event waits order the work.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s); }
  CudaStreamView view() const { return CudaStreamView(s); }
};

std::vector<std::byte> FromDevice(const TensorLease& lease, const Stream& stream) {
  std::vector<std::byte> out(lease.size());
  EXPECT_EQ(cudaMemcpyAsync(out.data(), lease.data(), out.size(), cudaMemcpyDeviceToHost, stream.s),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
  return out;
}

void ToDevice(const TensorLease& lease, const std::vector<std::byte>& bytes, const Stream& stream) {
  EXPECT_EQ(
      cudaMemcpyAsync(lease.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice, stream.s),
      cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
}

TEST(GpuTier, RoundTripsThroughTheDeviceAndEvictsUnderItsBudget) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 2 * kMiB;  // two of the four at once
  o.gpu_budget_bytes = 3 * kMiB;   // three of the four
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  Stream a, b;
  std::vector<TensorId> ids;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("g" + std::to_string(i), kMiB)));
    ids.push_back(id);
    FillOnHost(*store, id, "g" + std::to_string(i), 1);
  }
  for (int round = 1; round <= 3; ++round) {
    for (int i = 0; i < 4; ++i) {
      const std::string name = "g" + std::to_string(i);
      const Stream& s = (i % 2 == 0) ? a : b;
      ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(ids[i], Tier::kGpu, s.view()));
      EXPECT_EQ(dev.tier(), Tier::kGpu);
      const auto want = Pattern(name, static_cast<std::uint64_t>(round), dev.size());
      ASSERT_EQ(FromDevice(dev, s), want) << name << " round " << round;
      ToDevice(dev, Pattern(name, static_cast<std::uint64_t>(round + 1), dev.size()), s);
      dev.MarkDirty();
    }
  }
  // A host lease sees the device's newest bytes; after Flush, so does a reopened store.
  ASSERT_OK(store->Flush());
  const TensorStoreStats st = store->stats();
  EXPECT_GT(st.gpu_evictions, 0u);
  EXPECT_GT(st.bytes_from_gpu, 0u);
  EXPECT_LE(st.ledger.tier(Tier::kGpu).live_peak, static_cast<std::int64_t>(o.gpu_budget_bytes));
  EXPECT_LE(st.ledger.tier(Tier::kPinnedHost).reserved_peak,
            static_cast<std::int64_t>(o.host_budget_bytes));
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorLease host, store->Acquire(ids[i]));
    const auto p = Pattern("g" + std::to_string(i), 4, host.size());
    EXPECT_EQ(std::memcmp(host.data(), p.data(), p.size()), 0) << i;
  }
}

TEST(GpuTier, PrefetchQueuesTheCopyAndAHostWriteMakesTheDeviceCopyStale) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 2 * kMiB;
  o.gpu_budget_bytes = 2 * kMiB;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("p", 256 * kKiB)));
  FillOnHost(*store, id, "p", 1);
  Stream s;
  ASSERT_OK(store->Prefetch(id, Tier::kGpu, s.view()).Wait());
  {
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, s.view()));
    EXPECT_EQ(FromDevice(dev, s), Pattern("p", 1, dev.size()));
  }
  EXPECT_EQ(store->stats().prefetch_hits, 1u);
  FillOnHost(*store, id, "p", 2);
  ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, s.view()));
  EXPECT_EQ(FromDevice(dev, s), Pattern("p", 2, dev.size()));
  // Everything on the device is leased: a second tensor that does not fit is refused.
  ASSERT_OK_AND_ASSIGN(TensorId big, store->Register(Spec("big", 2 * kMiB - 128 * kKiB)));
  EXPECT_THAT(store->Acquire(big, Tier::kGpu, s.view()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("short")));
  EXPECT_THAT(store->Evict(id, Tier::kGpu), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// An eviction waits for the work its victim's last lease queued, asleep (Note [blocking
// events]): a clean victim through its idle event, a dirty one through its copy back.
TEST(GpuTier, AnEvictionWaitsAsleepForTheVictimsLastWork) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 2 * kMiB;
  o.gpu_budget_bytes = kMiB;  // one at a time
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  TensorId ids[2];
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(ids[i], store->Register(Spec("e" + std::to_string(i), kMiB)));
    FillOnHost(*store, ids[i], "e" + std::to_string(i), 1);
  }
  Stream a, b;
  for (const bool dirty : {false, true}) {
    {
      ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(ids[0], Tier::kGpu, a.view()));
      if (dirty) {
        ToDevice(dev, Pattern("e0", 2, dev.size()), a);
        dev.MarkDirty();
      }
      testing::HoldStream(a.s, 400);  // the holder's work, still queued at the release
    }
    const testing::Waited w = testing::TimeWait([&] {
      ASSERT_OK_AND_ASSIGN(TensorLease other, store->Acquire(ids[1], Tier::kGpu, b.view()));
      EXPECT_EQ(FromDevice(other, b), Pattern("e1", 1, other.size()));
    });
    EXPECT_GE(w.wall, 0.3) << "dirty " << dirty << ": the eviction did not wait";
    EXPECT_LT(w.cpu, 0.25 * w.wall) << "dirty " << dirty << ": the wait spun";
  }
  ASSERT_OK_AND_ASSIGN(TensorLease host, store->Acquire(ids[0]));
  const auto p = Pattern("e0", 2, host.size());
  EXPECT_EQ(std::memcmp(host.data(), p.data(), p.size()), 0);
  EXPECT_GE(store->stats().gpu_evictions, 2u);
}

// Every released device lease's work counts, whatever its stream (Note [gpu tier]): a
// lease on another stream sees an earlier lease's writes still queued at its release, and
// a copy back (Flush) waits for the writes of a dirty lease released before a clean one
// (the store kept the last release's event alone, and copied back on the stream of the
// copy in, which had not waited for them).
TEST(GpuTier, EveryReleasedLeasesWorkIsWaitedForWhateverItsStream) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 2 * kMiB;
  o.gpu_budget_bytes = 2 * kMiB;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w", 256 * kKiB)));
  FillOnHost(*store, id, "w", 1);
  Stream in, a, b;
  { ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, in.view())); }
  ASSERT_EQ(cudaStreamSynchronize(in.s), cudaSuccess);
  std::vector<std::vector<std::byte>> sources;  // alive until their copies are done
  // Queued on `s` behind 400 ms of other work, and not waited for: the lease's release
  // comes while the write is still on its way.
  const auto write_later = [&](const TensorLease& dev, std::uint64_t version, const Stream& s) {
    sources.push_back(Pattern("w", version, dev.size()));
    testing::HoldStream(s.s, 400);
    ASSERT_EQ(
        cudaMemcpyAsync(dev.data(), sources.back().data(), dev.size(), cudaMemcpyHostToDevice, s.s),
        cudaSuccess);
  };
  {  // A lease on `a` writes; a lease on `b` finds its bytes.
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, a.view()));
    write_later(dev, 2, a);
    dev.MarkDirty();
  }
  {
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, b.view()));
    EXPECT_EQ(FromDevice(dev, b), Pattern("w", 2, dev.size()));
  }
  {  // A dirty lease on `a` still writing, then a clean one: the copy back has the write.
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, a.view()));
    write_later(dev, 3, a);
    dev.MarkDirty();
  }
  { ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(id, Tier::kGpu, in.view())); }
  ASSERT_OK(store->Flush());
  ASSERT_OK_AND_ASSIGN(TensorLease host, store->Acquire(id));
  const auto p = Pattern("w", 3, host.size());
  EXPECT_EQ(std::memcmp(host.data(), p.data(), p.size()), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Note [host writes after a copy]: a copy into the device, queued behind 400 ms of its
// stream's work, still reads its tensor's host block when the host writes that block:
// handed to another tensor (AcquireCopy of a clean source into a cold destination), or
// overwritten in place while a device lease holds the copy. Both writes wait for the
// copy: the device has the bytes it was asked to copy.
TEST(GpuTier, AHostWriteWaitsForTheCopyThatReadsItsBlock) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ScratchPath path("gpu");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 4 * kMiB;
  o.gpu_budget_bytes = 2 * kMiB;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  ASSERT_OK_AND_ASSIGN(TensorId src, store->Register(Spec("src", 256 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId dst, store->Register(Spec("dst", 256 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId mine, store->Register(Spec("mine", 256 * kKiB)));
  FillOnHost(*store, src, "src", 1);
  FillOnHost(*store, mine, "mine", 1);
  ASSERT_OK(store->Flush());  // clean, so the source's block may be handed over
  Stream s;
  {  // Handed over: the destination's new bytes must not reach the source's device copy.
    testing::HoldStream(s.s, 400);
    { ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(src, Tier::kGpu, s.view())); }
    const std::uint64_t handovers = store->stats().handovers;
    {
      ASSERT_OK_AND_ASSIGN(TensorLease copy, store->AcquireCopy(src, dst));
      const auto p = Pattern("dst", 1, copy.size());
      std::memcpy(copy.data(), p.data(), p.size());
      copy.MarkDirty();
    }
    EXPECT_EQ(store->stats().handovers, handovers + 1);
    ASSERT_EQ(cudaStreamSynchronize(s.s), cudaSuccess);
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(src, Tier::kGpu, s.view()));
    EXPECT_EQ(FromDevice(dev, s), Pattern("src", 1, dev.size()));
  }
  {  // Overwritten in place: the lease holding the copy keeps the bytes it was given.
    testing::HoldStream(s.s, 400);
    ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(mine, Tier::kGpu, s.view()));
    {
      ASSERT_OK_AND_ASSIGN(TensorLease host, store->AcquireForOverwrite(mine));
      const auto p = Pattern("mine", 2, host.size());
      std::memcpy(host.data(), p.data(), p.size());
    }
    EXPECT_EQ(FromDevice(dev, s), Pattern("mine", 1, dev.size()));
  }
  ASSERT_OK_AND_ASSIGN(TensorLease host, store->Acquire(dst));
  const auto p = Pattern("dst", 1, host.size());
  EXPECT_EQ(std::memcmp(host.data(), p.data(), p.size()), 0);
}

int CurrentDevice() { return testing::CurrentCudaDevice(); }

// Note [current device] (prim/cuda_memory.h): a store on the second device, made and used
// from a thread whose current device is the first. Its workers' prefetch (a new thread's
// current device is 0), the leases' events and a dirty copy's eviction go to its device,
// and the caller's current device stays the first. The test's own copies run with the
// second device current, as a caller's on that device would.
TEST(GpuTier, AStoreOnAnotherDeviceWorksThereAndLeavesTheCallersCurrentDevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2)
    GTEST_SKIP() << "fewer than two CUDA devices";
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  auto s = std::make_unique<Stream>();  // on device 1
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const auto on_1 = [](const auto& f) {
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    f();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  };
  ScratchPath path("gpu1");
  auto volume = MakeVolume(path.path());
  {
    TensorStoreOptions o;
    o.host_budget_bytes = 2 * kMiB;
    o.gpu_budget_bytes = kMiB;  // one of the two at a time: the second evicts the first
    o.gpu_device = 1;
    o.prefetch_threads = 1;
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
    EXPECT_EQ(CurrentDevice(), 0);
    ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 768 * kKiB)));
    ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 768 * kKiB)));
    FillOnHost(*store, a, "a", 1);
    FillOnHost(*store, b, "b", 1);
    ASSERT_OK(store->Prefetch(a, Tier::kGpu, s->view()).Wait());  // a worker's copy
    EXPECT_EQ(CurrentDevice(), 0);
    {
      ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(a, Tier::kGpu, s->view()));
      EXPECT_EQ(store->stats().prefetch_hits, 1u);
      on_1([&] {
        EXPECT_EQ(FromDevice(dev, *s), Pattern("a", 1, dev.size()));
        ToDevice(dev, Pattern("a", 2, dev.size()), *s);
      });
      dev.MarkDirty();
    }  // the release's event, recorded from device 0's thread
    EXPECT_EQ(CurrentDevice(), 0);
    {
      ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(b, Tier::kGpu, s->view()));
      on_1([&] { EXPECT_EQ(FromDevice(dev, *s), Pattern("b", 1, dev.size())); });
    }
    {  // On the legacy stream (0): the store's device's, whichever is current.
      ASSERT_OK_AND_ASSIGN(TensorLease dev, store->Acquire(b, Tier::kGpu, CudaStreamView{}));
      on_1([&] {
        std::vector<std::byte> out(dev.size());
        EXPECT_EQ(cudaMemcpy(out.data(), dev.data(), out.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(out, Pattern("b", 1, dev.size()));
      });
    }
    EXPECT_EQ(CurrentDevice(), 0);
    EXPECT_GT(store->stats().bytes_from_gpu, 0u);  // a's dirty copy came back
    ASSERT_OK_AND_ASSIGN(TensorLease host, store->Acquire(a));
    const auto p = Pattern("a", 2, host.size());
    EXPECT_EQ(std::memcmp(host.data(), p.data(), p.size()), 0);
  }  // the store closed, its device memory freed, from device 0's thread
  EXPECT_EQ(CurrentDevice(), 0);
  on_1([&] { s.reset(); });
}
#endif  // MEMASCEND_HAVE_CUDA

}  // namespace
}  // namespace memascend
