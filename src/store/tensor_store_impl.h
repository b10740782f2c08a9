// store/tensor_store_impl.h: the state of a TensorStore, shared by its parts:
//   tensor_store.cpp  the public API (registration, acquires, flush, close, leases);
//   residency.cpp     host residency: blocks under the budget, loads and write-backs;
//   eviction.cpp      which tensor leaves memory (pure, store/eviction.h);
//   gpu_tier.cpp      the device copies of Note [gpu tier];
//   prefetch.cpp      the prefetch queue, its workers and the write-behinds.
// Note [store locking]: `mu` guards everything below it. Every method named ...Locked is
// called with it held and may release it around I/O; no CUDA call that waits or
// allocates (a copy, a synchronisation, an event's wait, a device allocation) is made with
// it held: the GPU tier releases it around each one. Queries that never wait are made
// under it: an event's Ready() (the host blocks' reuse fences, Note [reuse fences], and
// Note [host writes after a copy]), and a fence's destruction with its block.
//
// Note [host writes after a copy]: a copy into the device reads its tensor's host block
// asynchronously (its event is gpu_ready, which is also the block's reuse fence). A lease
// that lets the host write the block (writable, for overwrite, a copy's destination, or a
// clean block handed to another tensor) waits for that copy first: the device copy, still
// valid, would otherwise take in some of the new bytes.
#ifndef MEMASCEND_SRC_STORE_TENSOR_STORE_IMPL_H_
#define MEMASCEND_SRC_STORE_TENSOR_STORE_IMPL_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>

#include "prim/cuda_memory.h"
#include "store/device_pool.h"
#include "store/eviction.h"

namespace memascend {

struct PrefetchTicket::State {
  absl::Mutex mu;
  absl::CondVar cv;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::atomic<bool> finished{false};

  void Finish(absl::Status s) {
    absl::MutexLock lock(&mu);
    status = std::move(s);
    done = true;
    finished.store(true);
    cv.SignalAll();
  }
};

namespace store {
using Clock = std::chrono::steady_clock;
inline double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
// The metadata a durable tensor's object carries on the volume.
std::string Metadata(const TensorSpec& s);
}  // namespace store

struct TensorStore::Impl {
  enum class State { kCold, kLoading, kResident, kWriting };
  struct Tensor {
    TensorSpec spec;
    State state = State::kCold;
    PinnedBlock block;
    int pins = 0;
    int host_writers =
        0;  // of the pins, host leases that may write (Note [write-back under a writer])
    bool dirty = false;
    bool stored = false;  // the volume holds its bytes
    bool wanted = false;  // prefetched to the host and not used since (Note [residency])
    Retention retention = Retention::kNormal;  // Note [retention]
    std::uint64_t last_use = 0;
    // The GPU tier (Note [gpu tier]).
    std::byte* gpu = nullptr;  // device block, or null
    bool gpu_valid = false;    // the device block holds the current bytes
    bool gpu_dirty = false;    // ... and they are newer than the host's and the volume's
    bool gpu_busy = false;     // a thread is copying to or from the device, mu released
    int gpu_pins = 0;
    std::uint64_t gpu_last_use = 0;
    std::shared_ptr<prim::CudaEvent> gpu_ready;  // the last copy into the device block
    // Note [gpu tier]: the release events of the device leases whose work may still run
    // (each recorded on its holder's stream); pruned of completed ones by the next GPU
    // acquire, waited for (and cleared) before the block is copied back or reused.
    std::vector<std::shared_ptr<prim::CudaEvent>> gpu_uses;
    // Every event the device block's work may still be behind: the copy in and the
    // released leases' (taken under mu, waited for without it).
    std::vector<std::shared_ptr<prim::CudaEvent>> GpuEvents() const {
      std::vector<std::shared_ptr<prim::CudaEvent>> events = gpu_uses;
      if (gpu_ready != nullptr) events.push_back(gpu_ready);
      return events;
    }
  };

  // A prefetch job: the tensor, the tier and (for the GPU) the stream.
  struct Job {
    TensorId id;
    Tier tier;
    CudaStreamView stream;
    std::shared_ptr<PrefetchTicket::State> ticket;  // null for a write-behind
  };

  ObjectStore* volume = nullptr;
  TensorStoreOptions options;
  std::atomic<bool> commit_when_full{true};  // Note [commit when full]
  std::atomic<bool> commit_at_close{true};   // Note [commit when full]
  std::unique_ptr<MemoryLedger> own_ledger;
  MemoryLedger* ledger = nullptr;
  std::unique_ptr<HostArena> arena;

  mutable absl::Mutex mu;
  absl::CondVar cv;
  std::unique_ptr<PinnedPool> pool
      ABSL_GUARDED_BY(mu);  // made at first use, from the registered sizes
  std::vector<std::unique_ptr<Tensor>> tensors ABSL_GUARDED_BY(mu);
  std::map<std::string, TensorId, std::less<>> names ABSL_GUARDED_BY(mu);
  std::uint64_t tick ABSL_GUARDED_BY(mu) = 0;
  int puts_in_flight ABSL_GUARDED_BY(mu) = 0;  // write-backs' puts under way (WriteBackLocked)
  TensorStoreStats counters ABSL_GUARDED_BY(mu);

