#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>

#include "prim/cuda_memory.h"
#include "store/device_pool.h"
#include "util/units.h"

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

absl::Status PrefetchTicket::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty prefetch ticket");
  absl::MutexLock lock(&state_->mu);
  while (!state_->done) state_->cv.Wait(&state_->mu);
  return state_->status;
}

bool PrefetchTicket::Poll() const { return state_ != nullptr && state_->finished.load(); }

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string Metadata(const TensorSpec& s) {
  std::string shape;
  for (std::size_t i = 0; i < s.shape.size(); ++i)
    shape += (i ? "," : "") + std::to_string(s.shape[i]);
  return fmt::format("dtype={};shape={};use={}", ToString(s.dtype), shape, ToString(s.use));
}

}  // namespace

struct TensorStore::Impl {
  enum class State { kCold, kLoading, kResident, kWriting };
  struct Tensor {
    TensorSpec spec;
    State state = State::kCold;
    PinnedBlock block;
    int pins = 0;
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
    CudaStreamView gpu_stream;                   // of the last copy in or dirty lease
    std::shared_ptr<prim::CudaEvent> gpu_ready;  // the last copy into the device block
    std::shared_ptr<prim::CudaEvent> gpu_idle;   // work of the last lease on the block
  };

  // A prefetch job: the tensor, the tier and (for the GPU) the stream.
  struct Job {
    TensorId id;
    Tier tier;
    CudaStreamView stream;
    std::shared_ptr<PrefetchTicket::State> ticket;  // null for a write-behind
  };

  Volume* volume = nullptr;
  TensorStoreOptions options;
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
  TensorStoreStats counters ABSL_GUARDED_BY(mu);

