// Helpers shared by the tests of the SDK's training components.
#ifndef MEMASCEND_TESTS_TRAIN_STATE_TEST_UTIL_H_
#define MEMASCEND_TESTS_TRAIN_STATE_TEST_UTIL_H_

#include <memory>
#include <string>

#include <memascend/status.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

namespace memascend::testing {

// A volume, a tensor store over it and a versioned training state in the store, closed
// in the right order (the state settles, the store writes back, then the volume goes).
struct OpenedState {
  std::unique_ptr<Volume> volume;
  std::unique_ptr<TensorStore> store;
  std::unique_ptr<VersionedTrainingState> state;
  ~OpenedState() {
    state.reset();
    store.reset();
  }
};

// Opens (after formatting a file of `format_bytes`, unless 0) the volume at `path`, a
// store under `store_options` and the state of `layout`, as a new process would.
inline absl::Status OpenState(const std::string& path, std::uint64_t format_bytes,
                              const StateLayout& layout, TensorStoreOptions store_options,
                              OpenedState* o,
                              const VersionedTrainingStateOptions& state_options = {}) {
  if (format_bytes != 0) {
    VolumeFormatOptions f;
    f.size = format_bytes;
    MEMASCEND_RETURN_IF_ERROR(Volume::Format(path, f));
  }
  MEMASCEND_ASSIGN_OR_RETURN(o->volume, Volume::Open(path, {}));
  MEMASCEND_ASSIGN_OR_RETURN(o->store, TensorStore::Open(o->volume.get(), store_options));
  MEMASCEND_ASSIGN_OR_RETURN(o->state, VersionedTrainingState::Open(o->store.get(), o->volume.get(),
                                                                    layout, state_options));
  return absl::OkStatus();
}

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_TRAIN_STATE_TEST_UTIL_H_
