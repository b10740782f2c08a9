#include "train/copy_engine.h"

#include <cstring>
#include <utility>

#include <fmt/format.h>

#include <memascend/status.h>

#include "prim/cuda.h"

namespace memascend::train {
namespace {

class CudaCopyEvent final : public CopyEvent {
 public:
  explicit CudaCopyEvent(prim::CudaEvent event) : event_(std::move(event)) {}
  bool Ready() override { return event_.Ready(); }
  absl::Status Wait() override { return event_.Synchronize(); }
  double SecondsSince(CopyEvent& earlier) override {
    absl::StatusOr<double> s = event_.SecondsSince(static_cast<CudaCopyEvent&>(earlier).event());
    return s.ok() ? *s : 0.0;
  }
  const prim::CudaEvent& event() const { return event_; }

 private:
  prim::CudaEvent event_;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(int device) : device_(device) {}
  absl::StatusOr<std::byte*> AllocateSlab(std::size_t bytes) override {
    if (slab_.data() != nullptr) return absl::FailedPreconditionError("the slab is taken already");
    MEMASCEND_ASSIGN_OR_RETURN(slab_, prim::DeviceAllocation::Allocate(device_, bytes));
    return slab_.data();
  }
  absl::Status Copy(void* dst, const void* src, std::size_t bytes, prim::CopyDirection direction,
                    CudaStreamView stream) override {
    const prim::DeviceGuard on(device_);  // Note [current device] (prim/cuda_memory.h)
    MEMASCEND_RETURN_IF_ERROR(on.status());
    return prim::CopyAsync(dst, src, bytes, direction, stream);
  }
  absl::StatusOr<std::shared_ptr<CopyEvent>> Record(CudaStreamView stream, bool timing) override {
    const prim::DeviceGuard on(device_);  // the event on the stream's device
    MEMASCEND_RETURN_IF_ERROR(on.status());
    MEMASCEND_ASSIGN_OR_RETURN(
        prim::CudaEvent e, timing ? prim::CudaEvent::CreateTiming() : prim::CudaEvent::Create());
    MEMASCEND_RETURN_IF_ERROR(e.Record(stream));
    return std::make_shared<CudaCopyEvent>(std::move(e));
  }
  absl::Status MakeWait(CudaStreamView stream, CopyEvent& event) override {
    const prim::DeviceGuard on(device_);  // a legacy stream (0) is the device's
    MEMASCEND_RETURN_IF_ERROR(on.status());
    return static_cast<CudaCopyEvent&>(event).event().MakeStreamWait(stream);
  }
  bool emulated() const noexcept override { return false; }

 private:
  int device_;
  prim::DeviceAllocation slab_;
};

class DoneEvent final : public CopyEvent {
 public:
  bool Ready() override { return true; }
  absl::Status Wait() override { return absl::OkStatus(); }
  double SecondsSince(CopyEvent&) override { return 0; }
};

class HostCopyEngine final : public CopyEngine {
 public:
  absl::StatusOr<std::byte*> AllocateSlab(std::size_t bytes) override {
    if (slab_ != nullptr) return absl::FailedPreconditionError("the slab is taken already");
    slab_ = std::make_unique<std::byte[]>(bytes);
    return slab_.get();
  }
  absl::Status Copy(void* dst, const void* src, std::size_t bytes, prim::CopyDirection,
                    CudaStreamView) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<CopyEvent>> Record(CudaStreamView, bool) override {
    return std::make_shared<DoneEvent>();
  }
  absl::Status MakeWait(CudaStreamView, CopyEvent&) override { return absl::OkStatus(); }
  bool emulated() const noexcept override { return true; }

 private:
  std::unique_ptr<std::byte[]> slab_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyEngine>> MakeCopyEngine(int device, bool emulate_on_host) {
  if (emulate_on_host) return std::unique_ptr<CopyEngine>(new HostCopyEngine());
  const int devices = prim::CudaDeviceCount();
  if (device < 0 || device >= devices) {
    const std::string why = prim::CudaUnusableReason();
    return absl::FailedPreconditionError(fmt::format("no CUDA device {} ({} found{}{})", device,
                                                     devices, why.empty() ? "" : ": ", why));
  }
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(device));
}

}  // namespace memascend::train