  std::unique_ptr<store::DevicePool> device_pool ABSL_GUARDED_BY(mu);  // at the first GPU use
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);
  // Prefetches that found no room (Note [residency]): retried, first ones first, when a
  // lease ends or a tensor leaves memory.
  std::deque<Job> deferred ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
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
    po.reuse_free_regions = true;  // a fixed budget, used for the whole run
    po.expected_sizes = options.expected_sizes;
    for (const auto& t : tensors) po.expected_sizes.push_back(t->spec.bytes);
    MEMASCEND_ASSIGN_OR_RETURN(pool, PinnedPool::Create(arena.get(), po));
    return absl::OkStatus();
  }

  // Writes a resident tensor back; mu is released during the I/O.
  absl::Status WriteBackLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (t.state != State::kResident || !t.dirty) return absl::OkStatus();
    t.state = State::kWriting;
    t.dirty = false;
    const auto start = Clock::now();
    mu.Unlock();
    // Durable tensors are staged: committed together at Flush (Note [staged puts]).
    // Staged objects keep their previous versions' extents until committed: when the
    // volume runs out of room, commit what is staged (freeing those) and try again.
    const std::span<const std::byte> bytes{t.block.data(), t.spec.bytes};
    const auto put = [&] {
      return t.spec.durability == Durability::kDurable
                 ? volume->PutStaged(t.spec.name, bytes, Metadata(t.spec))
                 : volume->Put(t.spec.name, bytes, Durability::kScratch);
    };
    absl::Status s = put();
    if (s.code() == absl::StatusCode::kResourceExhausted && volume->Sync().ok()) s = put();
    mu.Lock();
    t.state = State::kResident;
    cv.SignalAll();
    if (!s.ok()) {
      t.dirty = true;
      return s;
    }
    t.stored = true;
    ++counters.write_backs;
    counters.bytes_written += t.spec.bytes;
    counters.write_seconds += Since(start);
    return absl::OkStatus();
  }

  // Eviction order (Note [residency], Note [retention]): tensors neither wanted nor
  // kept first, then kept ones, then wanted ones; least recently used first within each.
  static int EvictionRank(const Tensor& t) {
    return t.wanted ? 2 : t.retention == Retention::kKeep ? 1 : 0;
  }

  // A block for `bytes`, evicting unleased tensors while the budget is short, in
  // EvictionRank order. For a prefetch (`prefetch`), never a wanted or kept one:
  // kResourceExhausted instead.
  absl::StatusOr<PinnedBlock> AllocateLocked(const Tensor& wanting, bool prefetch = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_RETURN_IF_ERROR(EnsurePool());
    for (;;) {
      auto block = pool->Allocate(wanting.spec.bytes, wanting.spec.use);
      if (block.ok() || block.status().code() != absl::StatusCode::kResourceExhausted) return block;
      Tensor* victim = nullptr;
      int victim_rank = 0;
      int writing_rank = 3;  // the lowest rank of an unleased tensor being written back
      for (const auto& t : tensors) {
        if (t.get() == &wanting || t->pins != 0) continue;
        if (t->state == State::kWriting) writing_rank = std::min(writing_rank, EvictionRank(*t));
        if (t->state != State::kResident) continue;
        const int rank = EvictionRank(*t);
        if (victim == nullptr || rank < victim_rank ||
            (rank == victim_rank && t->last_use < victim->last_use)) {
          victim = t.get();
          victim_rank = rank;
        }
      }
      if (victim != nullptr && victim_rank > writing_rank) {
        // A tensor of a lower rank is being written back: it will be evictable as soon
        // as its write ends, and evicting it then costs nothing a later read must undo.
        cv.Wait(&mu);
        continue;
      }
      if (prefetch && victim != nullptr && victim_rank > 0) {
        return absl::ResourceExhaustedError(fmt::format(
            "prefetch of '{}' dropped: the host budget holds only leased tensors and tensors "
            "prefetched earlier or kept",
            wanting.spec.name));
      }
      if (victim == nullptr) {
        // Loads and write-backs in flight end as unleased resident tensors, which can be
        // evicted: wait for them rather than fail a demand for memory a prefetch holds.
        bool transient = false;
        for (const auto& t : tensors) {
          transient |=
              t.get() != &wanting && (t->state == State::kLoading || t->state == State::kWriting);
        }
        if (transient) {
          cv.Wait(&mu);
          continue;
        }
        std::uint64_t held = 0;
        for (const auto& t : tensors) held += t->state == State::kCold ? 0 : t->block.capacity();
        const std::size_t need = pool->BlockBytesFor(wanting.spec.bytes);
        if (held + need <= options.host_budget_bytes) {
          // The budget has room, the pool none: its memory is fragmented around the
          // leased blocks, or growing it failed (mlock limit, mmap): its message says.
          return absl::ResourceExhaustedError(fmt::format(
              "tensor '{}' needs a block of {}: the host budget of {} has {} outside leased "
              "tensors, but the pool cannot provide it ({}; largest free extent {}); a budget "
              "further above the leased peak avoids fragmentation",
              wanting.spec.name, util::FormatBytes(need),
              util::FormatBytes(options.host_budget_bytes),
              util::FormatBytes(options.host_budget_bytes - held),
              std::string(block.status().message()),
              util::FormatBytes(arena->stats().largest_free_extent)));
        }
        return absl::ResourceExhaustedError(fmt::format(
            "tensor '{}' needs {} but the host budget of {} is held by leased or loading "
            "tensors ({}); {} short",
            wanting.spec.name, util::FormatBytes(wanting.spec.bytes),
            util::FormatBytes(options.host_budget_bytes), util::FormatBytes(held),
            util::FormatBytes(held + need - options.host_budget_bytes)));
      }
      MEMASCEND_RETURN_IF_ERROR(WriteBackLocked(*victim));
      if (victim->state != State::kResident || victim->pins != 0)
        continue;  // changed while writing
      victim->block.Reset();
      victim->state = State::kCold;
      victim->wanted = false;  // a prefetch evicted before its use ends there (as Evict)
      ++counters.evictions;
      cv.SignalAll();
    }
  }

  // Starts making a cold `t` resident (without pinning it). Making room may release mu:
  // if another thread took the tensor meanwhile, the block goes back and the caller
  // looks at the tensor's state again.
  absl::Status LoadLocked(Tensor& t, bool prefetch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, AllocateLocked(t, prefetch));
    if (t.state != State::kCold) return absl::OkStatus();
    t.block = std::move(block);
    t.state = State::kLoading;
    const auto start = Clock::now();
    mu.Unlock();
    absl::Status s;
    if (t.stored) {
      auto n = volume->Get(t.spec.name, {t.block.data(), t.block.capacity()});
      s = n.status();
    } else {
      std::memset(t.block.data(), 0, t.spec.bytes);  // never written: zeros
    }
    mu.Lock();
    if (!s.ok()) {
      t.block.Reset();
      t.state = State::kCold;
      cv.SignalAll();
      return s;
    }
    if (t.stored) {
      counters.bytes_read += t.spec.bytes;
      counters.read_seconds += Since(start);
    }
    t.state = State::kResident;
    t.last_use = ++tick;
    cv.SignalAll();
    return absl::OkStatus();
  }

  // Makes `t` resident in host memory without pinning it (no counters); for a prefetch,
  // only if that evicts nothing wanted (AllocateLocked).
  absl::Status MakeResidentLocked(Tensor& t, bool* loaded_here, bool prefetch = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (;;) {
      if (t.state == State::kResident) break;
      if (t.state == State::kCold) {
        if (loaded_here != nullptr) *loaded_here = true;
        MEMASCEND_RETURN_IF_ERROR(LoadLocked(t, prefetch));
        continue;
      }
      cv.Wait(&mu);  // loading (a prefetch) or being written back
    }
    return absl::OkStatus();
  }

  // Makes `t` resident and pins it (Acquire's loop, without counters): a use.
  absl::Status HostResidentLocked(Tensor& t, bool* loaded_here) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    t.wanted = false;
    MEMASCEND_RETURN_IF_ERROR(MakeResidentLocked(t, loaded_here));
    ++t.pins;
    return absl::OkStatus();
  }

  absl::Status GpuUsableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (device_pool != nullptr) return absl::OkStatus();
    if (options.gpu_budget_bytes == 0) {
      return absl::FailedPreconditionError(
          "tensor store: the GPU tier is off (TensorStoreOptions::gpu_budget_bytes is 0)");
    }
    if (prim::CudaDeviceCount() <= options.gpu_device) {
      return absl::FailedPreconditionError(
          fmt::format("tensor store: no CUDA device {} for the GPU tier ({} found)",
                      options.gpu_device, prim::CudaDeviceCount()));
    }
    MEMASCEND_ASSIGN_OR_RETURN(
        prim::DeviceAllocation slab,
        prim::DeviceAllocation::Allocate(
            options.gpu_device,
            options.gpu_budget_bytes / store::kDeviceBlockBytes * store::kDeviceBlockBytes));
    device_pool = std::make_unique<store::DevicePool>(std::move(slab), ledger);
    return absl::OkStatus();
  }

  // Copies a dirty device copy back into a host block (loaded or fresh), which becomes
  // dirty. The caller has set t.gpu_busy; mu is released during the copy.
  absl::Status GpuToHostLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!t.gpu_dirty) return absl::OkStatus();
    while (t.state == State::kLoading || t.state == State::kWriting) cv.Wait(&mu);
    if (t.state == State::kCold) {
      // Every byte is overwritten: a block, not a read.
      MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, AllocateLocked(t));
      while (t.state == State::kLoading || t.state == State::kWriting) cv.Wait(&mu);
      if (t.state == State::kCold) {
        t.block = std::move(block);
        t.state = State::kResident;
      }
    }
    ++t.pins;
    mu.Unlock();
    absl::Status s = prim::CopyAsync(t.block.data(), t.gpu, t.spec.bytes,
                                     prim::CopyDirection::kDeviceToHost, t.gpu_stream);
    if (s.ok()) s = prim::SynchronizeStream(t.gpu_stream);
    mu.Lock();
    --t.pins;
    t.last_use = ++tick;
    if (!s.ok()) return s;
    t.gpu_dirty = false;
    t.dirty = true;
    counters.bytes_from_gpu += t.spec.bytes;
    return absl::OkStatus();
  }

  // Waits until no thread copies `t` to or from the device, then claims that role.
  void ClaimGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (t.gpu_busy) cv.Wait(&mu);
    t.gpu_busy = true;
  }
  void UnclaimGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    t.gpu_busy = false;
    cv.SignalAll();
  }

  // GpuToHostLocked for an unclaimed `t`.
  absl::Status CopyBackLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ClaimGpuLocked(t);
    absl::Status s = GpuToHostLocked(t);
    UnclaimGpuLocked(t);
    return s;
  }

  // Evict(id, Tier::kGpu): kFailedPrecondition while leased on the device.
  absl::Status EvictGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ClaimGpuLocked(t);
    absl::Status s = t.gpu_pins > 0 ? absl::FailedPreconditionError(fmt::format(
                                          "tensor '{}' is leased on the GPU", t.spec.name))
                                    : DropGpuLocked(t);
    UnclaimGpuLocked(t);
    return s;
  }

  // Gives the device block back to the pool; the device copy is gone.
  absl::Status FreeGpuBlockLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_RETURN_IF_ERROR(device_pool->Free(t.gpu));
    t.gpu = nullptr;
    t.gpu_valid = t.gpu_dirty = false;
    t.gpu_ready.reset();
    return absl::OkStatus();
  }

  // Frees the device block of an unleased `t` (claimed by the caller), copying it back
  // first if dirty and waiting for the work queued on it.
  absl::Status DropGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (t.gpu == nullptr) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(GpuToHostLocked(t));
    if (t.gpu_pins > 0 || t.gpu == nullptr) return absl::OkStatus();  // leased meanwhile
    std::shared_ptr<prim::CudaEvent> idle = std::move(t.gpu_idle);
    if (idle != nullptr && !idle->Ready()) {
      mu.Unlock();
      while (!idle->Ready()) std::this_thread::yield();
      mu.Lock();
      if (t.gpu_pins > 0) return absl::OkStatus();
    }
    MEMASCEND_RETURN_IF_ERROR(FreeGpuBlockLocked(t));
    ++counters.gpu_evictions;
    return absl::OkStatus();
  }

  // A device block for `t`, evicting unleased device copies, least recently used first.
  absl::Status AllocateGpuLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (;;) {
      auto block = device_pool->Allocate(t.spec.bytes, t.spec.use);
      if (block.ok()) {
        t.gpu = *block;
        t.gpu_valid = false;
        return absl::OkStatus();
      }
      if (block.status().code() != absl::StatusCode::kResourceExhausted) return block.status();
      Tensor* victim = nullptr;
      for (const auto& v : tensors) {
        if (v.get() != &t && v->gpu != nullptr && v->gpu_pins == 0 && !v->gpu_busy &&
            (victim == nullptr || v->gpu_last_use < victim->gpu_last_use)) {
          victim = v.get();
        }
      }
      if (victim == nullptr) {
        return absl::ResourceExhaustedError(fmt::format(
            "tensor '{}' needs {} on the GPU but the GPU budget of {} is held by leased "
            "tensors ({} short)",
            t.spec.name, util::FormatBytes(t.spec.bytes),
            util::FormatBytes(options.gpu_budget_bytes),
            util::FormatBytes(
                t.spec.bytes -
                std::min(t.spec.bytes, device_pool->capacity() - device_pool->allocated()))));
      }
      victim->gpu_busy = true;
      absl::Status s = DropGpuLocked(*victim);
      UnclaimGpuLocked(*victim);
      MEMASCEND_RETURN_IF_ERROR(s);
    }
  }

  // Makes the device copy of `t` current, queued on `stream`; pins it if `pin`.
  absl::Status GpuResidentLocked(Tensor& t, CudaStreamView stream, bool pin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_RETURN_IF_ERROR(GpuUsableLocked());
    ClaimGpuLocked(t);
    absl::Status s = GpuResidentClaimedLocked(t, stream);
    if (s.ok()) {
      t.gpu_last_use = ++tick;
      if (pin) ++t.gpu_pins;
    }
    UnclaimGpuLocked(t);
    return s;
  }

  absl::Status GpuResidentClaimedLocked(Tensor& t, CudaStreamView stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (t.gpu != nullptr && t.gpu_valid) {
      // Resident: the caller's stream waits for the copy in (a no-op on its own stream).
      if (t.gpu_ready != nullptr) return t.gpu_ready->MakeStreamWait(stream);
      return absl::OkStatus();
    }
    if (t.gpu == nullptr) MEMASCEND_RETURN_IF_ERROR(AllocateGpuLocked(t));
    MEMASCEND_RETURN_IF_ERROR(HostResidentLocked(t, nullptr));
    mu.Unlock();
    absl::Status s;
    auto event = prim::CudaEvent::Create();
    s = event.status();
    // The block may still be read by the last lease's work (a stale copy), and the
    // host block by an earlier copy out: both precede this copy on `stream`.
    if (s.ok() && t.gpu_idle != nullptr) s = t.gpu_idle->MakeStreamWait(stream);
    if (s.ok() && t.gpu_ready != nullptr) s = t.gpu_ready->MakeStreamWait(stream);
    if (s.ok()) {
      s = prim::CopyAsync(t.gpu, t.block.data(), t.spec.bytes, prim::CopyDirection::kHostToDevice,
                          stream);
    }
    if (s.ok()) s = event->Record(stream);
    mu.Lock();
    --t.pins;
    cv.SignalAll();
    if (!s.ok()) return s;
    auto ready = std::make_shared<prim::CudaEvent>(*std::move(event));
    t.gpu_ready = ready;
    t.gpu_stream = stream;
    t.gpu_valid = true;
    t.gpu_dirty = false;
    counters.bytes_to_gpu += t.spec.bytes;
    // Note [reuse fences]: the host block goes back to the pool only after the copy.
    t.block.SetReuseFence(prim::EventFence(std::move(ready)));
    return absl::OkStatus();
  }

  // Room may have appeared: the deferred prefetches go back to the head of the queue.
  void RetryDeferredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!deferred.empty()) {
      jobs.push_front(std::move(deferred.back()));
      deferred.pop_back();
    }
  }

  void Work() {
    for (;;) {
      Job job;
      absl::Status s;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Impl* m)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->mu) { return m->stop || !m->jobs.empty(); },
            this));
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
        Tensor& t = *tensors[job.id];
        if (job.ticket == nullptr) {  // Note [write-behind]
          while (t.state == State::kLoading || t.state == State::kWriting) cv.Wait(&mu);
          if (t.pins == 0 && t.dirty) (void)WriteBackLocked(t);  // a failure stays dirty
          continue;
        }
        if (job.tier == Tier::kGpu) {
          s = GpuResidentLocked(t, job.stream, /*pin=*/false);
        } else if (t.wanted) {  // else used, discarded or evicted since: nothing to do
          s = MakeResidentLocked(t, nullptr, /*prefetch=*/true);
          if (s.code() == absl::StatusCode::kResourceExhausted && t.state == State::kCold &&
              t.wanted) {
            if (options.defer_prefetches) {
              // No room but wanted tensors': wait for some (or for a use, which loads it).
              ++counters.prefetch_deferred;
              deferred.push_back(std::move(job));
              continue;
            }
            t.wanted = false;
            ++counters.prefetch_dropped;
          }
        }
      }
      job.ticket->Finish(std::move(s));
    }
  }
};

