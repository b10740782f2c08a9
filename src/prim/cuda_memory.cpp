#include "prim/cuda_memory.h"

#include <utility>

#include <fmt/format.h>

#include "prim/cuda.h"
#include "prim/os.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend::prim {

namespace {
// Ready once the work recorded before its event has finished.
class CudaEventFence final : public ReuseFence {
 public:
  explicit CudaEventFence(std::shared_ptr<CudaEvent> event) : event_(std::move(event)) {}
  bool Ready() override { return event_->Ready(); }

 private:
  std::shared_ptr<CudaEvent> event_;
};
}  // namespace

std::unique_ptr<ReuseFence> EventFence(std::shared_ptr<CudaEvent> event) {
  return std::make_unique<CudaEventFence>(std::move(event));
}

#if MEMASCEND_HAVE_CUDA
namespace {

absl::Status CudaError(cudaError_t err, const char* call) {
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  const std::string message = fmt::format("{}: {}", call, cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevice ||
      err == cudaErrorInvalidDevicePointer || err == cudaErrorInvalidResourceHandle)
    return absl::InvalidArgumentError(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
    return absl::FailedPreconditionError(message);
  return absl::InternalError(message);
}

cudaStream_t Stream(CudaStreamView view) { return static_cast<cudaStream_t>(view.handle); }

}  // namespace

int CudaDeviceCount() noexcept {
  if (!CudaUsable()) return 0;
  NoteCudaUse();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::Status CudaSetDevice(int device) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
    return CudaError(err, "cudaSetDevice");
  return absl::OkStatus();
}

DeviceGuard::DeviceGuard(int device) noexcept {
  int current = 0;
  if (cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) {
    status_ = CudaError(err, "cudaGetDevice");
  } else if (current != device) {
    status_ = CudaSetDevice(device);
    if (status_.ok() && !IsOurThread()) previous_ = current;  // ours keep it
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

absl::StatusOr<DeviceAllocation> DeviceAllocation::Allocate(int device, std::size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("device allocation of 0 bytes");
  const DeviceGuard on(device);  // Note [current device]
  if (!on.status().ok()) return on.status();
  void* p = nullptr;
  if (cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
    return CudaError(err, "cudaMalloc");
  }
  DeviceAllocation a;
  a.data_ = static_cast<std::byte*>(p);
  a.size_ = bytes;
  a.device_ = device;
  return a;
}

void DeviceAllocation::Reset() noexcept {
  if (data_ == nullptr) return;
  {
    const DeviceGuard on(device_);  // Note [current device]
    cudaFree(data_);
  }
  data_ = nullptr;
  size_ = 0;
}

// Note [blocking events]: every event is made with cudaEventBlockingSync, so a host that
// waits on one (Synchronize) sleeps in the driver until the GPU signals it. Without the
// flag cudaEventSynchronize busy-waits: with one context on a machine of many CPUs the
// runtime's default schedule spins, and the GPU path's waits (a copy's device room, the
// gradients' intake, an eviction's last use) each held a CPU at 100% for as long as the
// GPU took (the fifth H200 lease measured the host's CPU time at twice the step's wall
// time). The price is the wake-up, tens of microseconds, against waits of milliseconds.
absl::StatusOr<CudaEvent> CudaEvent::Create() {
  cudaEvent_t e = nullptr;
  if (cudaError_t err =
          cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync);
      err != cudaSuccess)
    return CudaError(err, "cudaEventCreate");
  CudaEvent event;
  event.event_ = e;
  return event;
}

absl::StatusOr<CudaEvent> CudaEvent::CreateTiming() {
  cudaEvent_t e = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventBlockingSync); err != cudaSuccess)
    return CudaError(err, "cudaEventCreate");
  CudaEvent event;
  event.event_ = e;
  return event;
}

absl::StatusOr<double> CudaEvent::SecondsSince(const CudaEvent& start) const {
  float ms = 0;
  if (cudaError_t err = cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_),
                                             static_cast<cudaEvent_t>(event_));
      err != cudaSuccess)
    return CudaError(err, "cudaEventElapsedTime");
  return static_cast<double>(ms) / 1e3;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

