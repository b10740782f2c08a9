// One training step of a Run (run.h): the forward pass streaming each group's parameters
// (or taking them from the previous step's update, memascend Note [optimizer overlap]),
// the backward pass in reverse, the overflow check and the update, and the commits, each
// reported once durable.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include <memascend/kernels.h>
#include <memascend/status.h>

#include "run.h"
#include "state.h"

namespace offload_train {

using memascend::DType;
using memascend::MutableTensorView;
using memascend::OffloadedAdam;
using memascend::ParameterStream;
using memascend::StateLayout;

// A block's gradient (Note [gradient parts]).
std::size_t GradientScratchParams(const ModelConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 1; g + 1 < GroupCount(c); ++g) n = std::max(n, GroupParams(c, g));
  return n;
}

// The largest group in the working buffer: with a tied head the embeddings have their own
// (Note [tied head]).
std::size_t WorkingParams(const ModelConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = TiedHead(c) ? 1 : 0; g < GroupCount(c); ++g)
    n = std::max(n, GroupParams(c, g));
  return n;
}

std::size_t TiedChunkRows(const ModelConfig& c, std::size_t chunk_bytes) {
  const std::size_t rows = GroupParams(c, 0) / c.channels;  // with GPT-2's positions
  return std::clamp<std::size_t>(chunk_bytes / (sizeof(float) * c.channels), 1, rows);
}

// `o.model.batch` is this rank's share of the batch; `shard` (with `comm`) this rank's
// of the whole layout `whole` (Note [data parallel]); null for one process.
Run::Run(const TrainOptions& o, OffloadedAdam* adam, memascend::KernelThreads* threads,
         memascend::MemoryLedger* ledger, ActivationStash* stash,
         const memascend::LayoutShard* shard, const StateLayout* whole)
    : o_(o),
      c_(o.model),
      adam_(adam),
      threads_(threads),
      ledger_(ledger),
      overlap_(o.overlap_optimizer && MemAscendOffload(o)),
      tied_(TiedHead(o.model)),
      shard_(shard),
      whole_(whole),
      comm_(shard != nullptr ? o.comm : nullptr),
      forward_(adam, 0, GroupCount(o.model), o.window),  // one process's (Note [data parallel])
      backward_(adam, 1, GroupCount(o.model) - 1, o.window),
      stash_(stash),
      wf_(WorkingParams(o.model)),
      param_dtype_(adam->layout().param_dtype),
      wr_(tied_ ? TiedChunkRows(o.model, o.tied_chunk_bytes) * o.model.channels : 0),
      master_embed_(0),
      df_(std::max(GradientScratchParams(o.model),
                   whole != nullptr ? whole->MaxPartElements() : std::size_t{0})),
      block_in_(stash != nullptr ? o.model.batch * o.model.seq * o.model.channels : 0) {
  if (shard_ != nullptr) InitShards();
}

// The initial state: the architecture's initialisation, or `ckpt`'s weights, read group
// by group in the checkpoint's dtype (an import holds one group in that dtype).
absl::Status Run::Init(const memascend::SafetensorsCheckpoint* ckpt) {
  std::vector<std::byte> raw;
  std::vector<float> part;
  const StateLayout& l = adam_->layout();
  for (std::size_t g = 0; g < GroupCount(c_); ++g) {
    const std::size_t n = GroupParams(c_, g);
    // Note [data parallel]: every rank makes (or reads) the group, and keeps its shard.
    const std::optional<std::size_t> local =
        shard_ != nullptr ? shard_->local[g] : std::optional<std::size_t>(g);
    const std::size_t begin = shard_ != nullptr ? shard_->range[g].first : 0;
    const std::size_t count = shard_ != nullptr ? shard_->range[g].second - begin : n;
    if (!local.has_value()) continue;
    if (ckpt != nullptr) {
      MEMASCEND_ASSIGN_OR_RETURN(const DType d, HfGroupDType(*ckpt, c_, g));
      raw.resize(n * memascend::SizeOf(d));
      MEMASCEND_RETURN_IF_ERROR(ImportHfGroup(*ckpt, c_, g, {raw.data(), n, d}));
      MEMASCEND_RETURN_IF_ERROR(
          adam_->InitializeFrom(*local, {raw.data() + begin * memascend::SizeOf(d), count, d}));
    } else {
      // A part at a time (Note [tied head]).
      for (std::size_t p = 0; p < l.Parts(*local); ++p) {
        const auto [pb, pe] = l.PartRange(*local, p);
        part.resize(pe - pb);
        InitGroupRange(c_, g, o_.seed, begin + pb, begin + pe, part.data());
        MEMASCEND_RETURN_IF_ERROR(
            adam_->InitializePart(*local, p, {part.data(), part.size(), DType::kF32}));
      }
    }
  }
  raw = {};
  step_ = 0;
  return adam_->Commit(0, identity_);
}