TensorStore::TensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TensorStore::~TensorStore() {
  if (!impl_->closed) {
    const absl::Status s = Close();
    if (!s.ok()) {
      std::fprintf(stderr,
                   "memascend: a tensor store was destroyed with dirty durable tensors it could "
                   "not write back (call TensorStore::Close() to see this as a status): %s\n",
                   std::string(s.message()).c_str());
    }
  }
}

absl::Status TensorStore::Close() {
  if (impl_->closed) return impl_->close_status;
  impl_->close_status = Flush();
  impl_->closed = true;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stop = true;
    impl_->RetryDeferredLocked();
    for (Impl::Job& job : impl_->jobs)
      if (job.ticket != nullptr) job.ticket->Finish(absl::CancelledError("the store is closing"));
    impl_->jobs.clear();
  }
  for (std::thread& w : impl_->workers) w.join();
  absl::MutexLock lock(&impl_->mu);
  impl_->tensors.clear();  // blocks back to the pools before they go
  impl_->pool.reset();
  impl_->device_pool.reset();
  return impl_->close_status;
}

absl::StatusOr<std::unique_ptr<TensorStore>> TensorStore::Open(Volume* volume,
                                                               const TensorStoreOptions& options) {
  if (volume == nullptr) return absl::InvalidArgumentError("tensor store: volume is null");
  if (options.host_budget_bytes == 0)
    return absl::InvalidArgumentError("tensor store: host_budget_bytes is 0");
  auto impl = std::make_unique<Impl>();
  impl->volume = volume;
  impl->options = options;
  if (options.ledger == nullptr) {
    impl->own_ledger = std::make_unique<MemoryLedger>();
    impl->ledger = impl->own_ledger.get();
  } else {
    impl->ledger = options.ledger;
  }
  HostArenaOptions ao;
  ao.budget_bytes = options.host_budget_bytes;
  ao.backing = options.host_backing;
  // Note [store regions]: the budget is used for the whole run, so the arena maps it in
  // few large regions: evicted blocks coalesce inside them and serve other sizes without
  // unmapping and re-locking memory, and a tight budget does not fragment across many
  // small regions (a block needs one free extent inside one region). Up to 256 MiB the
  // budget is one region; beyond, regions of 256 MiB or an eighth of the budget.
  const std::size_t budget = options.host_budget_bytes / 4096 * 4096;
  ao.chunk_bytes =
      budget <= (256u << 20) ? budget : std::max<std::size_t>(256u << 20, budget / 8) / 4096 * 4096;
  ao.ledger = impl->ledger;
  MEMASCEND_ASSIGN_OR_RETURN(impl->arena, HostArena::Create(ao));
  Impl* m = impl.get();
  for (int i = 0; i < std::max(options.prefetch_threads, 1); ++i)
    m->workers.emplace_back([m] { m->Work(); });
  return std::unique_ptr<TensorStore>(new TensorStore(std::move(impl)));
}