absl::Status CudaEvent::Record(CudaStreamView stream) {
  if (event_ == nullptr) return absl::FailedPreconditionError("CudaEvent::Record on no event");
  if (cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(event_), Stream(stream));
      err != cudaSuccess)
    return CudaError(err, "cudaEventRecord");
  return absl::OkStatus();
}

bool CudaEvent::Ready() const noexcept {
  if (event_ == nullptr) return true;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (err == cudaErrorNotReady) return false;
  if (err != cudaSuccess) cudaGetLastError();
  return true;
}

absl::Status CudaEvent::MakeStreamWait(CudaStreamView stream) const {
  if (event_ == nullptr) return absl::OkStatus();
  if (cudaError_t err = cudaStreamWaitEvent(Stream(stream), static_cast<cudaEvent_t>(event_), 0);
      err != cudaSuccess)
    return CudaError(err, "cudaStreamWaitEvent");
  return absl::OkStatus();
}

absl::Status CudaEvent::Synchronize() const {
  if (event_ == nullptr) return absl::OkStatus();
  if (cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(event_)); err != cudaSuccess)
    return CudaError(err, "cudaEventSynchronize");
  return absl::OkStatus();
}

absl::Status CopyAsync(void* dst, const void* src, std::size_t bytes, CopyDirection direction,
                       CudaStreamView stream) {
  const cudaMemcpyKind kind =
      direction == CopyDirection::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, Stream(stream)); err != cudaSuccess)
    return CudaError(err, "cudaMemcpyAsync");
  return absl::OkStatus();
}

absl::Status SynchronizeStream(CudaStreamView stream) {
  // A blocking event after the stream's work (Note [blocking events]): cudaStreamSynchronize
  // spins under the runtime's default schedule. Where no event can be made, it still waits.
  absl::StatusOr<CudaEvent> event = CudaEvent::Create();
  if (event.ok() && event->Record(stream).ok()) return event->Synchronize();
  if (cudaError_t err = cudaStreamSynchronize(Stream(stream)); err != cudaSuccess)
    return CudaError(err, "cudaStreamSynchronize");
  return absl::OkStatus();
}

#else  // !MEMASCEND_HAVE_CUDA

namespace {
absl::Status NoCuda(const char* what) {
  return absl::FailedPreconditionError(
      fmt::format("{}: MemAscend was built without CUDA (MEMASCEND_WITH_CUDA)", what));
}
}  // namespace

int CudaDeviceCount() noexcept { return 0; }
absl::Status CudaSetDevice(int) { return NoCuda("cudaSetDevice"); }
DeviceGuard::DeviceGuard(int) noexcept : status_(NoCuda("cudaSetDevice")) {}
DeviceGuard::~DeviceGuard() = default;
absl::StatusOr<DeviceAllocation> DeviceAllocation::Allocate(int, std::size_t) {
  return NoCuda("cudaMalloc");
}
void DeviceAllocation::Reset() noexcept {}
absl::StatusOr<CudaEvent> CudaEvent::Create() { return NoCuda("cudaEventCreate"); }
absl::StatusOr<CudaEvent> CudaEvent::CreateTiming() { return NoCuda("cudaEventCreate"); }
absl::StatusOr<double> CudaEvent::SecondsSince(const CudaEvent&) const {
  return NoCuda("cudaEventElapsedTime");
}
CudaEvent::~CudaEvent() = default;
absl::Status CudaEvent::Record(CudaStreamView) { return NoCuda("cudaEventRecord"); }
bool CudaEvent::Ready() const noexcept { return true; }
absl::Status CudaEvent::MakeStreamWait(CudaStreamView) const {
  return NoCuda("cudaStreamWaitEvent");
}
absl::Status CudaEvent::Synchronize() const { return NoCuda("cudaEventSynchronize"); }
absl::Status CopyAsync(void*, const void*, std::size_t, CopyDirection, CudaStreamView) {
  return NoCuda("cudaMemcpyAsync");
}
absl::Status SynchronizeStream(CudaStreamView) { return NoCuda("cudaStreamSynchronize"); }

#endif

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() { Reset(); }

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    CudaEvent dead(std::move(*this));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

}  // namespace memascend::prim
