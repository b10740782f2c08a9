#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <span>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>

#include <absl/cleanup/cleanup.h>
#include <absl/synchronization/notification.h>
#include <absl/time/time.h>
#include <gtest/gtest.h>

#include <memascend/system.h>
#include <memascend/tensor_store.h>

#include "storage/volume_test_util.h"
#include "store/store_test_util.h"
#include "testing/process.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::Spec;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;

TensorStoreOptions Budget(std::size_t bytes) {
  TensorStoreOptions o;
  o.host_budget_bytes = bytes;
  return o;
}

std::unique_ptr<Volume> MakeVolume(const std::string& path) {
  return testing::MakeVolume(path, 256 * kMiB);
}

void Fill(TensorLease& lease, const std::string& name, std::uint64_t version) {
  const auto p = Pattern(name, version, lease.size());
  std::memcpy(lease.data(), p.data(), p.size());
  lease.MarkDirty();
}

bool Holds(const TensorLease& lease, const std::string& name, std::uint64_t version) {
  const auto p = Pattern(name, version, lease.size());
  return std::memcmp(lease.data(), p.data(), p.size()) == 0;
}

TEST(TensorStore, EvictsLeastRecentlyUsedAndWritesDirtyTensorsBack) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 3 * 300 * kKiB;  // room for three of the five
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  std::vector<TensorId> ids;
  for (int i = 0; i < 5; ++i) {
    ASSERT_OK_AND_ASSIGN(
        TensorId id, store->Register(Spec("w" + std::to_string(i), 300 * kKiB, DType::kBF16,
                                          {150 * 1024}, Use::kParameters, Durability::kDurable)));
    ids.push_back(id);
  }
  for (int round = 1; round <= 3; ++round) {
    for (int i = 0; i < 5; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(ids[static_cast<std::size_t>(i)]));
      if (round > 1) {
        ASSERT_TRUE(Holds(lease, "w" + std::to_string(i), static_cast<std::uint64_t>(round - 1)))
            << i;
      }
      Fill(lease, "w" + std::to_string(i), static_cast<std::uint64_t>(round));
    }
  }
  const TensorStoreStats s = store->stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.write_backs, 0u);
  EXPECT_LE(s.resident, 3u);
  EXPECT_LE(s.ledger.tier(Tier::kPinnedHost).reserved_peak,
            static_cast<std::int64_t>(o.host_budget_bytes));
}

// The pool's policy under one budget: the adaptive classes hold three tensors of 300 KiB
// in 900 KiB; powers of two give each a 512 KiB block, so only one is resident at a time
// and the same walk reads more.
// Note [one store per name]: two stores on one volume never write one object.
TEST(TensorStore, TwoStoresOnOneVolumeCannotRegisterOneName) {
  ScratchPath path("store_two");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto a, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
  ASSERT_OK_AND_ASSIGN(auto b, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
  ASSERT_OK(a->Register(Spec("w", 64 * kKiB)).status());
  EXPECT_THAT(b->Register(Spec("w", 64 * kKiB)),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("another tensor store")));
  EXPECT_OK(b->Register(Spec("v", 64 * kKiB)).status());  // names of its own are fine
  ASSERT_OK(a->Close());
  a.reset();  // its names are free again
  EXPECT_OK(b->Register(Spec("w", 64 * kKiB)).status());
}

TEST(TensorStore, APowerOfTwoPoolHoldsFewerTensorsUnderTheSameBudget) {
  std::uint64_t read[2] = {0, 0};
  std::size_t most_resident[2] = {0, 0};
  for (int pow2 = 0; pow2 < 2; ++pow2) {
    ScratchPath path("store");
    auto volume = MakeVolume(path.path());
    TensorStoreOptions o;
    o.host_budget_bytes = 3 * 300 * kKiB;
    o.pool_policy = pow2 ? PoolPolicy::kPow2 : PoolPolicy::kAdaptive;
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
    std::vector<TensorId> ids;
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w" + std::to_string(i), 300 * kKiB)));
      ids.push_back(id);
    }
    for (int round = 1; round <= 3; ++round) {
      for (int i = 0; i < 3; ++i) {
        ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(ids[static_cast<std::size_t>(i)]));
        if (round > 1) {
          ASSERT_TRUE(Holds(lease, "w" + std::to_string(i), round - 1u)) << i;
        }
        Fill(lease, "w" + std::to_string(i), static_cast<std::uint64_t>(round));
      }
      most_resident[pow2] = std::max<std::size_t>(most_resident[pow2], store->stats().resident);
    }
    read[pow2] = store->stats().bytes_read;
  }
  EXPECT_EQ(most_resident[0], 3u);
  EXPECT_LT(most_resident[1], 3u);
  EXPECT_EQ(read[0], 0u);
  EXPECT_GT(read[1], 0u);
}

TEST(TensorStore, NeverWrittenTensorsReadAsZeros) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("fresh", 10000, DType::kF32, {2500})));
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
  for (std::size_t i = 0; i < lease.size(); ++i) ASSERT_EQ(lease.data()[i], std::byte{0});
}

