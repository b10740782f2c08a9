// The tensor store's GPU tier (Note [gpu tier]) (store/tensor_store_impl.h).

#include <algorithm>
#include <memory>
#include <vector>

#include "store/tensor_store_impl.h"
#include "util/units.h"

namespace memascend {

using store::Clock;
using store::Since;

// Note [store locking]: the device query and the slab's cudaMalloc run with mu released;
// one thread makes the slab (gpu_starting), the others wait for it.
absl::Status TensorStore::Impl::GpuUsableLocked() {
  while (gpu_starting) cv.Wait(&mu);
  if (device_pool != nullptr) return absl::OkStatus();
  if (options.gpu_budget_bytes == 0) {
    return absl::FailedPreconditionError(
        "tensor store: the GPU tier is off (TensorStoreOptions::gpu_budget_bytes is 0)");
  }
  gpu_starting = true;
  mu.Unlock();
  absl::StatusOr<prim::DeviceAllocation> slab = absl::FailedPreconditionError("");
  const int devices = prim::CudaDeviceCount();
  if (devices <= options.gpu_device) {
    slab = absl::FailedPreconditionError(
        fmt::format("tensor store: no CUDA device {} for the GPU tier ({} found)",
                    options.gpu_device, devices));
  } else {
    slab = prim::DeviceAllocation::Allocate(
        options.gpu_device,
        options.gpu_budget_bytes / store::kDeviceBlockBytes * store::kDeviceBlockBytes);
  }
  mu.Lock();
  gpu_starting = false;
  cv.SignalAll();
  if (!slab.ok()) return slab.status();
  device_pool = std::make_unique<store::DevicePool>(*std::move(slab), ledger);
  return absl::OkStatus();
}

// Copies a dirty device copy back into a host block (loaded or fresh), which becomes
// dirty. The caller has set t.gpu_busy; mu is released during the copy.
absl::Status TensorStore::Impl::GpuToHostLocked(Tensor& t) {
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
  // The work of the leases that dirtied the block ends first, on whatever stream they
  // queued it (Note [gpu tier]); with nothing left queued on the block, the copy goes on
  // the legacy default stream (no stream of a past call, which may be gone by now). That
  // stream also waits for the device's blocking streams: a copy back is a synchronous,
  // rare step (an eviction of a dirty device copy, a flush), not the hot path.
  WaitGpuWorkLocked(t);
  mu.Unlock();
  absl::Status s;
  {
    const prim::DeviceGuard on(options.gpu_device);  // its legacy stream: Note [current device]
    s = on.status();
    if (s.ok()) {
      s = prim::CopyAsync(t.block.data(), t.gpu, t.spec.bytes, prim::CopyDirection::kDeviceToHost,
                          CudaStreamView{});
    }
    if (s.ok()) s = prim::SynchronizeStream(CudaStreamView{});
  }
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
void TensorStore::Impl::ClaimGpuLocked(Tensor& t) {
  while (t.gpu_busy) cv.Wait(&mu);
  t.gpu_busy = true;
}

void TensorStore::Impl::UnclaimGpuLocked(Tensor& t) {
  t.gpu_busy = false;
  cv.SignalAll();
}

// GpuToHostLocked for an unclaimed `t`.
absl::Status TensorStore::Impl::CopyBackLocked(Tensor& t) {
  ClaimGpuLocked(t);
  absl::Status s = GpuToHostLocked(t);
  UnclaimGpuLocked(t);
  return s;
}

// Evict(id, Tier::kGpu): kFailedPrecondition while leased on the device.
absl::Status TensorStore::Impl::EvictGpuLocked(Tensor& t) {
  ClaimGpuLocked(t);
  absl::Status s = t.gpu_pins > 0 ? absl::FailedPreconditionError(fmt::format(
                                        "tensor '{}' is leased on the GPU", t.spec.name))
                                  : DropGpuLocked(t);
  UnclaimGpuLocked(t);
  return s;
}

// Gives the device block back to the pool; the device copy is gone. Its copy's event goes
// to `ready`, for the caller to let go of without mu (Note [store locking]: destroying the
// last reference is a cudaEventDestroy).
absl::Status TensorStore::Impl::FreeGpuBlockLocked(Tensor& t,
                                                   std::shared_ptr<prim::CudaEvent>* ready) {
  MEMASCEND_RETURN_IF_ERROR(device_pool->Free(t.gpu));
  t.gpu = nullptr;
  t.gpu_valid = t.gpu_dirty = false;
  *ready = std::move(t.gpu_ready);
  return absl::OkStatus();
}

void TensorStore::Impl::ForgetGpuUsesLocked(
    Tensor& t, const std::vector<std::shared_ptr<prim::CudaEvent>>& done) {
  std::erase_if(t.gpu_uses, [&](const std::shared_ptr<prim::CudaEvent>& e) {
    return std::find(done.begin(), done.end(), e) != done.end();
  });
}

void TensorStore::Impl::WaitGpuWorkLocked(Tensor& t) {
  std::vector<std::shared_ptr<prim::CudaEvent>> events = t.GpuEvents();
  if (events.empty()) return;
  // Note [store locking]: the waits (asleep: Note [blocking events]) and the events'
  // destruction without mu.
  mu.Unlock();
  for (const auto& e : events) (void)e->Synchronize();
  mu.Lock();
  // Done: forgotten, but for leases released meanwhile (their events are not among these).
  ForgetGpuUsesLocked(t, events);
  mu.Unlock();
  events.clear();
  mu.Lock();
}

bool TensorStore::Impl::WaitCopyFromHostLocked(Tensor& t) {
  if (t.gpu_ready == nullptr || t.gpu_ready->Ready()) return false;
  std::shared_ptr<prim::CudaEvent> ready = t.gpu_ready;
  ++t.pins;  // its block stays meanwhile
  mu.Unlock();
  // A failed copy's error is the stream's, reported to whoever waits on the device copy;
  // here only its end matters: the block is no longer read.
  (void)ready->Synchronize();
  ready.reset();
  mu.Lock();
  --t.pins;
  cv.SignalAll();
  return true;
}

// Frees the device block of an unleased `t` (claimed by the caller), copying it back
// first if dirty and waiting for the work queued on it: the copy in (a prefetch never
// leased may still be copying) and every released lease's.
absl::Status TensorStore::Impl::DropGpuLocked(Tensor& t) {
  if (t.gpu == nullptr) return absl::OkStatus();
  MEMASCEND_RETURN_IF_ERROR(GpuToHostLocked(t));
  if (t.gpu_pins > 0 || t.gpu == nullptr) return absl::OkStatus();  // leased meanwhile
  WaitGpuWorkLocked(t);
  if (t.gpu_pins > 0 || t.gpu == nullptr) return absl::OkStatus();
  std::shared_ptr<prim::CudaEvent> ready;
  MEMASCEND_RETURN_IF_ERROR(FreeGpuBlockLocked(t, &ready));
  ++counters.gpu_evictions;
  if (ready != nullptr) {  // claimed by the caller: nothing of `t` changes meanwhile
    mu.Unlock();
    ready.reset();
    mu.Lock();
  }
  return absl::OkStatus();
}

// A device block for `t`, evicting unleased device copies, least recently used first.
absl::Status TensorStore::Impl::AllocateGpuLocked(Tensor& t) {
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
          t.spec.name, util::FormatBytes(t.spec.bytes), util::FormatBytes(options.gpu_budget_bytes),
          util::FormatBytes(t.spec.bytes - std::min(t.spec.bytes, device_pool->capacity() -
                                                                      device_pool->allocated()))));
    }
    victim->gpu_busy = true;
    absl::Status s = DropGpuLocked(*victim);
    UnclaimGpuLocked(*victim);
    MEMASCEND_RETURN_IF_ERROR(s);
  }
}

