#include "state.h"

#include <sys/stat.h>

#include <fmt/format.h>

#include <memascend/status.h>

namespace offload_train {

using memascend::DType;
using memascend::StateLayout;

bool MemAscendOffload(const TrainOptions& o) {
  return o.policy == Policy::kMemAscend && o.mode == Mode::kOffload;
}

StateLayout MakeStateLayout(const ModelConfig& c, DType dtype, std::size_t chunk, bool derive) {
  StateLayout l;
  const std::size_t head = GroupCount(c) - 1;
  for (std::size_t g = 0; g <= head; ++g)
    l.groups.push_back({GroupName(c, g), GroupParams(c, g), !(derive && (g == 0 || g == head))});
  l.param_dtype = l.grad_dtype = dtype;
  l.part_elements = chunk;
  return l;
}
StateLayout MakeStateLayout(const TrainOptions& o) {
  return MakeStateLayout(o.model, o.dtype,
                         o.policy == Policy::kMemAscend ? o.optimizer_chunk : SIZE_MAX,
                         MemAscendOffload(o));
}

OffloadState::~OffloadState() {
  state.reset();  // settles a commit in progress, before the store and the volume go
  store.reset();
}

namespace {

// --storage files: the directory's store, refusing an earlier run's objects without
// --resume or --force (which deletes those objects, and only those).
absl::Status OpenFiles(const TrainOptions& o, OffloadState* s) {
  memascend::FileObjectStoreOptions fo;
  fo.engine = s->engine.get();
  fo.create = !o.resume;
  MEMASCEND_ASSIGN_OR_RETURN(s->files, memascend::FileObjectStore::Open(o.volume_path, fo));
  if (o.resume) return absl::OkStatus();
  const std::vector<memascend::ObjectInfo> earlier = s->files->List();
  if (!earlier.empty() && !o.force) {
    const bool checkpoint = s->files->Stat("train.checkpoint").ok();
    s->files.reset();
    return absl::FailedPreconditionError(fmt::format(
        "'{}' already holds a file object store ({} objects{}): continue its run with --resume, "
        "or start over with --force (which deletes them)",
        o.volume_path, earlier.size(), checkpoint ? ", a training checkpoint among them" : ""));
  }
  for (const memascend::ObjectInfo& e : earlier)
    MEMASCEND_RETURN_IF_ERROR(s->files->Delete(e.name));
  return absl::OkStatus();
}

// The state's options (memascend VersionedTrainingStateOptions::ForTrainer): two versions
// for data-parallel ranks, to resume at a step every rank holds.
memascend::VersionedTrainingStateOptions StateOptions(const TrainOptions& o) {
  memascend::VersionedTrainingStateOptions v = memascend::VersionedTrainingStateOptions::ForTrainer(
      o.two_versions || (o.comm != nullptr && o.comm->size() > 1), o.commit_every,
      o.stage_whole_step);
  v.record_name = "train.checkpoint";
  return v;
}

absl::Status OpenVolume(const TrainOptions& o, const StateLayout& layout, OffloadState* s) {
  if (o.fault_injector != nullptr && s->engine == nullptr) {
    memascend::IoEngineOptions eo;
    eo.backend = memascend::IoBackendChoice::kThreadPool;
    eo.fault_injector = o.fault_injector;
    MEMASCEND_ASSIGN_OR_RETURN(s->engine, memascend::IoEngine::Create(eo));
  }
  if (o.volume_path.empty()) return absl::InvalidArgumentError("no volume path");
  if (o.file_per_tensor) return OpenFiles(o, s);
  memascend::VolumeOpenOptions open;
  open.engine = s->engine.get();
  if (o.resume) {
    MEMASCEND_ASSIGN_OR_RETURN(s->volume, memascend::Volume::Open(o.volume_path, open));
    return absl::OkStatus();
  }
  struct stat st {};
  const bool exists = ::stat(o.volume_path.c_str(), &st) == 0;
  const bool regular = !exists || S_ISREG(st.st_mode);
  memascend::VolumeFormatOptions f;
  f.force = o.force;
  if (regular) {
    // memascend Note [volume size]: the state, what is staged in flight, the journal.
    f.size = o.volume_bytes != 0
                 ? o.volume_bytes
                 : memascend::VersionedTrainingState::VolumeBytes(layout, StateOptions(o));
  }
  if (exists && !o.force) {
    // Never reformat what the user did not ask to: an earlier run's volume (its
    // checkpoint, or objects put there by `memascend volume put`) is refused, and so is
    // any other content (Volume::Format says what it found).
    auto existing = memascend::Volume::Open(o.volume_path, open);
    if (existing.ok()) {
      const memascend::VolumeStats vs = (*existing)->stats();
      const bool checkpoint = (*existing)->Stat("train.checkpoint").ok();
      return absl::FailedPreconditionError(fmt::format(
          "'{}' already holds a MemAscend volume ({} objects{}): continue its run with --resume, "
          "or start over with --force (which reformats it and loses what it holds)",
          o.volume_path, vs.objects, checkpoint ? ", a training checkpoint among them" : ""));
    }
    if (existing.status().code() == absl::StatusCode::kUnavailable) return existing.status();
  }
  MEMASCEND_RETURN_IF_ERROR(memascend::Volume::Format(o.volume_path, f));
  MEMASCEND_ASSIGN_OR_RETURN(s->volume, memascend::Volume::Open(o.volume_path, open));
  return absl::OkStatus();
}

}  // namespace

absl::Status OpenOffloadState(const TrainOptions& o, const StateLayout& layout,
                              memascend::MemoryLedger* ledger, OffloadState* s) {
  MEMASCEND_RETURN_IF_ERROR(OpenVolume(o, layout, s));
  memascend::TensorStoreOptions so;
  so.host_budget_bytes = o.host_budget;
  so.prefetch_threads = o.io_threads;
  // Every new version is written back before the step commits anyway: write it at once,
  // overlapping the compute, so evictions find clean tensors. Not with a commit interval
  // (memascend Note [commit interval]): the steps between write only what is evicted.
  so.write_behind = o.write_behind && o.commit_every <= 1;
  if (o.pow2_pool) so.pool_policy = memascend::PoolPolicy::kPow2;
  // The read-ahead never waits on its tickets, and holds more than the room left while the
  // gradients are resident (OffloadedAdam Note [gradient room]): its reads wait for room.
  so.defer_prefetches = true;
  so.ledger = ledger;
  // No GPU tier: the budget is mlock'ed, not registered with CUDA (host_backing kAuto);
  // or unlocked where RLIMIT_MEMLOCK is below it (memascend Note [default host budget]).
  if (o.host_budget_choice.has_value() && !o.host_budget_choice->locked)
    so.host_backing = memascend::ArenaBacking::kUnlocked;
  MEMASCEND_ASSIGN_OR_RETURN(s->store, memascend::TensorStore::Open(s->objects(), so));
  MEMASCEND_ASSIGN_OR_RETURN(s->state, memascend::VersionedTrainingState::Open(
                                           s->store.get(), s->objects(), layout, StateOptions(o)));
  return absl::OkStatus();
}

}  // namespace offload_train
