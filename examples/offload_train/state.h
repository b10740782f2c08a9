// The example's training state: which groups of the model are stored how (the SDK's
// StateLayout), and where (MemAscend's policy: a volume, its tensor store and a
// VersionedTrainingState; ZeRO-Infinity's rules: zero_infinity.h; reference: memory).
//
// Thread-safety: one caller at a time. Lifetime: OffloadState owns what it opened and
// closes it in order.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_STATE_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_STATE_H_

#include <cstddef>
#include <memory>

#include <absl/status/status.h>

#include <memascend/memory_ledger.h>
#include <memascend/object_store.h>
#include <memascend/tensor_store.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

#include "trainer.h"

namespace offload_train {

// MemAscend's policy in offload mode: the one whose state is on a MemAscend volume.
bool MemAscendOffload(const TrainOptions& o);

// Note [derived parameters]: with the update overlapped, the 16-bit parameters of the
// embedding and the head are never read back: the forward pass takes them from the update,
// the head's backward pass runs in the same call as its forward pass, and the embedding's
// needs none. So a MemAscend volume does not store them (StateGroup::store_parameters
// false): where they are needed otherwise (a forward pass with no update before it, every
// step with the update not overlapped, sampling) the optimizer rounds them from the
// master weights, to the bits that would have been stored. The layout is the same whether
// the update is overlapped or not, so a run may be resumed either way.
//
// The model's groups as the SDK's state layout: MemAscend's policy stores every tensor in
// parts and derives the embedding's and the head's 16-bit parameters (Note [derived
// parameters]); ZeRO-Infinity's rules keep each group whole.
memascend::StateLayout MakeStateLayout(const ModelConfig& c, memascend::DType dtype,
                                       std::size_t chunk, bool derive);
memascend::StateLayout MakeStateLayout(const TrainOptions& o);

// MemAscend's policy: the volume (or, for ablations, a directory with a file per tensor),
// its tensor store and the versioned state on them.
struct OffloadState {
  std::unique_ptr<memascend::IoEngine> engine;  // with TrainOptions::fault_injector only
  std::unique_ptr<memascend::Volume> volume;
  std::unique_ptr<memascend::FileObjectStore> files;  // TrainOptions::file_per_tensor
  memascend::ObjectStore* objects() const {
    return volume ? static_cast<memascend::ObjectStore*>(volume.get()) : files.get();
  }
  std::unique_ptr<memascend::TensorStore> store;
  std::unique_ptr<memascend::VersionedTrainingState> state;
  ~OffloadState();
};

// Opens (with --resume) or creates the volume, refusing to reformat an existing one
// without --force, then the store and the state over it.
absl::Status OpenOffloadState(const TrainOptions& o, const memascend::StateLayout& layout,
                              memascend::MemoryLedger* ledger, OffloadState* s);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_STATE_H_
