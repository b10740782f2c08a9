// Data-parallel training (memascend-train under mpirun): each rank's shard of the state,
// gathered and reduced, and what the ranks agree on.
//
// Note [data parallel]: with TrainOptions::comm of several ranks (memascend-train under
// mpirun), each rank trains on its slice of every global batch (--batch is the global
// batch, divided among the ranks) and holds a shard of the training state on a volume of
// its own (memascend Note [layout shards]: whole parts, about 1/N of the elements; the
// 16-bit parameters are sharded too, as ZeRO-3 and ZeRO-Infinity do). A step:
//   - each group's parameters: each rank loads (or, with the update overlapped, updates)
//     its shard in the 16-bit dtype, every rank's shard is all-gathered in place at the
//     front of the fp32 working buffer, which is then widened in place (no second buffer;
//     tied embeddings stay in 16 bits, Note [tied head] in run.h);
//     the blocks are gathered again for the backward pass;
//   - each part's fp32 gradient (the loss scaled by scale / N, so the sum is the global
//     mean's) is reduced to the part's owner, which stores it;
//   - the overflow check and the norm are all-reduced (memascend Note [global gradient
//     check]), so every rank plans the same step and skips the same ones;
//   - the loss reported is the mean over the ranks.
// Reductions are MPI's sums, in its order: for two ranks a + b, so a run's losses repeat
// exactly, and agree with one process's within float rounding (the batch's rows are summed
// in another order). Commits are two-phase, keyed by the step: a rank's commit is reported
// only after every rank has settled it (a barrier), and no rank writes the version a
// commit supersedes before that. After a crash the ranks' volumes are at most a step
// apart; --resume takes the newest step every rank holds (ResumeAtMost of the minimum).
#include <algorithm>
#include <cstring>
#include <iterator>
#include <optional>
#include <utility>

#include <memascend/kernels.h>
#include <memascend/status.h>

#include "run.h"
#include "state.h"

namespace offload_train {

using memascend::DType;
using memascend::MutableTensorView;
using memascend::StateLayout;

// Every rank's elements of every group, and this rank's first part of each.
void Run::InitShards() {
  // Every rank's elements of every group, and this rank's first part of each.
  const std::size_t world = static_cast<std::size_t>(shard_->world);
  for (std::size_t g = 0; g < GroupCount(c_); ++g) {
    std::vector<std::pair<std::size_t, std::size_t>>& r = ranges_.emplace_back(world);
    std::size_t first = SIZE_MAX;
    for (std::size_t p = 0; p < whole_->Parts(g); ++p) {
      const auto [b, e] = whole_->PartRange(g, p);
      auto& mine = r[static_cast<std::size_t>(shard_->owner[g][p])];
      mine = {mine.second == mine.first ? b : mine.first, e};
      if (shard_->owner[g][p] == shard_->rank && first == SIZE_MAX) first = p;
    }
    first_part_.push_back(first);
    if (shard_->local[g]) global_.push_back(g);
  }
}

// Every rank's elements of group g, of `element_bytes` each, gathered in place in `data`
// (which holds the group's elements of that size, this rank's at their place).
absl::Status Run::Gather(std::size_t g, void* data, std::size_t element_bytes) {
  const std::size_t world = ranges_[g].size();
  std::vector<std::size_t> counts(world), offsets(world);
  for (std::size_t r = 0; r < world; ++r) {
    offsets[r] = ranges_[g][r].first;
    counts[r] = ranges_[g][r].second - ranges_[g][r].first;
  }
  return comm_->AllGather(data, element_bytes, counts, offsets);
}

// The group's 16-bit parameters, at the front of `to` (this rank's shard at its place),
// gathered from every rank; then, where `to` is fp32, widened in place: element i's 16
// bits lie at bytes [2i, 2i + 2), below its fp32 at [4i, 4i + 4), so converting from the
// back, a run [a, b) with b - a <= a at a time, never overwrites what is still to be read.
absl::Status Run::GatherParameters(std::size_t g, MutableTensorView to) {
  const DType d = adam_->layout().param_dtype;
  auto* bytes = static_cast<std::byte*>(to.data);
  MEMASCEND_RETURN_IF_ERROR(Gather(g, bytes, memascend::SizeOf(d)));
  if (to.dtype == d) return absl::OkStatus();  // the tied embeddings (Note [tied head])
  auto* out = static_cast<float*>(to.data);
  std::size_t b = GroupParams(c_, g);
  while (b > 1) {
    const std::size_t a = (b + 1) / 2;
    MEMASCEND_RETURN_IF_ERROR(memascend::Convert({bytes + a * memascend::SizeOf(d), b - a, d},
                                                 {out + a, b - a, DType::kF32}, {threads_}));
    b = a;
  }
  if (b == 1) {
    std::uint16_t first;
    std::memcpy(&first, bytes, sizeof(first));
    MEMASCEND_RETURN_IF_ERROR(memascend::Convert({&first, 1, d}, {out, 1, DType::kF32}));
  }
  return absl::OkStatus();
}

// This rank's group for group g, and where its shard's 16-bit parameters go in `out`
// (GatherParameters); nullopt where it holds none of the group.
std::optional<std::pair<std::size_t, MutableTensorView>> Run::Shard16(std::size_t g,
                                                                      MutableTensorView out) {
  const auto local = shard_->local[g];
  if (!local.has_value()) return std::nullopt;
  const DType d = adam_->layout().param_dtype;
  const auto [b, e] = shard_->range[g];
  return std::pair{
      *local,
      MutableTensorView{static_cast<std::byte*>(out.data) + b * memascend::SizeOf(d), e - b, d}};
}

// Note [data parallel]: each part of the whole group's fp32 gradient (this rank's rows'),
// made whole in df_ (a block's is there already), reduced to the part's owner, which
// stores it.
absl::Status Run::StoreGradSharded(std::size_t g) {
  const StateLayout& l = *whole_;
  const GroupKind kind = KindOf(c_, g);
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const auto [begin, end] = l.PartRange(g, part);
    float* grad = df_.data();
    if (kind == GroupKind::kBlock) grad += begin;
    if (kind == GroupKind::kHead) net_->HeadGradient(grad, begin, end);
    if (kind == GroupKind::kEmbed) net_->EmbedGradient(grad, begin, end);
    const int owner = shard_->owner[g][part];
    MEMASCEND_RETURN_IF_ERROR(comm_->ReduceSum(grad, end - begin, owner));
    if (owner != shard_->rank) continue;
    const auto fill = [&](MutableTensorView stored) {
      return memascend::Convert({grad, end - begin, DType::kF32}, stored, {threads_});
    };
    MEMASCEND_RETURN_IF_ERROR(adam_->WriteGradient(*shard_->local[g], part - first_part_[g], fill));
  }
  return absl::OkStatus();
}