absl::StatusOr<TensorId> TensorStore::Register(const TensorSpec& spec) {
  Impl& m = *impl_;
  if (spec.bytes == 0)
    return absl::InvalidArgumentError(fmt::format("tensor '{}' has 0 bytes", spec.name));
  if (spec.name.empty() || spec.name.size() > 255) {
    return absl::InvalidArgumentError("tensor names are 1..255 bytes");
  }
  if (spec.bytes > m.options.host_budget_bytes) {
    return absl::ResourceExhaustedError(
        fmt::format("tensor '{}' needs {}, more than the host budget of {}", spec.name,
                    util::FormatBytes(spec.bytes), util::FormatBytes(m.options.host_budget_bytes)));
  }
  {
    absl::MutexLock lock(&m.mu);
    if (m.names.contains(spec.name)) {
      return absl::AlreadyExistsError(fmt::format("tensor '{}' is registered already", spec.name));
    }
  }
  auto stored = m.volume->Stat(spec.name);
  const bool durable_copy = stored.ok() && stored->durability == Durability::kDurable &&
                            spec.durability == Durability::kDurable;
  if (durable_copy && stored->size != spec.bytes) {
    return absl::FailedPreconditionError(
        fmt::format("tensor '{}': the volume holds {} bytes, {} registered", spec.name,
                    stored->size, spec.bytes));
  }
  absl::MutexLock lock(&m.mu);
  if (m.names.contains(spec.name)) {
    return absl::AlreadyExistsError(fmt::format("tensor '{}' is registered already", spec.name));
  }
  auto t = std::make_unique<Impl::Tensor>();
  t->spec = spec;
  t->stored = durable_copy;
  const auto id = static_cast<TensorId>(m.tensors.size());
  m.tensors.push_back(std::move(t));
  m.names.emplace(spec.name, id);
  return id;
}

