// MemAscend's policy: its pinned host budget (memascend Note [default host budget]) and the
// sizes it is made of: the least the optimizer step needs, the most the store can hold,
// the run's ordinary memory beside it.
#include <algorithm>

#include <memascend/host_budget.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/status.h>
#include <memascend/training_state.h>

#include "run.h"
#include "state.h"

namespace offload_train {

using memascend::DType;
using memascend::OffloadedAdam;
using memascend::StateLayout;

std::size_t OptimizerParts(const ModelConfig& c, std::size_t group, std::size_t optimizer_chunk) {
  return MakeStateLayout(c, DType::kF16, optimizer_chunk, false).Parts(group);
}

std::size_t MinimumHostBudget(const ModelConfig& c, DType dtype, std::size_t optimizer_chunk) {
  return OffloadedAdam::MinimumHostBudget(MakeStateLayout(c, dtype, optimizer_chunk, true));
}

std::size_t UsableHostBudget(const ModelConfig& c, DType dtype, std::size_t optimizer_chunk) {
  return memascend::VersionedTrainingState::StoredBytes(
      MakeStateLayout(c, dtype, optimizer_chunk, true));
}

std::uint64_t ModelStateBytes(const ModelConfig& c, DType dtype) {
  return static_cast<std::uint64_t>(TotalParams(c)) * (2 * memascend::SizeOf(dtype) + 12);
}

std::uint64_t WorkingMemoryBytes(const ModelConfig& c, std::size_t batch,
                                 bool checkpoint_activations, bool reads_masters) {
  // The trainer's working buffers (Run: wf_, df_ and wr_ in fp32; we_ in 16 bits, or in
  // its place master_embed_ in fp32 on data-parallel ranks: Note [tied head]).
  std::uint64_t floats = WorkingParams(c) + GradientScratchParams(c);
  if (TiedHead(c)) {
    floats +=
        TiedChunkRows(c) * c.channels + (reads_masters ? GroupParams(c, 0) : GroupParams(c, 0) / 2);
  }
  // The network's activations (model.cpp, llama.cpp: what their constructors allocate).
  const std::uint64_t rows = batch * c.seq;
  const std::uint64_t kept = checkpoint_activations ? 1 : c.layers;
  if (IsLlama(c)) {
    const HfConfig& h = *c.hf;
    const std::uint64_t ch = h.hidden, qw = h.heads * h.head_dim, kw = h.kv_heads * h.head_dim,
                        in = h.intermediate;
    const std::uint64_t block = rows * (4 * ch + 2 * qw + 2 * kw + 3 * in + 2) +
                                std::uint64_t{batch} * h.heads * c.seq * c.seq;
    floats += kept * block + rows * (2 * ch + c.vocab + 4 * std::max({in, qw, ch}));
  } else {
    const std::uint64_t ch = c.channels;
    const std::uint64_t block =
        rows * (15 * ch + 4) + std::uint64_t{batch} * c.heads * c.seq * c.seq;
    floats += kept * block + rows * (2 * ch + c.vocab + 9 * ch);
  }
  return floats * sizeof(float) + (std::uint64_t{256} << 20);
}

namespace {

// The rank's layout in parts (Note [parts]): what its store holds.
absl::StatusOr<StateLayout> PartedLayout(const TrainOptions& o, int world, int rank) {
  StateLayout parted = MakeStateLayout(o.model, o.dtype, o.optimizer_chunk, true);
  if (world > 1) {
    MEMASCEND_ASSIGN_OR_RETURN(memascend::LayoutShard s,
                               memascend::ShardLayout(parted, rank, world));
    parted = std::move(s.layout);
  }
  return parted;
}

}  // namespace

absl::StatusOr<memascend::HostBudget> ChooseTrainHostBudget(const TrainOptions& o, int world,
                                                            int rank) {
  MEMASCEND_ASSIGN_OR_RETURN(const StateLayout parted, PartedLayout(o, world, rank));
  memascend::HostBudgetRequest want;
  want.minimum_bytes = OffloadedAdam::MinimumHostBudget(parted);
  // In place, but for data-parallel ranks (StateOptions, state.cpp).
  // (never below the minimum: a state smaller than it is held whole at the minimum).
  want.maximum_bytes = std::max<std::uint64_t>(
      memascend::VersionedTrainingState::StoredBytes(parted, world == 1), want.minimum_bytes);
  want.other_bytes = WorkingMemoryBytes(
      o.model, o.model.batch / static_cast<std::size_t>(world), o.checkpoint_activations,
      world > 1 && (o.eval_tokens != nullptr || !o.export_dir.empty()));
  // The store has no GPU tier: the budget is mlock'ed (TensorStoreOptions::host_backing).
  want.backing = memascend::HostBackingKind::kMlock;
  want.given_bytes = o.host_budget;
  return memascend::ChooseHostBudget(want);
}

}  // namespace offload_train