TEST(TensorStore, AcquireForOverwriteSkipsTheReadAndIsWrittenBack) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("o", 256 * kKiB)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "o", 1);
  }
  ASSERT_OK(store->Evict(id));
  const std::uint64_t read_before = store->stats().bytes_read;
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->AcquireForOverwrite(id));
    const auto p = Pattern("o", 2, lease.size());
    std::memcpy(lease.data(), p.data(), p.size());  // no MarkDirty: the lease is dirty
  }
  EXPECT_EQ(store->stats().bytes_read, read_before);
  EXPECT_EQ(store->stats().overwrites, 1u);
  ASSERT_OK(store->Evict(id));  // writes it back
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
  EXPECT_TRUE(Holds(lease, "o", 2));
  EXPECT_THAT(store->AcquireForOverwrite(999), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Note [write-back under a writer]: a write-back while a lease that may write is held
// stages what the block held then; the holder's later writes still reach the volume.
TEST(TensorStore, AWriteBackUnderAWriterLeavesTheTensorDirty) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w", 256 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId copy, store->Register(Spec("c", 256 * kKiB)));
  const auto write = [](TensorLease& lease, std::uint64_t version) {
    const auto p = Pattern("w", version, lease.size());
    std::memcpy(lease.data(), p.data(), p.size());  // no MarkDirty: these leases start dirty
  };
  for (int kind = 0; kind < 3; ++kind) {
    const TensorId target = kind == 2 ? copy : id;
    {
      auto lease = kind == 0   ? store->AcquireForWrite(id)
                   : kind == 1 ? store->AcquireForOverwrite(id)
                               : store->AcquireCopy(id, copy);
      ASSERT_OK(lease.status());
      write(*lease, 10 * kind + 1);
      ASSERT_OK(store->WriteBack(target));  // as a Flush on another thread would, mid-write
      write(*lease, 10 * kind + 2);
    }
    ASSERT_OK(store->Evict(target));  // the last bytes are written, not dropped
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(target));
    EXPECT_TRUE(Holds(l, "w", 10 * kind + 2)) << kind;
  }
  // A read lease does not keep a tensor dirty: its write-back is its last.
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->AcquireForWrite(id));
    write(lease, 40);
  }
  {
    ASSERT_OK_AND_ASSIGN(TensorLease read, store->AcquireForRead(id));
    ASSERT_OK(store->WriteBack(id));
    EXPECT_FALSE(store->WritePending(id));
  }
}

TEST(TensorStore, AcquireCopyHandsOverCleanBlocksAndReadsColdSources) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 128 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 128 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId c, store->Register(Spec("c", 64 * kKiB)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(a));
    Fill(lease, "a", 1);
  }
  ASSERT_OK(store->Flush());  // a is resident and clean
  std::byte* block = nullptr;
  {
    const TensorStoreStats before = store->stats();
    ASSERT_OK_AND_ASSIGN(TensorLease copy, store->AcquireCopy(a, b));
    block = copy.data();
    const auto p = Pattern("a", 1, copy.size());
    EXPECT_EQ(std::memcmp(copy.data(), p.data(), p.size()), 0);
    EXPECT_EQ(store->stats().handovers, 1u);
    EXPECT_EQ(store->stats().prefetch_hits, before.prefetch_hits + 1);  // the source was resident
    EXPECT_EQ(store->stats().prefetch_misses, before.prefetch_misses);
    EXPECT_EQ(store->stats().resident, 1u);  // a gave its block to b
    const auto q = Pattern("b", 2, copy.size());
    std::memcpy(copy.data(), q.data(), q.size());
  }
  {
    ASSERT_OK_AND_ASSIGN(TensorLease old, store->Acquire(a));  // read back from the volume
    EXPECT_TRUE(Holds(old, "a", 1));
    EXPECT_NE(old.data(), block);
  }
  ASSERT_OK(store->Flush());
  ASSERT_OK(store->Evict(b));
  ASSERT_OK(store->Evict(a));
  {
    const TensorStoreStats before = store->stats();
    ASSERT_OK_AND_ASSIGN(TensorLease copy, store->AcquireCopy(b, a));  // b is cold
    EXPECT_TRUE(Holds(copy, "b", 2));
    // The read was the caller's: a miss, and its wait counts as a stall.
    const TensorStoreStats after = store->stats();
    EXPECT_EQ(after.prefetch_misses, before.prefetch_misses + 1);
    EXPECT_EQ(after.prefetch_hits, before.prefetch_hits);
    EXPECT_GT(after.stall_seconds, before.stall_seconds);
    EXPECT_EQ(after.bytes_read, before.bytes_read + 128 * kKiB);
  }
  {
    ASSERT_OK_AND_ASSIGN(TensorLease held, store->Acquire(b));  // dirty source: copied
    Fill(held, "b", 3);
    ASSERT_OK_AND_ASSIGN(TensorLease copy, store->AcquireCopy(b, a));
    EXPECT_TRUE(Holds(copy, "b", 3));
    EXPECT_NE(copy.data(), held.data());
    EXPECT_THAT(store->AcquireCopy(b, a), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  EXPECT_THAT(store->AcquireCopy(a, c), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store->AcquireCopy(a, a), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(store->Flush());
  ASSERT_OK(store->Evict(a));
  ASSERT_OK_AND_ASSIGN(TensorLease again, store->Acquire(a));
  EXPECT_TRUE(Holds(again, "b", 3));  // the copy was written back as a's
}

TEST(TensorStore, AFullVolumeCommitsStagedWriteBacksEarlyAndGoesOn) {
  ScratchPath path("store");
  VolumeFormatOptions f;
  f.size = 8 * kMiB;  // room for the data once, not for every version staged
  ASSERT_OK(Volume::Format(path.path(), f));
  ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(path.path(), {}));
  const std::size_t free = volume->stats().free_bytes;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  std::vector<TensorId> ids;
  const std::size_t n = free / (512 * kKiB) - 1;  // fills most of the volume
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("t" + std::to_string(i), 512 * kKiB)));
    ids.push_back(id);
  }
  for (std::uint64_t version = 1; version <= 3; ++version) {
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(ids[i]));
      if (version > 1) {
        ASSERT_TRUE(Holds(lease, "t" + std::to_string(i), version - 1)) << i;
      }
      Fill(lease, "t" + std::to_string(i), version);
    }
  }
  ASSERT_OK(store->Flush());
  ASSERT_OK_AND_ASSIGN(FsckReport r, volume->Fsck(true));
  EXPECT_TRUE(r.clean);
}