absl::StatusOr<TensorId> TensorStore::Find(std::string_view name) const {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->names.find(name);
  if (it == impl_->names.end()) return absl::NotFoundError(fmt::format("no tensor '{}'", name));
  return it->second;
}

absl::StatusOr<TensorSpec> TensorStore::Spec(TensorId id) const {
  absl::MutexLock lock(&impl_->mu);
  MEMASCEND_RETURN_IF_ERROR(impl_->CheckId(id));
  return impl_->tensors[id]->spec;
}

std::vector<std::string> TensorStore::StoredTensors() const {
  std::vector<std::string> out;
  for (const ObjectInfo& o : impl_->volume->List()) {
    if (o.durability == Durability::kDurable) out.push_back(o.name);
  }
  return out;
}

absl::StatusOr<TensorLease> TensorStore::Acquire(TensorId id) {
  return Acquire(id, Tier::kPinnedHost);
}

absl::StatusOr<TensorLease> TensorStore::AcquireForWrite(TensorId id, Tier tier,
                                                         CudaStreamView stream) {
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, Acquire(id, tier, stream));
  lease.MarkDirty();
  return lease;
}

absl::StatusOr<TensorLease> TensorStore::Acquire(TensorId id, Tier tier, CudaStreamView stream) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  if (tier == Tier::kGpu) {
    t.wanted = false;
    const bool hit = t.gpu != nullptr && t.gpu_valid;
    MEMASCEND_RETURN_IF_ERROR(m.GpuResidentLocked(t, stream, /*pin=*/true));
    (hit ? m.counters.prefetch_hits : m.counters.prefetch_misses)++;
    m.counters.stall_seconds += Since(start);
    return TensorLease(this, id, t.gpu, t.spec.bytes, Tier::kGpu, stream);
  }
  if (tier != Tier::kPinnedHost) {
    return absl::InvalidArgumentError(
        fmt::format("tensor store: Acquire in tier {} (host or GPU only)", ToString(tier)));
  }
  bool loaded_here = false;
  MEMASCEND_RETURN_IF_ERROR(m.HostResidentLocked(t, &loaded_here));
  if (t.gpu != nullptr) {
    // A dirty device copy is the newest (Note [gpu tier]).
    if (absl::Status s = m.CopyBackLocked(t); !s.ok()) {
      --t.pins;
      m.cv.SignalAll();
      return s;
    }
  }
  t.last_use = ++m.tick;
  (loaded_here ? m.counters.prefetch_misses : m.counters.prefetch_hits)++;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.block.data(), t.spec.bytes, Tier::kPinnedHost, stream);
}

