// Where the training state lives, behind one interface: ordinary memory (reference),
// MemAscend's tensor store (Note [train state versions] in trainer.h), or ZeRO-Infinity's
// rules (zero_backend.h). The training loop (trainer.cpp) is the same for all three.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <absl/status/statusor.h>

#include <memascend/kernels.h>
#include <memascend/tensor_store.h>

namespace offload_train {

// The kinds of state of a parameter group. For the MemAscend policy every kind comes in
// parts of TrainOptions::optimizer_chunk elements (the optimizer step then holds one
// part of each at a time, and the passes stream a group part by part); ZeRO-Infinity's
// rules keep each group whole (one part).
enum class Kind { kParam, kGrad, kMaster, kExpAvg, kExpAvgSq };

// What a committed step records (Note [train state versions]).
struct Checkpoint {
  std::uint64_t step = 0;  // steps completed
  int version = 0;         // the version holding the state after `step`
  std::int64_t adam_step = 0;
  memascend::DynamicLossScaler::State scaler;
  std::uint64_t fingerprint = 0;  // of the model, data and hyper-parameters
};

class Backend {
 public:
  // Bytes in hand; `hold` keeps them (a store lease or a swap buffer) until released.
  struct Buf {
    std::byte* data = nullptr;
    std::size_t bytes = 0;
    std::shared_ptr<void> hold;
    float* f32() const { return reinterpret_cast<float*>(data); }
  };
  virtual ~Backend() = default;
  // The current version of a part (next == false) or the next, already written.
  virtual absl::StatusOr<Buf> Read(Kind k, std::size_t group, std::size_t part, bool next) = 0;
  // Every byte is written by the caller: the current version (next == false) or the next.
  virtual absl::StatusOr<Buf> Overwrite(Kind k, std::size_t group, std::size_t part, bool next) = 0;
  // The next version, starting as a copy of the current one.
  virtual absl::StatusOr<Buf> Update(Kind k, std::size_t group, std::size_t part) = 0;
  virtual void Prefetch(Kind k, std::size_t group, std::size_t part) = 0;
  // Both versions of a part stay resident from one step to the next when the budget
  // allows (TensorStore Note [retention]); a hint, ignored by backends without a cache.
  virtual absl::Status Keep(Kind, std::size_t /*group*/, std::size_t /*part*/) {
    return absl::OkStatus();
  }
  virtual absl::Status Discard(Kind k, std::size_t group, std::size_t part) = 0;
  // Makes `c` the committed state; c.version may name the next version. May return before
  // the state is durable (Note [background commit] in trainer.h): Settle() waits. Until
  // then the caller must not write the version that `c` makes the old one (Overwrite or
  // Update of the next version wait for it themselves).
  virtual absl::Status Commit(const Checkpoint& c) = 0;
  // Waits until the last Commit is durable; its error, if it failed.
  virtual absl::Status Settle() { return absl::OkStatus(); }
  virtual absl::StatusOr<std::optional<Checkpoint>> Load() = 0;
  virtual std::uint64_t IoReadBytes() const = 0;
  virtual std::uint64_t IoWriteBytes() const = 0;
  // The tensor store's counters, for a backend over one.
  virtual std::optional<memascend::TensorStoreStats> StoreStats() const { return std::nullopt; }

  // ZeRO-Infinity checks overflow once over the whole flat gradient, with temporaries;
  // the others check each group's gradient as it is produced (fused, no temporaries).
  virtual bool ChecksOverflowAfterBackward() const { return false; }
  virtual absl::StatusOr<bool> CheckOverflow() { return false; }
  // ZeRO-Infinity runs the optimizer over its own sub-groups and swap buffers.
  virtual bool OwnsOptimizerStep() const { return false; }
  virtual absl::Status OptimizerStep(const memascend::AdamConfig&, memascend::KernelThreads*) {
    return absl::UnimplementedError("OptimizerStep");
  }
};

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_
