// train/copy_engine.h: the CUDA operations of the device training paths (device memory,
// asynchronous copies, events), behind one interface with two implementations: CUDA's,
// and an emulation over host memory (copies are memcpy on the calling thread, events
// are complete when recorded) so the scheduling above it is tested without a GPU.
//
// Thread-safety: as the CUDA runtime's; the emulation has no shared state.
// Lifetime: an event is shared by whoever waits on it; the engine outlives them.
#ifndef MEMASCEND_SRC_TRAIN_COPY_ENGINE_H_
#define MEMASCEND_SRC_TRAIN_COPY_ENGINE_H_

#include <cstddef>
#include <memory>

#include <absl/status/statusor.h>

#include <memascend/types.h>

#include "prim/cuda_memory.h"

namespace memascend::train {

// A point in a stream's work: Ready() once everything queued before it has finished.
class CopyEvent : public ReuseFence {
 public:
  virtual absl::Status Wait() = 0;  // blocks on the event (never a busy loop)
  // Seconds between `earlier` and this event, both recorded with timing and complete; 0
  // where there is no timing (the emulation).
  virtual double SecondsSince(CopyEvent& earlier) = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // The device memory of a tier: one allocation, held for the engine's life.
  virtual absl::StatusOr<std::byte*> AllocateSlab(std::size_t bytes) = 0;
  virtual absl::Status Copy(void* dst, const void* src, std::size_t bytes,
                            prim::CopyDirection direction, CudaStreamView stream) = 0;
  // An event after the work queued on `stream` so far; `timing`: usable by SecondsSince.
  virtual absl::StatusOr<std::shared_ptr<CopyEvent>> Record(CudaStreamView stream,
                                                            bool timing = false) = 0;
  // `stream`'s later work waits for `event` (without blocking the host).
  virtual absl::Status MakeWait(CudaStreamView stream, CopyEvent& event) = 0;
  virtual bool emulated() const noexcept = 0;
};

// CUDA on `device`, or the emulation. kFailedPrecondition for CUDA without a device or
// a CUDA build.
absl::StatusOr<std::unique_ptr<CopyEngine>> MakeCopyEngine(int device, bool emulate_on_host);

}  // namespace memascend::train

#endif  // MEMASCEND_SRC_TRAIN_COPY_ENGINE_H_