TEST(TensorStore, WriteBehindWritesReleasedDurableTensorsAtOnce) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o = Budget(kMiB);
  o.write_behind = true;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  ASSERT_OK_AND_ASSIGN(TensorId d, store->Register(Spec("durable", 64 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId s, store->Register(Spec("scratch", 64 * kKiB, DType::kBF16, {},
                                                        Use::kGradients, Durability::kScratch)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease a, store->Acquire(d));
    ASSERT_OK_AND_ASSIGN(TensorLease b, store->Acquire(s));
    Fill(a, "durable", 1);
    Fill(b, "scratch", 1);
  }
  // The durable one is written by a prefetch thread without anyone asking.
  for (int i = 0; i < 2000 && store->stats().write_backs == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(store->stats().write_backs, 1u);
  EXPECT_EQ(store->stats().bytes_written, 64 * kKiB);  // not the scratch one
  ASSERT_OK(store->Flush());  // commits it; the scratch one is not committed, so not written
  EXPECT_EQ(store->stats().bytes_written, 64 * kKiB);
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, volume->Stat("durable"));
  EXPECT_EQ(info.durability, Durability::kDurable);
  // Evicted, the dirty scratch tensor is written (its bytes are still needed).
  ASSERT_OK(store->Evict(s));
  EXPECT_EQ(store->stats().bytes_written, 128 * kKiB);
  ASSERT_OK_AND_ASSIGN(TensorLease b, store->Acquire(s));
  EXPECT_TRUE(Holds(b, "scratch", 1));
}

TEST(TensorStore, DiscardDropsDirtyBytesWithoutWritingThem) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("d", 64 * kKiB)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "d", 1);
  }
  ASSERT_OK(store->Flush());
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "d", 2);
    EXPECT_THAT(store->Discard(id), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  const std::uint64_t written = store->stats().bytes_written;
  ASSERT_OK(store->Discard(id));
  EXPECT_EQ(store->stats().bytes_written, written);
  EXPECT_EQ(store->stats().resident, 0u);
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
  EXPECT_TRUE(Holds(lease, "d", 1));  // the last stored version
}

TEST(TensorStore, BudgetsAreEnforcedWithTheShortfall) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(512 * kKiB)));
  EXPECT_THAT(store->Register(Spec("huge", kMiB)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
  ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 300 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 300 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorLease la, store->Acquire(a));
  // Everything resident is leased: the second tensor cannot come in.
  EXPECT_THAT(store->Acquire(b),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("short")));
  EXPECT_THAT(store->Evict(a),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("leased")));
  la.Release();
  EXPECT_OK(store->Acquire(b).status());  // now `a` is evicted to make room
  EXPECT_THAT(store->Register(Spec("a", 10)), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(store->Register(Spec("zero", 0)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store->Acquire(99), StatusIs(absl::StatusCode::kInvalidArgument));
}

// The caller picks how the budget is page-locked: mlock works everywhere; CUDA
// registration works where a device is and is refused with the reason where none is.
TEST(TensorStore, TheHostBackingIsTheCallers) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o = Budget(4 * kMiB);
  o.host_backing = ArenaBacking::kMlock;
  {
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w", kMiB)));
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "w", 1);
  }
  o.host_backing = ArenaBacking::kCudaRegistered;
  auto registered = TensorStore::Open(volume.get(), o);
  if (ProbeSystem().cuda.device_count == 0) {
    EXPECT_THAT(registered.status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA")));
  } else {
    ASSERT_OK(registered.status());
    ASSERT_OK_AND_ASSIGN(TensorId id, (*registered)->Register(Spec("w2", kMiB)));
    EXPECT_OK((*registered)->Acquire(id).status());
  }
}

// Memory the budget allows but the OS refuses (here RLIMIT_MEMLOCK): the error names
// the OS's reason and its fix, not only the budget's arithmetic.
TEST(TensorStore, AHostMemoryFailureSaysWhyTheBudgetCouldNotBeUsed) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer intercepts mlock() and turns it into a no-op";
#endif
  ScratchPath path("store");
  // The volume is made in the child: a child forked from a process whose I/O threads run
  // has none of them, and a lock one held at the fork stays held (the io_uring-off run
  // hung here once, its thread pool's workers started before the fork).
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto volume = MakeVolume(path.path());
    if (volume == nullptr) _exit(3);
    auto store = TensorStore::Open(volume.get(), Budget(4 * kMiB));
    if (!store.ok()) _exit(3);
    auto id = (*store)->Register(Spec("w", kMiB));
    if (!id.ok()) _exit(3);
    rlimit lim{64 * 1024, 64 * 1024};
    if (!testing::DropIpcLock() || setrlimit(RLIMIT_MEMLOCK, &lim) != 0) _exit(4);
    auto lease = (*store)->Acquire(*id);
    if (lease.ok()) _exit(5);
    const std::string message(lease.status().message());
    std::fprintf(stderr, "child: %s\n", message.c_str());
    if (lease.status().code() != absl::StatusCode::kResourceExhausted) _exit(6);
    if (message.find("RLIMIT_MEMLOCK") == std::string::npos) _exit(7);
    if (message.find("ulimit -l") == std::string::npos) _exit(7);
    _exit(0);
  }
  EXPECT_EQ(testing::ExitCodeOf(pid), 0) << "child step failed (3: open, 4: limits, 5: no error, "
                                            "6: wrong code, 7: the reason is missing)";
}

// Note [write-back depth]: many tensors written back at once, each exactly once, their
// bytes those of the last lease; clean and cold ones cost nothing; on a volume without
// room the first error comes back, after the others ended, and what failed stays dirty.
TEST(TensorStore, ManyTensorsWrittenBackAtOnceHoldTheirBytesAndErrorsKeepThemDirty) {
  ScratchPath path("store");
  constexpr std::size_t kCount = 40;
  std::vector<TensorId> ids;
  {
    auto volume = MakeVolume(path.path());
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(64 * kMiB)));
    for (std::size_t i = 0; i < kCount; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorId id,
                           store->Register(Spec("t" + std::to_string(i), 192 * kKiB + 4096 * i)));
      ids.push_back(id);
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      Fill(lease, "t" + std::to_string(i), 3);
    }
    ASSERT_OK(store->WriteBack(std::span<const TensorId>(ids)));
    EXPECT_EQ(store->stats().write_backs, kCount);
    ASSERT_OK(store->WriteBack(std::span<const TensorId>(ids)));  // clean now: nothing to do
    EXPECT_EQ(store->stats().write_backs, kCount);
    ASSERT_OK(store->WriteBack(std::span<const TensorId>()));
    ASSERT_OK(volume->Sync());
  }
  {
    ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(path.path(), {}));
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(64 * kMiB)));
    for (std::size_t i = 0; i < kCount; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorId id,
                           store->Register(Spec("t" + std::to_string(i), 192 * kKiB + 4096 * i)));
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      EXPECT_TRUE(Holds(lease, "t" + std::to_string(i), 3)) << i;
    }
  }
  // A volume with room for the tensors once and not for their new versions staged beside
  // them, and no commit when full: some write-backs fail, the first error comes back.
  ScratchPath small("store-small");
  VolumeFormatOptions f;
  f.size = 8 * kMiB;
  ASSERT_OK(Volume::Format(small.path(), f));
  ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(small.path(), {}));
  const std::size_t n = volume->stats().free_bytes / (512 * kKiB) - 1;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(16 * kMiB)));
  ids.clear();
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("s" + std::to_string(i), 512 * kKiB)));
    ids.push_back(id);
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "s" + std::to_string(i), 1);
  }
  ASSERT_OK(store->Flush());
  store->SetCommitWhenFull(false);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(ids[i]));
    Fill(lease, "s" + std::to_string(i), 2);
  }
  EXPECT_THAT(store->WriteBack(std::span<const TensorId>(ids)),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // Those that failed are dirty still: with room made (a commit), they are written.
  ASSERT_OK(volume->Sync());
  store->SetCommitWhenFull(true);
  ASSERT_OK(store->Flush());
  EXPECT_EQ(store->stats().write_backs, 2 * n);
  ASSERT_OK_AND_ASSIGN(FsckReport r, volume->Fsck(true));
  EXPECT_TRUE(r.clean);
}