// One step: the forward and backward passes, the overflow check and the update (or,
// with the optimizer overlapped, the previous step's update during this forward pass
// and this step's left pending for the next call or Finish()). Each step committed
// meanwhile goes to `on_commit`.
absl::Status Run::Step(const std::vector<std::int32_t>& inputs,
                       const std::vector<std::int32_t>& targets, const CommitFn& on_commit) {
  const std::size_t groups = GroupCount(c_);
  const std::size_t head = groups - 1;
  const float scale = adam_->loss_scale();
  // Note [data parallel]: each rank's gradients are of its rows' mean, scaled by 1/N so
  // that their sum is the global mean's.
  const float grad_scale = comm_ != nullptr ? scale / static_cast<float>(comm_->size()) : scale;
  MakeNet();
  Lap(nullptr);
  const bool update = adam_->update_pending();  // the previous step's, interleaved
  if (update) {
    // The last commit is durable before the update writes the version it superseded.
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    Lap(&phases_.commit);
  }
  adam_->BeginBackward();
  // Forward, streaming the working parameters (or taking them from the update).
  double loss = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    const MutableTensorView working = Working(g);
    if (update) {
      // The new parameters go to the working copy as each part is updated.
      MEMASCEND_RETURN_IF_ERROR(UpdateInto(g, working));
      Sample(g, "opt");
      Lap(&phases_.optimizer);
    } else {
      PrefetchAfter(forward_, g, ParameterStream::Direction::kForward);
    }
    if (g == head) {
      if (update) {
        // Every group is updated: the step commits before the head's compute, so that
        // the next update's reads can start under it.
        MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
        Lap(&phases_.commit);
      }
      // Under the head's compute: the backward pass's first parameters, then (when
      // overlapped) the next update's first reads, of the version now committed.
      PrefetchAfter(backward_, head, ParameterStream::Direction::kReverse);
      if (overlap_) adam_->ReadAheadForUpdate();
    }
    if (!update) MEMASCEND_RETURN_IF_ERROR(LoadInto(g, working, nullptr));
    if (g == 0) {
      net_->Embed(EmbedRows(), inputs.data());
    } else if (g < head) {
      if (stash_ != nullptr) MEMASCEND_RETURN_IF_ERROR(stash_->Put(g - 1, net_->Residual()));
      net_->Block(g - 1, wf_.data());
    } else {
      loss = net_->Head(wf_.data(), HeadRows(), targets.data(), grad_scale, /*backward=*/true);
      if (comm_ != nullptr) {
        double all[] = {loss};
        MEMASCEND_RETURN_IF_ERROR(comm_->AllReduceSum(all));
        loss = all[0] / comm_->size();
      }
      MEMASCEND_RETURN_IF_ERROR(StoreGrad(g));
    }
    Sample(g, "fwd");
    Lap(&phases_.forward);
  }
  // Backward, the blocks in reverse; the embedding needs no parameters.
  for (std::size_t g = head - 1; g >= 1; --g) {
    if (stash_ != nullptr && g > 1) stash_->Prefetch(g - 2);
    MEMASCEND_RETURN_IF_ERROR(
        LoadInto(g, {wf_.data(), GroupParams(c_, g), DType::kF32}, &backward_));
    if (stash_ != nullptr) {
      MEMASCEND_RETURN_IF_ERROR(stash_->Take(g - 1, block_in_.data()));
      net_->Recompute(g - 1, wf_.data(), block_in_.data());
    }
    std::fill_n(df_.data(), GroupParams(c_, g), 0.0f);
    net_->BlockBackward(g - 1, wf_.data(), df_.data());
    MEMASCEND_RETURN_IF_ERROR(StoreGrad(g));
    Sample(g, "bwd");
    Lap(&phases_.backward);
  }
  MEMASCEND_RETURN_IF_ERROR(StoreGrad(0));
  Sample(0, "bwd");
  Lap(&phases_.backward);

  // The overflow check (ZeRO-Infinity's is a pass with temporaries), the scaler, the plan.
  const double ramp =
      o_.warmup == 0
          ? 1.0
          : std::min(1.0, static_cast<double>(step_ + 1) / static_cast<double>(o_.warmup));
  MEMASCEND_ASSIGN_OR_RETURN(memascend::StepPlan plan, adam_->EndBackward(ramp));
  Lap(&phases_.optimizer);
  // A loss that is not finite where no loss scaler can skip it (none, or one at its
  // minimum scale) would skip or corrupt every step from here: stop, the last committed
  // step intact.
  if (!std::isfinite(loss) && (!plan.skipped || plan.loss_scale <= 1.0f)) {
    (void)Settle(on_commit);
    return absl::FailedPreconditionError(fmt::format(
        "step {}: the loss is {} {}: the run diverged (lower --lr, or clip with --clip); "
        "step {} is the last committed and intact (--resume continues from it)",
        step_ + 1, loss,
        plan.skipped ? "with the loss scale at its minimum of 1" : "and no loss scaling to skip it",
        step_));
  }
  pending_ = Committed{step_ + 1, loss, plan.skipped, 0};
  if (plan.skipped) {
    // Committed and settled at once: nothing runs under this commit, and the step's
    // report (its time) must not wait for the next update's.
    MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    Lap(&phases_.commit);
    return absl::OkStatus();
  }
  if (overlap_) return absl::OkStatus();  // the next Step() or Finish() updates
  return Finish(on_commit);
}