// The ranks' refusals: what is not data-parallel, a batch that does not divide, ranks on
// one host sharing a volume.
absl::Status CheckRanks(const TrainOptions& o, const Communicator& comm, bool volume_per_rank) {
  const int world = comm.size();
  if (o.policy == Policy::kZeroInfinity && o.mode == Mode::kOffload) {
    return absl::UnimplementedError(
        "--policy zero-infinity trains in one process: the baseline is not data-parallel "
        "(run it without mpirun)");
  }
  if (o.model.batch % static_cast<std::size_t>(world) != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "--batch {} (the global batch) does not divide among {} ranks: give a multiple of {}",
        o.model.batch, world, world));
  }
  if (MemAscendOffload(o) && comm.local_size() > 1 && !volume_per_rank) {
    return absl::InvalidArgumentError(fmt::format(
        "--volume {}: {} ranks run on this host and each needs a volume of its own: put "
        "{{rank}} in the path (it becomes the rank's number)",
        o.volume_path, comm.local_size()));
  }
  return absl::OkStatus();
}

// --resume: the newest step every rank holds; a rank one step ahead goes back to it (its
// previous commit is whole).
absl::Status ResumeOnEveryRank(Communicator& comm, memascend::OffloadedAdam* adam,
                               absl::StatusOr<std::optional<memascend::CommitRecord>>* resumed) {
  auto& last = *resumed;
  std::uint64_t v[] = {last.ok() ? 1u : 0u, last.ok() ? (**last).step : 0};
  const absl::Status reduced = comm.AllReduceMin(v);
  MEMASCEND_RETURN_IF_ERROR(last.status());  // this rank's own reason first
  MEMASCEND_RETURN_IF_ERROR(reduced);
  if (v[0] == 0) {
    return absl::FailedPreconditionError(
        "--resume: another rank cannot resume from its volume (its error says why)");
  }
  if ((**last).step > v[1]) {
    last = adam->ResumeAtMost(v[1]);
    MEMASCEND_RETURN_IF_ERROR(last.status());
  }
  return absl::OkStatus();
}

// This rank's rows of the global batch: `rows` tokens from rank * rows.
void TakeRankRows(int rank, std::size_t rows, std::vector<std::int32_t>* inputs,
                  std::vector<std::int32_t>* targets) {
  const auto first = static_cast<std::ptrdiff_t>(rows * static_cast<std::size_t>(rank));
  inputs->assign(inputs->begin() + first,
                 inputs->begin() + first + static_cast<std::ptrdiff_t>(rows));
  targets->assign(targets->begin() + first,
                  targets->begin() + first + static_cast<std::ptrdiff_t>(rows));
}

// Every rank's figures to rank 0's summary (TrainSummary::ranks).
absl::Status GatherRankFigures(Communicator& comm, const StateLayout& layout, TrainSummary* out) {
  TrainSummary& summary = *out;
  const int rank = comm.rank(), world = comm.size();
  const auto steps = static_cast<double>(std::max<std::size_t>(1, summary.step_seconds.size()));
  double sum_seconds = 0, sum_comm = 0, sum_io = 0;
  for (double t : summary.step_seconds) sum_seconds += t;
  for (std::uint64_t b : summary.step_comm_bytes) sum_comm += static_cast<double>(b);
  for (std::uint64_t b : summary.step_io_bytes) sum_io += static_cast<double>(b);
  const double figures[] = {static_cast<double>(summary.peak_rss_bytes),
                            static_cast<double>(summary.peak_pinned_bytes),
                            sum_seconds / steps,
                            sum_comm / steps,
                            sum_io / steps,
                            static_cast<double>(layout.TotalElements())};
  constexpr std::size_t kFigures = std::size(figures);
  std::vector<double> all(rank == 0 ? kFigures * static_cast<std::size_t>(world) : 0);
  MEMASCEND_RETURN_IF_ERROR(comm.GatherToRoot(figures, all));
  for (std::size_t r = 0; rank == 0 && r < static_cast<std::size_t>(world); ++r) {
    const double* f = all.data() + r * kFigures;
    summary.ranks.push_back({static_cast<std::uint64_t>(f[0]), static_cast<std::uint64_t>(f[1]),
                             f[2], f[3], f[4], static_cast<std::uint64_t>(f[5])});
  }
  return absl::OkStatus();
}

}  // namespace offload_train