// Makes the device copy of `t` current, queued on `stream`; pins it if `pin`.
absl::Status TensorStore::Impl::GpuResidentLocked(Tensor& t, CudaStreamView stream, bool pin) {
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

absl::Status TensorStore::Impl::GpuResidentClaimedLocked(Tensor& t, CudaStreamView stream) {
  if (t.gpu != nullptr && t.gpu_valid) {
    // Resident: the caller's stream waits for the copy in and for the work of the leases
    // released before (a lease's writes this one reads, or its reads before this one's
    // writes), each a no-op on its own stream; the completed ones are forgotten.
    std::vector<std::shared_ptr<prim::CudaEvent>> events = t.GpuEvents();
    if (events.empty()) return absl::OkStatus();
    mu.Unlock();
    absl::Status s;
    std::vector<std::shared_ptr<prim::CudaEvent>> done;
    {
      const prim::DeviceGuard on(options.gpu_device);  // stream 0: the device's own
      s = on.status();
      for (const auto& e : events) {
        if (e->Ready()) {
          done.push_back(e);
        } else if (s.ok()) {
          s = e->MakeStreamWait(stream);
        }
      }
    }
    mu.Lock();
    ForgetGpuUsesLocked(t, done);
    mu.Unlock();  // the events' destruction without mu (Note [store locking])
    events.clear();
    done.clear();
    mu.Lock();
    return s;
  }
  if (t.gpu == nullptr) MEMASCEND_RETURN_IF_ERROR(AllocateGpuLocked(t));
  MEMASCEND_RETURN_IF_ERROR(HostResidentLocked(t, nullptr));
  // The block may still be read by earlier leases' work (a stale copy), and the host
  // block by an earlier copy out: all precede this copy on `stream`. Taken under mu.
  std::vector<std::shared_ptr<prim::CudaEvent>> before = t.GpuEvents();
  mu.Unlock();
  absl::StatusOr<prim::CudaEvent> event = absl::UnknownError("no event");
  absl::Status s;
  {
    // The event on the store's device, whichever thread copies: a prefetch worker's
    // current device is 0 (Note [current device]).
    const prim::DeviceGuard on(options.gpu_device);
    s = on.status();
    if (s.ok()) {
      event = prim::CudaEvent::Create();
      s = event.status();
    }
    for (const auto& e : before)
      if (s.ok()) s = e->MakeStreamWait(stream);
    bool queued = false;
    if (s.ok()) {
      s = prim::CopyAsync(t.gpu, t.block.data(), t.spec.bytes, prim::CopyDirection::kHostToDevice,
                          stream);
      queued = s.ok();
    }
    if (s.ok()) s = event->Record(stream);
    // A copy queued with no event after it: waited for here, before its blocks (the host
    // one unfenced, the device one invalid) can go to another tensor.
    if (!s.ok() && queued) (void)prim::SynchronizeStream(stream);
  }
  mu.Lock();
  --t.pins;
  cv.SignalAll();
  if (!s.ok()) return s;
  auto ready = std::make_shared<prim::CudaEvent>(*std::move(event));
  std::shared_ptr<prim::CudaEvent> old = std::exchange(t.gpu_ready, ready);
  // The new copy's event comes after every event it waited for: those are covered by it.
  ForgetGpuUsesLocked(t, before);
  t.gpu_valid = true;
  t.gpu_dirty = false;
  counters.bytes_to_gpu += t.spec.bytes;
  // Note [reuse fences]: the host block goes back to the pool only after the copy.
  t.block.SetReuseFence(prim::EventFence(std::move(ready)));
  if (old != nullptr || !before.empty()) {  // their cudaEventDestroy without mu (claimed)
    mu.Unlock();
    old.reset();
    before.clear();
    mu.Lock();
  }
  return absl::OkStatus();
}

}  // namespace memascend
