// The tensor store's GPU tier (Note [gpu tier]) (store/tensor_store_impl.h).

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

// Gives the device block back to the pool; the device copy is gone.
absl::Status TensorStore::Impl::FreeGpuBlockLocked(Tensor& t) {
  MEMASCEND_RETURN_IF_ERROR(device_pool->Free(t.gpu));
  t.gpu = nullptr;
  t.gpu_valid = t.gpu_dirty = false;
  t.gpu_ready.reset();
  return absl::OkStatus();
}

// Frees the device block of an unleased `t` (claimed by the caller), copying it back
// first if dirty and waiting for the work queued on it.
absl::Status TensorStore::Impl::DropGpuLocked(Tensor& t) {
  if (t.gpu == nullptr) return absl::OkStatus();
  MEMASCEND_RETURN_IF_ERROR(GpuToHostLocked(t));
  if (t.gpu_pins > 0 || t.gpu == nullptr) return absl::OkStatus();  // leased meanwhile
  std::shared_ptr<prim::CudaEvent> idle = std::move(t.gpu_idle);
  if (idle != nullptr) {
    // Note [store locking]: event queries (and the event's destruction) without mu.
    mu.Unlock();
    // Asleep until that work is done (Note [blocking events]); its error, if any, is its
    // stream's holder's to see, as a query's would have been.
    (void)idle->Synchronize();
    idle.reset();
    mu.Lock();
    if (t.gpu_pins > 0) return absl::OkStatus();
  }
  MEMASCEND_RETURN_IF_ERROR(FreeGpuBlockLocked(t));
  ++counters.gpu_evictions;
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
    // Resident: the caller's stream waits for the copy in (a no-op on its own stream).
    // The tensor is claimed (gpu_busy), so its event stays while mu is released.
    if (t.gpu_ready == nullptr) return absl::OkStatus();
    std::shared_ptr<prim::CudaEvent> ready = t.gpu_ready;
    mu.Unlock();
    absl::Status s = ready->MakeStreamWait(stream);
    ready.reset();
    mu.Lock();
    return s;
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
  std::shared_ptr<prim::CudaEvent> old = std::exchange(t.gpu_ready, ready);
  t.gpu_stream = stream;
  t.gpu_valid = true;
  t.gpu_dirty = false;
  counters.bytes_to_gpu += t.spec.bytes;
  // Note [reuse fences]: the host block goes back to the pool only after the copy.
  t.block.SetReuseFence(prim::EventFence(std::move(ready)));
  if (old != nullptr) {  // its cudaEventDestroy without mu; the tensor is claimed
    mu.Unlock();
    old.reset();
    mu.Lock();
  }
  return absl::OkStatus();
}

}  // namespace memascend