// An ObjectStore that passes every call to another (a Volume); the test stores below
// override PutStaged only.
class ForwardingStore : public ObjectStore {
 public:
  explicit ForwardingStore(ObjectStore* inner) : inner_(inner) {}
  absl::Status Put(std::string_view name, std::span<const std::byte> data, Durability d,
                   std::string_view metadata) override {
    return inner_->Put(name, data, d, metadata);
  }
  absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                         std::string_view metadata) override {
    return inner_->PutStaged(name, data, metadata);
  }
  absl::Status Sync() override { return inner_->Sync(); }
  absl::Status SyncOnly(std::span<const std::string> names) override {
    return inner_->SyncOnly(names);
  }
  absl::Status DropStaged(std::span<const std::string> names) override {
    return inner_->DropStaged(names);
  }
  absl::StatusOr<std::size_t> Get(std::string_view name, std::span<std::byte> out) override {
    return inner_->Get(name, out);
  }
  absl::StatusOr<ObjectInfo> Stat(std::string_view name) const override {
    return inner_->Stat(name);
  }
  std::vector<ObjectInfo> List() const override { return inner_->List(); }
  absl::Status Delete(std::string_view name) override { return inner_->Delete(name); }
  std::uint64_t staged_bytes() const override { return inner_->staged_bytes(); }

 protected:
  ObjectStore* inner_;
};

// An ObjectStore over a Volume that counts the puts in flight at once (each held a little,
// so that the writers overlap) and the most seen.
class CountingStore final : public ForwardingStore {
 public:
  // A put waits (up to 5 s) until `expected` were in flight at once: the most seen is
  // then the writers' number, not how fast they started.
  CountingStore(ObjectStore* inner, int expected) : ForwardingStore(inner), expected_(expected) {}
  absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                         std::string_view metadata) override {
    const int now = ++in_flight_;
    for (int seen = most_.load(); now > seen && !most_.compare_exchange_weak(seen, now);) {
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (most_.load() < expected_ && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // room for one too many
    absl::Status s = inner_->PutStaged(name, data, metadata);
    --in_flight_;
    return s;
  }
  int most() const { return most_.load(); }

 private:
  const int expected_;
  std::atomic<int> in_flight_{0};
  std::atomic<int> most_{0};
};

// options.write_back_depth: WriteBack(ids) keeps that many puts in flight, no more and no
// fewer (the default: kWriteBackDepth), every tensor written once; a depth past the most
// is refused.
TEST(TensorStore, TheWriteBackDepthIsTheOptions) {
  constexpr std::size_t kCount = 24;
  for (std::size_t depth : {std::size_t{1}, std::size_t{3}, std::size_t{0}, std::size_t{16}}) {
    SCOPED_TRACE(depth);
    const int want = static_cast<int>(depth == 0 ? TensorStore::kWriteBackDepth : depth);
    ScratchPath path("store");
    auto volume = MakeVolume(path.path());
    CountingStore counting(volume.get(), want);
    TensorStoreOptions o = Budget(16 * kMiB);
    o.write_back_depth = depth;
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(&counting, o));
    std::vector<TensorId> ids;
    for (std::size_t i = 0; i < kCount; ++i) {
      ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("t" + std::to_string(i), 64 * kKiB)));
      ids.push_back(id);
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      Fill(lease, "t" + std::to_string(i), 1);
    }
    ASSERT_OK(store->WriteBack(std::span<const TensorId>(ids)));
    EXPECT_EQ(store->stats().write_backs, kCount);
    EXPECT_EQ(counting.most(), want);
  }
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o = Budget(16 * kMiB);
  o.write_back_depth = TensorStore::kMaxWriteBackDepth + 1;
  EXPECT_THAT(TensorStore::Open(volume.get(), o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("write_back_depth 257")));
}

// An ObjectStore over a Volume whose staged puts wait until the test opens the gate.
class GatedStore final : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                         std::string_view metadata) override {
    if (!entered.HasBeenNotified()) entered.Notify();
    open.WaitForNotification();
    return inner_->PutStaged(name, data, metadata);
  }

  absl::Notification entered;  // a put reached the gate (one writer at a time here)
  absl::Notification open;
};

// Opens the gate, if still closed, and joins the thread: at a test's end, even a failed one.
void OpenAndJoin(GatedStore& gated, std::thread& t) {
  if (!gated.open.HasBeenNotified()) gated.open.Notify();
  if (t.joinable()) t.join();
}

