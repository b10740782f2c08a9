// The example's names for the SDK's training-state vocabulary (memascend/training_state.h):
// the ZeRO-Infinity baseline (zero_infinity.h) is one more TrainingStateStorage, beside the
// SDK's VersionedTrainingState (MemAscend's policy) and InMemoryTrainingState (reference).
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_

#include <memascend/training_state.h>

namespace offload_train {

using Kind = memascend::StateKind;
using Buf = memascend::StateBuffer;
using Backend = memascend::TrainingStateStorage;

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BACKEND_H_