absl::StatusOr<TensorLease> TensorStore::AcquireForOverwrite(TensorId id) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  t.wanted = false;
  while (t.gpu_busy) m.cv.Wait(&m.mu);
  for (;;) {
    if (t.state == Impl::State::kResident) break;
    if (t.state == Impl::State::kCold) {
      MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, m.AllocateLocked(t));
      if (t.state == Impl::State::kCold) {  // nobody loaded it while room was made
        t.block = std::move(block);
        t.state = Impl::State::kResident;
        ++m.counters.overwrites;
      }
      continue;
    }
    m.cv.Wait(&m.mu);  // loading or being written back
  }
  ++t.pins;
  t.dirty = true;
  t.gpu_valid = false;
  t.gpu_dirty = false;
  t.last_use = ++m.tick;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.block.data(), t.spec.bytes, Tier::kPinnedHost, {});
}

absl::StatusOr<TensorLease> TensorStore::AcquireCopy(TensorId from, TensorId to) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(from));
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(to));
  Impl::Tensor& src = *m.tensors[from];
  Impl::Tensor& dst = *m.tensors[to];
  if (from == to || src.spec.bytes != dst.spec.bytes) {
    return absl::InvalidArgumentError(fmt::format("AcquireCopy '{}' -> '{}': {}", src.spec.name,
                                                  dst.spec.name,
                                                  from == to ? "the same tensor" : "sizes differ"));
  }
  const auto settled = [](const Impl::Tensor& t) {
    return !t.gpu_busy && t.state != Impl::State::kLoading && t.state != Impl::State::kWriting;
  };
  src.wanted = false;
  dst.wanted = false;
  for (;;) {
    while (!settled(src) || !settled(dst)) m.cv.Wait(&m.mu);
    if (dst.pins > 0 || dst.gpu_pins > 0) {
      return absl::FailedPreconditionError(
          fmt::format("AcquireCopy: tensor '{}' is leased", dst.spec.name));
    }
    if (src.gpu != nullptr && src.gpu_dirty) {  // the device holds the newest bytes
      MEMASCEND_RETURN_IF_ERROR(m.CopyBackLocked(src));
      continue;
    }
    if (src.state == Impl::State::kResident && src.pins == 0 && !src.dirty &&
        dst.state == Impl::State::kCold) {
      // Hand the clean block over: the volume keeps the source's bytes.
      dst.block = std::move(src.block);
      src.state = Impl::State::kCold;
      dst.state = Impl::State::kResident;
      ++m.counters.handovers;
      ++m.counters.prefetch_hits;
      break;
    }
    if (dst.state == Impl::State::kCold) {
      MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, m.AllocateLocked(dst));
      if (dst.state != Impl::State::kCold || !settled(src)) continue;  // changed meanwhile
      dst.block = std::move(block);
      dst.state = Impl::State::kResident;
    }
    if (src.state == Impl::State::kResident) {
      std::memcpy(dst.block.data(), src.block.data(), dst.spec.bytes);
      ++m.counters.prefetch_hits;
      break;
    }
    // The source is cold: read it from the volume into the destination's block.
    dst.state = Impl::State::kLoading;
    ++src.pins;  // keeps its state still while mu is released
    const auto read_start = Clock::now();
    m.mu.Unlock();
    absl::Status s;
    if (src.stored) {
      s = m.volume->Get(src.spec.name, {dst.block.data(), dst.block.capacity()}).status();
    } else {
      std::memset(dst.block.data(), 0, dst.spec.bytes);
    }
    m.mu.Lock();
    --src.pins;
    dst.state = Impl::State::kResident;
    m.cv.SignalAll();
    MEMASCEND_RETURN_IF_ERROR(s);
    ++m.counters.prefetch_misses;
    if (src.stored) {
      m.counters.bytes_read += src.spec.bytes;
      m.counters.read_seconds += Since(read_start);
    }
    break;
  }
  ++dst.pins;
  dst.dirty = true;
  dst.gpu_valid = false;
  dst.gpu_dirty = false;
  dst.last_use = ++m.tick;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, to, dst.block.data(), dst.spec.bytes, Tier::kPinnedHost, {});
}