// Runs and commits the pending update, if any (the last step's, when overlapped).
absl::Status Run::Finish(const CommitFn& on_commit) {
  MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
  if (!pending_.has_value()) return absl::OkStatus();
  MEMASCEND_RETURN_IF_ERROR(adam_->UpdateAll([this](std::size_t g) {
    Sample(shard_ != nullptr ? global_[g] : g, "opt");  // g: the optimizer's group
  }));
  Lap(&phases_.optimizer);
  MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
  MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
  Lap(&phases_.commit);
  return absl::OkStatus();
}

// Valid while Working(0) is: until a Master(0), an Evaluate or an export's ReadMaster(0).
MatrixRows<float> Run::EmbedRows() {
  if (!tied_) return MatrixRows<float>(wf_.data());
  const std::size_t ch = c_.channels, bytes = memascend::SizeOf(param_dtype_);
  return MatrixRows<float>(
      [this, ch, bytes](std::size_t begin, std::size_t end) {
        const std::size_t n = (end - begin) * ch;
        // Equal counts: the conversion cannot fail.
        memascend::Convert({we_.get() + begin * ch * bytes, n, param_dtype_},
                           {wr_.data(), n, DType::kF32}, {threads_})
            .IgnoreError();
        return static_cast<const float*>(wr_.data());
      },
      wr_.size() / ch);
}

// Group g's parameters into `out` (Working(g)): loaded (through `stream`, if given, which
// prefetches the next groups), or with several ranks, this rank's shard loaded and every
// rank's gathered.
absl::Status Run::LoadInto(std::size_t g, MutableTensorView out, ParameterStream* stream) {
  if (shard_ == nullptr) {
    return stream != nullptr ? stream->Load(g, out, ParameterStream::Direction::kReverse)
                             : adam_->LoadParameters(g, out);
  }
  if (stream != nullptr) PrefetchAfter(*stream, g, ParameterStream::Direction::kReverse);
  if (const auto mine = Shard16(g, out))
    MEMASCEND_RETURN_IF_ERROR(adam_->LoadParameters(mine->first, mine->second));
  return GatherParameters(g, out);
}