  std::unique_ptr<store::DevicePool> device_pool ABSL_GUARDED_BY(mu);  // at the first GPU use
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);
  // Prefetches that found no room (Note [residency]): retried, first ones first, when a
  // lease ends or a tensor leaves memory.
  std::deque<Job> deferred ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
  bool gpu_starting ABSL_GUARDED_BY(mu) = false;  // a thread makes the device slab
  std::vector<std::thread> workers;
  bool closed = false;  // Close() ran (the caller's thread only)
  absl::Status close_status;

  absl::Status CheckId(TensorId id) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (id >= tensors.size())
      return absl::InvalidArgumentError(fmt::format("no tensor with id {}", id));
    return absl::OkStatus();
  }

  absl::Status EnsurePool() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (pool != nullptr) return absl::OkStatus();
    PinnedPoolOptions po;
    po.policy = options.pool_policy;
    po.reuse_free_regions = true;  // a fixed budget, used for the whole run
    po.expected_sizes = options.expected_sizes;
    for (const auto& t : tensors) po.expected_sizes.push_back(t->spec.bytes);
    MEMASCEND_ASSIGN_OR_RETURN(pool, PinnedPool::Create(arena.get(), po));
    return absl::OkStatus();
  }

  // Writes a resident tensor back; mu is released during the I/O.
  absl::Status WriteBackLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // store/eviction.h's view of the tensors, rebuilt by each AllocateLocked round.
  std::vector<store::EvictionCandidate> candidates ABSL_GUARDED_BY(mu);

  // A block for `bytes`, evicting unleased tensors while the budget is short, in
  // EvictionRank order. For a prefetch (`prefetch`), never a wanted or kept one:
  // kResourceExhausted instead.
  absl::StatusOr<PinnedBlock> AllocateLocked(const Tensor& wanting, bool prefetch = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Starts making a cold `t` resident (without pinning it). Making room may release mu:
  // if another thread took the tensor meanwhile, the block goes back and the caller
  // looks at the tensor's state again.
  absl::Status LoadLocked(Tensor& t, bool prefetch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Makes `t` resident in host memory without pinning it (no counters); for a prefetch,
  // only if that evicts nothing wanted (AllocateLocked).
  absl::Status MakeResidentLocked(Tensor& t, bool* loaded_here, bool prefetch = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Makes `t` resident and pins it (Acquire's loop, without counters): a use.
  absl::Status HostResidentLocked(Tensor& t, bool* loaded_here) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  absl::Status GpuUsableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Copies a dirty device copy back into a host block (loaded or fresh), which becomes
  // dirty. The caller has set t.gpu_busy; mu is released during the copy.
  absl::Status GpuToHostLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Waits until no thread copies `t` to or from the device, then claims that role.
  void ClaimGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void UnclaimGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // GpuToHostLocked for an unclaimed `t`.
  absl::Status CopyBackLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Evict(id, Tier::kGpu): kFailedPrecondition while leased on the device.
  absl::Status EvictGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Gives the device block back to the pool; the device copy is gone.
  absl::Status FreeGpuBlockLocked(Tensor& t, std::shared_ptr<prim::CudaEvent>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Waits, asleep and with mu released, for every copy and lease's work that may still
  // run on t's device block (Tensor::GpuEvents); the caller has claimed `t` (gpu_busy).
  // Their errors are their streams' holders' to see, as a query's would have been.
  void WaitGpuWorkLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Note [host writes after a copy]: if `t`'s last copy into the device may still be
  // reading its host block, waits for it with mu released (`t` pinned meanwhile) and
  // returns true; false at once otherwise.
  bool WaitCopyFromHostLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Drops `done` (complete, or covered by a later event) from t.gpu_uses; events released
  // meanwhile stay. The caller still holds `done`, so none is destroyed under mu.
  static void ForgetGpuUsesLocked(Tensor& t,
                                  const std::vector<std::shared_ptr<prim::CudaEvent>>& done);

  // Frees the device block of an unleased `t` (claimed by the caller), copying it back
  // first if dirty and waiting for the work queued on it.
  absl::Status DropGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // A device block for `t`, evicting unleased device copies, least recently used first.
  absl::Status AllocateGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Makes the device copy of `t` current, queued on `stream`; pins it if `pin`.
  absl::Status GpuResidentLocked(Tensor& t, CudaStreamView stream, bool pin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  absl::Status GpuResidentClaimedLocked(Tensor& t, CudaStreamView stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Room may have appeared: the deferred prefetches go back to the head of the queue.
  void RetryDeferredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  void Work();
};

}  // namespace memascend

#endif  // MEMASCEND_SRC_STORE_TENSOR_STORE_IMPL_H_