PrefetchTicket TensorStore::Prefetch(TensorId id) { return Prefetch(id, Tier::kPinnedHost); }

PrefetchTicket TensorStore::Prefetch(TensorId id, Tier tier, CudaStreamView stream) {
  auto state = std::make_shared<PrefetchTicket::State>();
  absl::MutexLock lock(&impl_->mu);
  if (absl::Status s = impl_->CheckId(id); !s.ok()) {
    state->Finish(s);
  } else if (tier != Tier::kPinnedHost && tier != Tier::kGpu) {
    state->Finish(absl::InvalidArgumentError(
        fmt::format("tensor store: Prefetch to tier {} (host or GPU only)", ToString(tier))));
  } else if (tier == Tier::kGpu) {
    if (absl::Status usable = impl_->GpuUsableLocked(); !usable.ok()) {
      state->Finish(usable);
    } else {
      impl_->jobs.push_back({id, tier, stream, state});
    }
  } else {
    Impl::Tensor& t = *impl_->tensors[id];
    t.wanted = true;
    if (t.state != Impl::State::kCold) {
      state->Finish(absl::OkStatus());
    } else {
      impl_->jobs.push_back({id, tier, stream, state});
    }
  }
  return PrefetchTicket(state);
}

absl::Status TensorStore::WriteBack(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  if (t.gpu != nullptr) MEMASCEND_RETURN_IF_ERROR(m.CopyBackLocked(t));
  while (t.state == Impl::State::kLoading || t.state == Impl::State::kWriting) m.cv.Wait(&m.mu);
  return m.WriteBackLocked(t);
}

absl::Status TensorStore::Evict(TensorId id, Tier tier) {
  if (tier == Tier::kPinnedHost) return Evict(id);
  if (tier != Tier::kGpu) {
    return absl::InvalidArgumentError(
        fmt::format("tensor store: Evict from tier {} (host or GPU only)", ToString(tier)));
  }
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  return m.EvictGpuLocked(*m.tensors[id]);
}