// Note [reads during write-back]: with a tensor's put held at the gate, AcquireForRead
// leases its bytes at once, while a lease that may write waits for the put; the read
// lease keeps the block, and the volume gets the bytes written back.
TEST(TensorStore, AReadLeaseDoesNotWaitForTheTensorsWriteBack) {
  ScratchPath path("store");
  auto volume = testing::MakeVolume(path.path(), 16 * kMiB);
  GatedStore gated(volume.get());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(&gated, Budget(4 * kMiB)));
  constexpr std::size_t kBytes = 256 * kKiB;
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("t", kBytes)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    Fill(lease, "t", 1);
  }
  std::thread writer([&] { EXPECT_OK(store->WriteBack(id)); });
  const absl::Cleanup end = [&] { OpenAndJoin(gated, writer); };
  ASSERT_TRUE(gated.entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  auto read = std::async(std::launch::async, [&] { return store->AcquireForRead(id); });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    OpenAndJoin(gated, writer);  // the read waited for the put: let both end, then fail
    FAIL() << "AcquireForRead waited for the tensor's write-back";
  }
  ASSERT_OK_AND_ASSIGN(TensorLease r, read.get());
  EXPECT_TRUE(r.read_only());
  EXPECT_TRUE(Holds(r, "t", 1));
  auto write = std::async(std::launch::async, [&] { return store->AcquireForWrite(id); });
  EXPECT_EQ(write.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  OpenAndJoin(gated, writer);  // the put ends; then the write lease
  ASSERT_OK_AND_ASSIGN(TensorLease w, write.get());
  EXPECT_FALSE(w.read_only());
  EXPECT_EQ(w.data(), r.data());  // the block read during the put is still the tensor's
  w.Release();
  EXPECT_THAT(store->Evict(id), StatusIs(absl::StatusCode::kFailedPrecondition));  // r holds it
  r.Release();
  ASSERT_OK(store->Evict(id));
  ASSERT_OK(store->Flush());
  std::vector<std::byte> stored(kBytes);
  ASSERT_OK_AND_ASSIGN(std::size_t n, volume->Get("t", stored));
  EXPECT_EQ(n, kBytes);
  EXPECT_EQ(stored, Pattern("t", 1, kBytes));
}

