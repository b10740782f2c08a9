// prim/cuda_memory.h: device memory, events and copies: the CUDA runtime calls of the
// store's GPU tier. Built without CUDA, every call reports kFailedPrecondition.
//
// Thread-safety: the handles are not synchronised; the CUDA runtime itself is
// thread-safe, so distinct handles may be used from distinct threads.
// Lifetime: DeviceAllocation and CudaEvent own their resources (move-only).
#ifndef MEMASCEND_SRC_PRIM_CUDA_MEMORY_H_
#define MEMASCEND_SRC_PRIM_CUDA_MEMORY_H_

#include <cstddef>
#include <memory>

#include <absl/status/statusor.h>

#include <memascend/cuda.h>

namespace memascend::prim {

// Number of usable CUDA devices: 0 without CUDA, a driver or a device.
int CudaDeviceCount() noexcept;

// Makes `device` current for the calling thread.
absl::Status CudaSetDevice(int device);

// Note [current device]: CUDA's current device is the calling thread's (a new thread's is
// device 0), and events, the legacy default stream and allocations go to it. The SDK's
// work for a store or an engine on device d runs under a guard that makes d current and,
// at its end, the thread's previous device again: whichever thread does it (the caller's,
// or one of the SDK's own), and leaving the caller's current device as it was. On the
// SDK's own threads (prim::StartThread) the guard leaves its device current: since CUDA 12
// making a device current creates its primary context, so going back to a new thread's
// device 0 would put a context of some hundreds of MiB on device 0 in every process whose
// store is on another device (one process per GPU, each on its own).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) noexcept;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // The switch's outcome: the CUDA call under the guard reports the same otherwise.
  const absl::Status& status() const noexcept { return status_; }

 private:
  int previous_ = -1;  // the device to make current again; -1: none was switched
  absl::Status status_;
};

// One cudaMalloc allocation on a device.
class DeviceAllocation {
 public:
  DeviceAllocation() noexcept = default;
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation();

  // kResourceExhausted when the device is out of memory; kFailedPrecondition without CUDA.
  static absl::StatusOr<DeviceAllocation> Allocate(int device, std::size_t bytes);

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void Reset() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
};

// One CUDA event (timing disabled, unless made by CreateTiming), made with blocking
// synchronisation: a host waiting on it sleeps (Note [blocking events], cuda_memory.cpp).
class CudaEvent {
 public:
  CudaEvent() noexcept = default;
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent();

  static absl::StatusOr<CudaEvent> Create();
  // An event that records time too (cudaEventElapsedTime), at a small cost per record.
  static absl::StatusOr<CudaEvent> CreateTiming();
  // Seconds from `start` to this event, both recorded with timing and complete.
  absl::StatusOr<double> SecondsSince(const CudaEvent& start) const;
  absl::Status Record(CudaStreamView stream);
  // True once the work recorded before it has completed (also after a device error:
  // that error surfaces on the stream's synchronisation, not here).
  bool Ready() const noexcept;
  // Makes `stream` wait for the event without blocking the host.
  absl::Status MakeStreamWait(CudaStreamView stream) const;
  // Blocks the calling thread until the event has completed (cudaEventSynchronize on a
  // blocking-sync event: the thread sleeps, it does not poll); the error of the work
  // before it, if any.
  absl::Status Synchronize() const;

 private:
  void* event_ = nullptr;  // cudaEvent_t
};

// The one CUDA reuse fence (memascend/types.h): ready once `event` has completed. The
// event is shared, so the same copy may also be waited on by other streams.
std::unique_ptr<ReuseFence> EventFence(std::shared_ptr<CudaEvent> event);

enum class CopyDirection { kHostToDevice, kDeviceToHost };

// cudaMemcpyAsync on `stream`; the host side must be page-locked for the copy to be
// asynchronous.
absl::Status CopyAsync(void* dst, const void* src, std::size_t bytes, CopyDirection direction,
                       CudaStreamView stream);
// Blocks the calling thread until the work queued on `stream` so far has completed,
// sleeping on a blocking event (Note [blocking events]); the error of that work, if any.
absl::Status SynchronizeStream(CudaStreamView stream);

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_CUDA_MEMORY_H_