// The previous step's update of group g, its new parameters into `out` (Working(g)); with
// several ranks, this rank's shard updated and every rank's gathered.
absl::Status Run::UpdateInto(std::size_t g, MutableTensorView out) {
  if (shard_ == nullptr) return adam_->UpdateGroup(g, out);
  if (const auto mine = Shard16(g, out))
    MEMASCEND_RETURN_IF_ERROR(adam_->UpdateGroup(mine->first, mine->second));
  return GatherParameters(g, out);
}

// Prefetches the window after group g in `direction`: one process's stream, or this
// rank's groups among the next `window`.
void Run::PrefetchAfter(ParameterStream& stream, std::size_t g, ParameterStream::Direction d) {
  if (shard_ == nullptr) {
    stream.PrefetchAfter(g, d);
    return;
  }
  const bool forward = d == ParameterStream::Direction::kForward;
  const std::size_t first = forward ? 0 : 1, last = forward ? GroupCount(c_) : GroupCount(c_) - 1;
  for (std::size_t i = 1; i <= o_.window; ++i) {
    if (forward ? g + i >= last : g < first + i) return;
    if (const auto local = shard_->local[forward ? g + i : g - i])
      adam_->PrefetchParameters(*local);
  }
}

// Starts committing the pending step (memascend Note [background commit]); it is
// reported once durable, by Settle().
absl::Status Run::CommitPending(const CommitFn& on_commit) {
  MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
  MEMASCEND_RETURN_IF_ERROR(adam_->CommitAsync(pending_->step, identity_).status());
  step_ = pending_->step;
  committing_ = pending_;
  committing_->loss_scale = adam_->loss_scale();
  pending_.reset();
  return absl::OkStatus();
}

// Waits for the commit in progress, if any, and reports its step.
absl::Status Run::Settle(const CommitFn& on_commit) {
  MEMASCEND_RETURN_IF_ERROR(adam_->Settle());
  if (committing_.has_value()) {
    // Note [data parallel]: the step is committed once every rank's shard of it is
    // durable; no rank writes the version it superseded before.
    if (comm_ != nullptr) MEMASCEND_RETURN_IF_ERROR(comm_->Barrier());
    const Committed c = *committing_;
    committing_.reset();
    if (on_commit) on_commit(c);
  }
  return absl::OkStatus();
}

// Note [gradient parts]: the embeddings' and the head's fp32 gradients are never whole in
// memory: StoreGrad makes them from the activations (Gpt::EmbedGradient,
// Gpt::HeadGradient) a block's size at a time, converting each range to 16 bits at once,
// so the trainer's fp32 gradient buffer holds a block's gradient, not the largest group
// (which these two are, with a large vocabulary). Each element sums over the batch's rows
// in the order of the whole computation, so the bits do not depend on the ranges. Every
// policy does the same: the buffer is the trainer's, not a storage rule.

// The group's fp32 gradient (scaled) into its stored gradient, part by part; the
// optimizer checks each part for overflow and adds it to the norm.
absl::Status Run::StoreGrad(std::size_t g) {
  if (shard_ != nullptr) return StoreGradSharded(g);
  const StateLayout& l = adam_->layout();
  const GroupKind kind = KindOf(c_, g);
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const std::size_t begin = l.PartRange(g, part).first, end = l.PartRange(g, part).second;
    const auto fill = [&](MutableTensorView grad) -> absl::Status {
      // A block's gradient is whole in df_ (one range); the embeddings' and the
      // head's are made here, df_'s size at a time (Note [gradient parts]).
      const bool block = kind == GroupKind::kBlock;
      for (std::size_t at = begin; at < end; at += block ? end - begin : df_.size()) {
        const std::size_t to = block ? end : std::min(end, at + df_.size());
        if (kind == GroupKind::kHead) net_->HeadGradient(df_.data(), at, to);
        if (kind == GroupKind::kEmbed) net_->EmbedGradient(df_.data(), at, to);
        MEMASCEND_RETURN_IF_ERROR(memascend::Convert(
            {df_.data() + (block ? at : 0), to - at, DType::kF32},
            {static_cast<std::byte*>(grad.data) + (at - begin) * memascend::SizeOf(grad.dtype),
             to - at, grad.dtype},
            {threads_}));
      }
      return absl::OkStatus();
    };
    MEMASCEND_RETURN_IF_ERROR(adam_->WriteGradient(g, part, fill));
  }
  return absl::OkStatus();
}

}  // namespace offload_train