// An eviction writing its victim back, when a read lease pins the victim during the put,
// evicts nothing: the lease keeps the bytes, and the acquire that wanted the room is told
// the budget is held (kResourceExhausted), then succeeds once the lease ends.
TEST(TensorStore, AReadLeaseTakenDuringAnEvictionsWriteBackKeepsItsBlock) {
  ScratchPath path("store");
  auto volume = testing::MakeVolume(path.path(), 16 * kMiB);
  GatedStore gated(volume.get());
  constexpr std::size_t kBytes = 256 * kKiB;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(&gated, Budget(kBytes + kBytes / 2)));
  ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", kBytes)));
  ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", kBytes)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(a));
    Fill(lease, "a", 1);
  }
  absl::Status for_b;
  std::thread wants_b([&] { for_b = store->Acquire(b).status(); });  // evicts 'a', dirty
  const absl::Cleanup end = [&] { OpenAndJoin(gated, wants_b); };
  ASSERT_TRUE(gated.entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_OK_AND_ASSIGN(TensorLease r, store->AcquireForRead(a));  // at once: 'a' is writing
  EXPECT_TRUE(Holds(r, "a", 1));
  OpenAndJoin(gated, wants_b);
  EXPECT_THAT(for_b, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(Holds(r, "a", 1));  // not evicted, nor reused for 'b'
  r.Release();
  ASSERT_OK_AND_ASSIGN(TensorLease lease_b, store->Acquire(b));  // 'a', clean, makes room
  lease_b.Release();
  ASSERT_OK(store->Flush());
  std::vector<std::byte> stored(kBytes);
  ASSERT_OK_AND_ASSIGN(std::size_t n, volume->Get("a", stored));
  EXPECT_EQ(n, kBytes);
  EXPECT_EQ(stored, Pattern("a", 1, kBytes));
}

// A lease from AcquireForRead is for reading: MarkDirty on it stops the process, since
// its bytes may be on their way to the volume.
TEST(TensorStoreDeathTest, MarkDirtyOnAReadLeaseStopsTheProcess) {
  ScratchPath path("store");
  auto volume = testing::MakeVolume(path.path(), 16 * kMiB);
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("t", 64 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->AcquireForRead(id));
  EXPECT_DEATH(lease.MarkDirty(), "MarkDirty on a lease from AcquireForRead");
}

TEST(TensorStore, FlushedDurableTensorsSurviveAReopenAndScratchOnesDoNot) {
  ScratchPath path("store");
  {
    auto volume = MakeVolume(path.path());
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
    ASSERT_OK_AND_ASSIGN(TensorId d,
                         store->Register(Spec("master.0", 100000, DType::kF32, {25000},
                                              Use::kOptimizerState, Durability::kDurable)));
    ASSERT_OK_AND_ASSIGN(TensorId s, store->Register(Spec("swap.0", 50000, DType::kBF16, {25000},
                                                          Use::kGradients, Durability::kScratch)));
    {
      ASSERT_OK_AND_ASSIGN(TensorLease ld, store->Acquire(d));
      Fill(ld, "master.0", 7);
      ASSERT_OK_AND_ASSIGN(TensorLease ls, store->Acquire(s));
      Fill(ls, "swap.0", 7);
    }
    ASSERT_OK(store->Flush());
  }
  ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(path.path(), {}));
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
  EXPECT_EQ(store->StoredTensors(), std::vector<std::string>{"master.0"});
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, volume->Stat("master.0"));
  EXPECT_EQ(info.metadata, "dtype=f32;shape=25000;use=optimizer_state");
  ASSERT_OK_AND_ASSIGN(TensorId d, store->Register(Spec("master.0", 100000, DType::kF32, {25000},
                                                        Use::kOptimizerState)));
  ASSERT_OK_AND_ASSIGN(TensorLease ld, store->Acquire(d));
  EXPECT_TRUE(Holds(ld, "master.0", 7));
  EXPECT_THAT(store->Register(Spec("master.0", 1, DType::kF32)),
              StatusIs(absl::StatusCode::kAlreadyExists));
  // The scratch tensor is gone: a new one of that name starts as zeros.
  ASSERT_OK_AND_ASSIGN(TensorId s, store->Register(Spec("swap.0", 50000, DType::kBF16, {25000},
                                                        Use::kGradients, Durability::kScratch)));
  ASSERT_OK_AND_ASSIGN(TensorLease ls, store->Acquire(s));
  EXPECT_EQ(ls.data()[100], std::byte{0});
  // A stored durable tensor registered with another size is refused.
  ld.Release();
  ls.Release();
  store.reset();
  ASSERT_OK_AND_ASSIGN(store, TensorStore::Open(volume.get(), Budget(4 * kMiB)));
  EXPECT_THAT(store->Register(Spec("master.0", 99999, DType::kF32)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds 100000")));
  EXPECT_THAT(TensorStore::Open(volume.get(), Budget(0)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Registers `n` durable tensors `prefix.i` of `bytes`, each holding version 1 of its
// pattern, flushed to the volume and evicted: all cold.
void AddColdTensors(TensorStore& store, const std::string& prefix, int n, std::size_t bytes,
                    std::vector<TensorId>* ids) {
  for (int i = 0; i < n; ++i) {
    const std::string name = prefix + "." + std::to_string(i);
    ASSERT_OK_AND_ASSIGN(TensorId id, store.Register(Spec(name, bytes)));
    ids->push_back(id);
    ASSERT_OK_AND_ASSIGN(TensorLease l, store.Acquire(id));
    Fill(l, name, 1);
  }
  ASSERT_OK(store.Flush());
  for (TensorId id : *ids) ASSERT_OK(store.Evict(id));
}

TEST(TensorStore, PrefetchAndStreamingCountHitsAndMisses) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  const TensorStoreOptions o = Budget(8 * 256 * kKiB);
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  std::vector<TensorId> layers;
  ASSERT_NO_FATAL_FAILURE(AddColdTensors(*store, "layer", 16, 256 * kKiB, &layers));
  ASSERT_OK(store->Prefetch(layers[0]).Wait());
  EXPECT_TRUE(store->Prefetch(layers[0]).Poll());  // resident already
  const std::uint64_t misses_before = store->stats().prefetch_misses;
  TensorStream stream(store.get(), layers, 3);
  for (int pass = 0; pass < 2; ++pass) {  // forward, then backward
    for (std::size_t i = 0; i < layers.size(); ++i) {
      ASSERT_OK_AND_ASSIGN(TensorLease l, stream.Next());
      const std::size_t layer = pass == 0 ? i : layers.size() - 1 - i;
      ASSERT_TRUE(Holds(l, "layer." + std::to_string(layer), 1)) << pass << " " << i;
    }
    EXPECT_THAT(stream.Next(), StatusIs(absl::StatusCode::kOutOfRange));
    stream.Reverse();
  }
  const TensorStoreStats s = store->stats();
  EXPECT_GT(s.prefetch_hits, s.prefetch_misses - misses_before);
  EXPECT_GT(s.bytes_read, 0u);
  EXPECT_LE(s.ledger.tier(Tier::kPinnedHost).reserved_peak,
            static_cast<std::int64_t>(o.host_budget_bytes));
}

// Note [residency]: a tensor prefetched and not yet used is evicted only after every
// other unleased one, and never by another prefetch, which is dropped instead.
TEST(TensorStore, APrefetchNeverEvictsAnEarlierPrefetchNotYetUsed) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 3 * 256 * kKiB;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  std::vector<TensorId> t;
  ASSERT_NO_FATAL_FAILURE(AddColdTensors(*store, "t", 5, 256 * kKiB, &t));
  // t.0 and t.1 are prefetched; then t.3 is used (resident, not wanted).
  ASSERT_OK(store->Prefetch(t[0]).Wait());
  ASSERT_OK(store->Prefetch(t[1]).Wait());
  const std::uint64_t misses0 = store->stats().prefetch_misses;
  { ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[3])); }
  // t.2 takes t.3's block, although t.0 was loaded before t.3 was used.
  ASSERT_OK(store->Prefetch(t[2]).Wait());
  // No room is left but prefetched tensors': t.4's prefetch is dropped.
  EXPECT_THAT(store->Prefetch(t[4]).Wait(), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(store->stats().prefetch_dropped, 1u);
  const std::uint64_t read = store->stats().bytes_read;
  for (int i : {0, 1, 2}) {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[static_cast<std::size_t>(i)]));
    EXPECT_TRUE(Holds(l, "t." + std::to_string(i), 1));
  }
  EXPECT_EQ(store->stats().bytes_read, read);              // each was still resident
  EXPECT_EQ(store->stats().prefetch_misses, misses0 + 1);  // t.3's acquire only
  // Used, they are ordinary again: t.4 loads in place of the least recently used, t.0.
  ASSERT_OK(store->Prefetch(t[4]).Wait());
  {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[4]));
    EXPECT_TRUE(Holds(l, "t.4", 1));
  }
  const std::uint64_t misses = store->stats().prefetch_misses;
  { ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[2])); }
  EXPECT_EQ(store->stats().prefetch_misses, misses);
  { ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[0])); }
  EXPECT_EQ(store->stats().prefetch_misses, misses + 1);
  // A demand may evict a wanted tensor when nothing else is left.
  ASSERT_OK(store->Prefetch(t[1]).Wait());
  ASSERT_OK(store->Prefetch(t[3]).Wait());
  ASSERT_OK(store->Prefetch(t[4]).Wait());
  ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[2]));
  EXPECT_TRUE(Holds(l, "t.2", 1));
}