absl::Status TensorStore::Evict(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  if (t.gpu != nullptr) MEMASCEND_RETURN_IF_ERROR(m.EvictGpuLocked(t));
  t.wanted = false;
  for (;;) {
    while (t.state == Impl::State::kLoading || t.state == Impl::State::kWriting) m.cv.Wait(&m.mu);
    if (t.pins > 0)
      return absl::FailedPreconditionError(fmt::format("tensor '{}' is leased", t.spec.name));
    if (t.state == Impl::State::kCold) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(m.WriteBackLocked(t));
    if (t.state == Impl::State::kResident && t.pins == 0 && !t.dirty) break;
  }
  t.block.Reset();
  t.state = Impl::State::kCold;
  ++m.counters.evictions;
  m.RetryDeferredLocked();
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TensorStore::Discard(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  while (t.gpu_busy || t.state == Impl::State::kLoading || t.state == Impl::State::kWriting)
    m.cv.Wait(&m.mu);
  if (t.pins > 0 || t.gpu_pins > 0)
    return absl::FailedPreconditionError(fmt::format("tensor '{}' is leased", t.spec.name));
  t.wanted = false;
  if (t.gpu != nullptr) {
    std::shared_ptr<prim::CudaEvent> idle = std::move(t.gpu_idle);
    while (idle != nullptr && !idle->Ready()) std::this_thread::yield();
    MEMASCEND_RETURN_IF_ERROR(m.FreeGpuBlockLocked(t));
  }
  if (t.state == Impl::State::kResident) {
    t.block.Reset();
    t.state = Impl::State::kCold;
  }
  t.dirty = false;
  ++m.counters.discards;
  m.RetryDeferredLocked();
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TensorStore::SetRetention(TensorId id, Retention retention) {
  absl::MutexLock lock(&impl_->mu);
  MEMASCEND_RETURN_IF_ERROR(impl_->CheckId(id));
  impl_->tensors[id]->retention = retention;
  return absl::OkStatus();
}

absl::Status TensorStore::Flush() {
  // Durable tensors only: a scratch tensor's bytes are not committed and survive no
  // crash, so writing them here would cost I/O for nothing, and could race with a
  // holder still writing them (a Flush on another thread).
  std::vector<TensorId> durable;
  {
    absl::MutexLock lock(&impl_->mu);
    for (TensorId id = 0; id < impl_->tensors.size(); ++id) {
      if (impl_->tensors[id]->spec.durability == Durability::kDurable) durable.push_back(id);
    }
  }
  absl::Status first;
  for (TensorId id : durable) first.Update(WriteBack(id));
  if (first.ok()) first = impl_->volume->Sync();  // one commit for everything written back
  return first;
}

TensorStoreStats TensorStore::stats() const {
  absl::MutexLock lock(&impl_->mu);
  TensorStoreStats s = impl_->counters;
  s.tensors = impl_->tensors.size();
  for (const auto& t : impl_->tensors) {
    if (t->state != Impl::State::kCold) {
      ++s.resident;
      s.resident_bytes += t->spec.bytes;
    }
    if (t->gpu != nullptr) {
      ++s.gpu_resident;
      s.gpu_resident_bytes += t->spec.bytes;
    }
  }
  s.ledger = impl_->ledger->Snapshot();
  return s;
}

void TensorStore::Unpin(TensorId id, Tier tier, CudaStreamView stream) noexcept {
  absl::MutexLock lock(&impl_->mu);
  Impl::Tensor& t = *impl_->tensors[id];
  if (tier == Tier::kGpu) {
    // The block is reused only after the work the lease's holder queued on its stream.
    auto idle = prim::CudaEvent::Create();
    if (idle.ok() && idle->Record(stream).ok()) {
      t.gpu_idle = std::make_shared<prim::CudaEvent>(*std::move(idle));
    } else {
      (void)prim::SynchronizeStream(stream);  // no event: wait for the work here instead
      t.gpu_idle.reset();
    }
    --t.gpu_pins;
    t.gpu_last_use = ++impl_->tick;
  } else {
    --t.pins;
    t.last_use = ++impl_->tick;
    if (t.pins == 0) impl_->RetryDeferredLocked();  // an evictable tensor, maybe
    if (impl_->options.write_behind && t.pins == 0 && t.dirty && t.gpu == nullptr &&
        t.spec.durability == Durability::kDurable && t.state == Impl::State::kResident) {
      impl_->jobs.push_back({id, Tier::kPinnedHost, {}, nullptr});
    }
  }
  impl_->cv.SignalAll();
}

void TensorStore::Dirty(TensorId id, Tier tier) noexcept {
  absl::MutexLock lock(&impl_->mu);
  Impl::Tensor& t = *impl_->tensors[id];
  if (tier == Tier::kGpu) {
    t.gpu_dirty = true;
    return;
  }
  t.dirty = true;
  t.gpu_valid = false;  // the device copy is stale now: the next GPU acquire copies again
  t.gpu_dirty = false;
}

// ---- TensorLease ---------------------------------------------------------------------

TensorLease::TensorLease(TensorLease&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)),
      id_(o.id_),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      tier_(o.tier_),
      stream_(o.stream_) {}

TensorLease& TensorLease::operator=(TensorLease&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = std::exchange(o.store_, nullptr);
    id_ = o.id_;
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    tier_ = o.tier_;
    stream_ = o.stream_;
  }
  return *this;
}

TensorLease::~TensorLease() { Release(); }

void TensorLease::MarkDirty() noexcept {
  if (store_ != nullptr) store_->Dirty(id_, tier_);
}

void TensorLease::Release() noexcept {
  if (store_ == nullptr) return;
  std::exchange(store_, nullptr)->Unpin(id_, tier_, stream_);
  data_ = nullptr;
  size_ = 0;
}

// ---- TensorStream --------------------------------------------------------------------

TensorStream::TensorStream(TensorStore* store, std::vector<TensorId> order, std::size_t window)
    : store_(store), order_(std::move(order)), window_(window) {}

void TensorStream::Fill() {
  if (prefetched_ < position_ + 1) prefetched_ = position_ + 1;  // the current one is acquired
  while (prefetched_ < order_.size() && prefetched_ <= position_ + window_) {
    (void)store_->Prefetch(order_[prefetched_++]);  // its completion is seen through Acquire
  }
}

absl::StatusOr<TensorLease> TensorStream::Next() {
  if (position_ >= order_.size()) return absl::OutOfRangeError("the stream is over");
  Fill();
  return store_->Acquire(order_[position_++]);
}

void TensorStream::Reverse() {
  std::reverse(order_.begin(), order_.end());
  Restart();
}

void TensorStream::Restart() {
  position_ = 0;
  prefetched_ = 0;
}

}  // namespace memascend