// Note [residency]: with defer_prefetches, a prefetch waiting for room loads when a discard makes
// some; one still waiting when the store closes is cancelled; one overtaken by a use completes.
TEST(TensorStore, DeferredPrefetchesLoadWhenRoomAppearsAndEndWithTheStore) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 2 * 256 * kKiB;
  o.defer_prefetches = true;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  std::vector<TensorId> t;
  ASSERT_NO_FATAL_FAILURE(AddColdTensors(*store, "t", 5, 256 * kKiB, &t));
  ASSERT_OK(store->Prefetch(t[0]).Wait());
  ASSERT_OK(store->Prefetch(t[1]).Wait());
  PrefetchTicket t2 = store->Prefetch(t[2]);
  PrefetchTicket t3 = store->Prefetch(t[3]);
  for (int i = 0; i < 2000 && store->stats().prefetch_deferred < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(store->stats().prefetch_deferred, 2u);
  // t.0 discarded: the earlier of the two waiting prefetches takes its room.
  ASSERT_OK(store->Discard(t[0]));
  ASSERT_OK(t2.Wait());
  EXPECT_FALSE(t3.Poll());
  const std::uint64_t misses = store->stats().prefetch_misses;
  {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[2]));
    EXPECT_TRUE(Holds(l, "t.2", 1));
  }
  EXPECT_EQ(store->stats().prefetch_misses, misses);
  // t.2 used and released: t.3 loads in its place.
  ASSERT_OK(t3.Wait());
  // t.4 waits behind t.1 and t.3 (both wanted); used first, its prefetch completes.
  PrefetchTicket t4 = store->Prefetch(t[4]);
  for (int i = 0; i < 2000 && store->stats().prefetch_deferred < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[4]));
    EXPECT_TRUE(Holds(l, "t.4", 1));
  }
  ASSERT_OK(t4.Wait());
  // Both held again by wanted tensors, a last prefetch waits until the store closes.
  ASSERT_OK(store->Prefetch(t[0]).Wait());
  PrefetchTicket t2_again = store->Prefetch(t[2]);
  for (int i = 0; i < 2000 && store->stats().prefetch_deferred < 4; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(t2_again.Poll());
  store.reset();
  EXPECT_THAT(t2_again.Wait(), StatusIs(absl::StatusCode::kCancelled));
}

// Note [retention]: a cyclic walk over more tensors than the budget holds keeps nothing
// with least-recently-used eviction; with a kept subset, that subset stays resident
// from one pass to the next, and the rest streams around it.
TEST(TensorStore, KeptTensorsStayResidentAcrossCyclicPasses) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(4 * 256 * kKiB)));
  std::vector<TensorId> t;
  ASSERT_NO_FATAL_FAILURE(AddColdTensors(*store, "t", 6, 256 * kKiB, &t));
  const auto pass = [&]() -> std::uint64_t {
    const std::uint64_t before = store->stats().bytes_read;
    for (std::size_t i = 0; i < t.size(); ++i) {
      auto l = store->Acquire(t[i]);
      EXPECT_OK(l.status());
      if (l.ok()) {
        EXPECT_TRUE(Holds(*l, "t." + std::to_string(i), 1));
      }
    }
    return store->stats().bytes_read - before;
  };
  ASSERT_EQ(pass(), 6 * 256 * kKiB);
  EXPECT_EQ(pass(), 6 * 256 * kKiB);  // LRU: each evicted before its next use
  EXPECT_THAT(store->SetRetention(TensorId{99}, Retention::kKeep),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(store->SetRetention(t[0], Retention::kKeep));
  ASSERT_OK(store->SetRetention(t[1], Retention::kKeep));
  pass();                             // loads the kept ones once more
  EXPECT_EQ(pass(), 4 * 256 * kKiB);  // t.0 and t.1 served from memory
  EXPECT_EQ(pass(), 4 * 256 * kKiB);
  // A prefetch never evicts a kept tensor: with t.0, t.1 kept and t.4, t.5 prefetched
  // (resident already, now wanted), t.2's prefetch finds no block.
  ASSERT_OK(store->Prefetch(t[4]).Wait());
  ASSERT_OK(store->Prefetch(t[5]).Wait());
  EXPECT_THAT(store->Prefetch(t[2]).Wait(), StatusIs(absl::StatusCode::kResourceExhausted));
  // A demand evicts a kept tensor before a wanted one, when nothing else is left.
  {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[2]));
    EXPECT_TRUE(Holds(l, "t.2", 1));
  }
  const std::uint64_t read = store->stats().bytes_read;
  for (int i : {4, 5}) {
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(t[static_cast<std::size_t>(i)]));
    EXPECT_TRUE(Holds(l, "t." + std::to_string(i), 1));
  }
  EXPECT_EQ(store->stats().bytes_read, read);  // the prefetched ones were still resident
  // Back to kNormal: plain LRU again.
  ASSERT_OK(store->SetRetention(t[0], Retention::kNormal));
  ASSERT_OK(store->SetRetention(t[1], Retention::kNormal));
  pass();
  EXPECT_EQ(pass(), 6 * 256 * kKiB);
}

// Several threads acquire, modify, prefetch, evict and flush random tensors under a
// tight budget; each tensor's content is always the pattern of its latest version.
TEST(TensorStore, RandomOperationsFromSeveralThreads) {
  ScratchPath path("store");
  auto volume = MakeVolume(path.path());
  TensorStoreOptions o;
  o.host_budget_bytes = 6 * 128 * kKiB;
  MemoryLedger ledger;
  o.ledger = &ledger;
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), o));
  constexpr int kTensors = 12;
  std::vector<TensorId> ids;
  for (int i = 0; i < kTensors; ++i) {
    ids.push_back(*store->Register(
        Spec("t" + std::to_string(i), 100 * kKiB + static_cast<std::size_t>(i) * 4096)));
  }
  // One owner thread per tensor modifies it, so versions are known; all threads read all.
  std::vector<std::atomic<std::uint64_t>> version(kTensors);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int step = 0; step < 300; ++step) {
        const int k = static_cast<int>(rng() % kTensors);
        const TensorId id = ids[static_cast<std::size_t>(k)];
        const int op = static_cast<int>(rng() % 10);
        if (op < 6) {
          auto lease = store->Acquire(id);
          if (!lease.ok()) {
            // Under this budget only a shortage is an acceptable failure.
            if (lease.status().code() != absl::StatusCode::kResourceExhausted) ++failures;
            continue;
          }
          if (k % 4 == t) {
            // Only the owner writes: whatever evictions and write-backs other threads
            // caused, the tensor must still hold the owner's last version.
            const std::uint64_t last = version[static_cast<std::size_t>(k)].load();
            const bool intact = last == 0 ? lease->data()[0] == std::byte{0} &&
                                                lease->data()[lease->size() - 1] == std::byte{0}
                                          : Holds(*lease, "t" + std::to_string(k), last);
            if (!intact) ++failures;
            Fill(*lease, "t" + std::to_string(k), last + 1);
            version[static_cast<std::size_t>(k)].store(last + 1);
          }
        } else if (op < 8) {
          (void)store->Prefetch(id).Wait();
        } else if (op == 8) {
          const absl::Status s = store->Evict(id);
          if (!s.ok() && s.code() != absl::StatusCode::kFailedPrecondition) ++failures;
        } else {
          if (!store->WriteBack(id).ok()) ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(ledger.Snapshot().tier(Tier::kPinnedHost).reserved_peak,
            static_cast<std::int64_t>(o.host_budget_bytes));
  // Every tensor holds its latest version, in memory and, after a flush, on the volume.
  ASSERT_OK(store->Flush());
  for (int k = 0; k < kTensors; ++k) {
    ASSERT_OK(store->Evict(ids[static_cast<std::size_t>(k)]));
    ASSERT_OK_AND_ASSIGN(TensorLease l, store->Acquire(ids[static_cast<std::size_t>(k)]));
    const std::uint64_t v = version[static_cast<std::size_t>(k)].load();
    if (v == 0) {
      EXPECT_EQ(l.data()[0], std::byte{0});
    } else {
      EXPECT_TRUE(Holds(l, "t" + std::to_string(k), v)) << k;
    }
  }
}

TEST(TensorStore, AcquireForWriteNeedsNoMarkDirtyAndLeasesAreTyped) {
  ScratchPath path("store_write_intent");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec("w", 64 * kKiB, DType::kF32)));
  {
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->AcquireForWrite(id));
    std::span<float> f = lease.as<float>();
    ASSERT_EQ(f.size(), 16 * kKiB);
    for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i);
  }
  ASSERT_OK(store->Evict(id));  // written back though nobody called MarkDirty
  ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
  EXPECT_EQ(lease.as<float>()[12345], 12345.0f);
  EXPECT_EQ(lease.as<std::uint16_t>().size(), 32 * kKiB);
  EXPECT_THAT(store->AcquireForWrite(99), StatusIs(absl::StatusCode::kInvalidArgument));
}

// A shape, where given, is of the tensor's bytes (a spec of 1000 bytes registered as 10 x
// 10 f32 was taken, a negative dimension too).
TEST(TensorStore, AShapeThatIsNotTheBytesIsRefused) {
  ScratchPath path("store_shape");
  auto volume = MakeVolume(path.path());
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
  TensorSpec s = Spec("t", 1000);
  s.dtype = DType::kF32;
  for (std::vector<std::int64_t> shape : std::vector<std::vector<std::int64_t>>{
           {10, 10}, {-2, -125}, {1 << 30, 1 << 30, 1 << 30}, {251}}) {
    s.shape = shape;
    EXPECT_THAT(store->Register(s).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not 1000 bytes")));
  }
  s.shape = {10, 25};
  EXPECT_OK(store->Register(s).status());
  s.name = "u";
  s.shape = {};  // none given: the bytes alone
  EXPECT_OK(store->Register(s).status());
}

TEST(TensorStore, CloseCommitsDirtyDurableTensorsAndSoDoesADestroyedStore) {
  ScratchPath path("store_close");
  auto volume = MakeVolume(path.path());
  {
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
    ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 100 * kKiB)));
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(a));
    Fill(lease, "a", 1);
    lease.Release();
    ASSERT_OK(store->Close());
    ASSERT_OK(store->Close());  // again: the first one's status
    // After Close: refused, saying so (Register and Flush said OK, Acquire "no tensor").
    EXPECT_THAT(store->Register(Spec("c", 100 * kKiB)).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("after Close")));
    EXPECT_THAT(store->Flush(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("after Close")));
    EXPECT_THAT(store->Acquire(a).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("after Close")));
    EXPECT_THAT(store->AcquireForRead(a).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("after Close")));
  }
  {
    // Destroyed without Close or Flush: the dirty durable tensor is not dropped.
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
    ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 100 * kKiB)));
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(b));
    Fill(lease, "b", 2);
  }
  volume.reset();
  ASSERT_OK_AND_ASSIGN(volume, Volume::Open(path.path(), {}));
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
  ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 100 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 100 * kKiB)));
  ASSERT_OK_AND_ASSIGN(TensorLease la, store->Acquire(a));
  EXPECT_TRUE(Holds(la, "a", 1));
  ASSERT_OK_AND_ASSIGN(TensorLease lb, store->Acquire(b));
  EXPECT_TRUE(Holds(lb, "b", 2));
}

// Note [commit when full]: a caller that orders the commits turns the commit at close
// off; the store's close then commits nothing (a tensor written back and staged, one
// dirty): the volume keeps what its last commit held.
TEST(TensorStore, ACloseWithoutItsCommitLeavesTheLastCommit) {
  ScratchPath path("store_close_no_commit");
  auto volume = MakeVolume(path.path());
  {
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
    ASSERT_OK_AND_ASSIGN(TensorId a, store->Register(Spec("a", 100 * kKiB)));
    ASSERT_OK_AND_ASSIGN(TensorId b, store->Register(Spec("b", 100 * kKiB)));
    for (auto [id, name] : {std::pair{a, "a"}, std::pair{b, "b"}}) {
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      Fill(lease, name, 1);
    }
    ASSERT_OK(store->Flush());  // the last commit: both at 1
    for (auto [id, name] : {std::pair{a, "a"}, std::pair{b, "b"}}) {
      ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
      Fill(lease, name, 2);
    }
    ASSERT_OK(store->WriteBack(a));  // staged, not committed
    store->SetCommitAtClose(false);
    ASSERT_OK(store->Close());
  }
  EXPECT_EQ(volume->staged_bytes(), 0u);  // forgotten in this process too
  volume.reset();
  ASSERT_OK_AND_ASSIGN(volume, Volume::Open(path.path(), {}));
  ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), Budget(1 * kMiB)));
  for (const char* name : {"a", "b"}) {
    ASSERT_OK_AND_ASSIGN(TensorId id, store->Register(Spec(name, 100 * kKiB)));
    ASSERT_OK_AND_ASSIGN(TensorLease lease, store->Acquire(id));
    EXPECT_TRUE(Holds(lease, name, 1)) << name;
  }
}

}  // namespace
}  // namespace memascend
