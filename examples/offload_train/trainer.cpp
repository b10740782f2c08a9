#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>

#include <memascend/offloaded_optimizer.h>
#include <memascend/status.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

#include "backend.h"
#include "state.h"
#include "zero_backend.h"

namespace offload_train {
namespace {

using memascend::DType;
using memascend::MutableTensorView;
using memascend::OffloadedAdam;
using memascend::ParameterStream;
using memascend::StateLayout;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// What the volume's tensors are (Note [state layout] in memascend/training_state.h; 4: the
// SDK's commit record); a volume of another layout is not resumed.
constexpr std::uint64_t kLayoutVersion = 4;

std::uint64_t Fingerprint(const TrainOptions& o, const Tokenizer& tok, std::size_t corpus_tokens) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
  for (std::size_t v :
       {o.model.vocab, o.model.seq, o.model.channels, o.model.layers, o.model.heads, o.model.batch})
    mix(v);
  mix(static_cast<std::uint64_t>(o.dtype));
  mix(o.seed);
  mix(o.warmup);
  mix(o.optimizer_chunk);
  for (float f : {o.lr, o.weight_decay, o.clip, o.initial_loss_scale}) {
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    mix(bits);
  }
  mix(tok.Fingerprint());
  mix(corpus_tokens);
  mix(kLayoutVersion);
  return h;
}

// Note [gradient parts]: the fp32 gradient in hand, a block's (its backward pass makes it
// whole); the embeddings' and the head's are made a block's size at a time.
std::size_t GradientScratchParams(const GptConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 1; g + 1 < GroupCount(c); ++g) n = std::max(n, GroupParams(c, g));
  return n;
}

std::size_t MaxGroupParams(const GptConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 0; g < GroupCount(c); ++g) n = std::max(n, GroupParams(c, g));
  return n;
}

// Mixed-precision training of the model with its state behind an OffloadedAdam.
class Run {
 public:
  Run(const TrainOptions& o, OffloadedAdam* adam, memascend::KernelThreads* threads,
      memascend::MemoryLedger* ledger)
      : o_(o),
        c_(o.model),
        adam_(adam),
        threads_(threads),
        ledger_(ledger),
        overlap_(o.overlap_optimizer && MemAscendOffload(o)),
        forward_(adam, 0, GroupCount(o.model), o.window),
        backward_(adam, 1, GroupCount(o.model) - 1, o.window),
        model_(o.model, threads),
        wf_(MaxGroupParams(o.model)),
        df_(GradientScratchParams(o.model)) {}

  absl::Status Init() {
    for (std::size_t g = 0; g < GroupCount(c_); ++g) {
      InitGroup(c_, g, o_.seed, wf_.data());
      MEMASCEND_RETURN_IF_ERROR(adam_->Initialize(g, {wf_.data(), GroupParams(c_, g)}));
    }
    step_ = 0;
    return adam_->Commit(0);
  }
  void Resume(std::uint64_t step) { step_ = step; }

  std::uint64_t step() const { return step_; }
  const PhaseSeconds& phases() const { return phases_; }
  Gpt<float>& model() { return model_; }

  // A committed step (Note [optimizer overlap]: reported when committed).
  struct Committed {
    std::size_t step = 0;
    double loss = 0;
    bool skipped = false;
    float loss_scale = 0;  // after the step's update of the scaler
  };
  using CommitFn = std::function<void(const Committed&)>;

  // One step: the forward and backward passes, the overflow check and the update (or,
  // with the optimizer overlapped, the previous step's update during this forward pass
  // and this step's left pending for the next call or Finish()). Each step committed
  // meanwhile goes to `on_commit`.
  absl::Status Step(const std::vector<std::int32_t>& inputs,
                    const std::vector<std::int32_t>& targets, const CommitFn& on_commit) {
    const std::size_t groups = GroupCount(c_);
    const std::size_t head = groups - 1;
    const float scale = adam_->loss_scale();
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
      const MutableTensorView working{wf_.data(), GroupParams(c_, g), DType::kF32};
      if (update) {
        // The new parameters go to the working copy as each part is updated.
        MEMASCEND_RETURN_IF_ERROR(adam_->UpdateGroup(g, working));
        Sample(g, "opt");
        Lap(&phases_.optimizer);
      } else {
        forward_.PrefetchAfter(g, ParameterStream::Direction::kForward);
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
        backward_.PrefetchAfter(head, ParameterStream::Direction::kReverse);
        if (overlap_) adam_->ReadAheadForUpdate();
      }
      if (!update) MEMASCEND_RETURN_IF_ERROR(adam_->LoadParameters(g, working));
      if (g == 0) {
        model_.Embed(wf_.data(), inputs.data());
      } else if (g < head) {
        model_.Block(g - 1, wf_.data());
      } else {
        loss = model_.Head(wf_.data(), targets.data(), scale, /*backward=*/true);
        MEMASCEND_RETURN_IF_ERROR(StoreGrad(g));
      }
      Sample(g, "fwd");
      Lap(&phases_.forward);
    }
    // Backward, the blocks in reverse; the embedding needs no parameters.
    for (std::size_t g = head - 1; g >= 1; --g) {
      MEMASCEND_RETURN_IF_ERROR(backward_.Load(g, {wf_.data(), GroupParams(c_, g), DType::kF32},
                                               ParameterStream::Direction::kReverse));
      std::fill_n(df_.begin(), GroupParams(c_, g), 0.0f);
      model_.BlockBackward(g - 1, wf_.data(), df_.data());
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
          plan.skipped ? "with the loss scale at its minimum of 1"
                       : "and no loss scaling to skip it",
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
  absl::Status Finish(const CommitFn& on_commit) {
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    if (!pending_.has_value()) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(adam_->UpdateAll([this](std::size_t g) { Sample(g, "opt"); }));
    Lap(&phases_.optimizer);
    MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    Lap(&phases_.commit);
    return absl::OkStatus();
  }

  // Forward only, for sampling: the model must be built for batch 1.
  absl::StatusOr<std::int32_t> NextToken(Gpt<float>& model, const std::vector<std::int32_t>& ctx,
                                         std::uint64_t* rng) {
    const std::size_t groups = GroupCount(c_);
    std::vector<std::int32_t> window(c_.seq, 0);
    const std::size_t n = std::min(ctx.size(), c_.seq);
    std::copy(ctx.end() - static_cast<std::ptrdiff_t>(n), ctx.end(), window.begin());
    for (std::size_t g = 0; g < groups; ++g) {
      MEMASCEND_RETURN_IF_ERROR(
          adam_->LoadParameters(g, {wf_.data(), GroupParams(c_, g), DType::kF32}));
      if (g == 0) {
        model.Embed(wf_.data(), window.data());
      } else if (g + 1 < groups) {
        model.Block(g - 1, wf_.data());
      } else {
        model.Head(wf_.data(), window.data(), 1.0f, /*backward=*/false);
      }
    }
    const float* logits = model.Logits(0, n - 1);
    std::vector<double> p(c_.vocab);
    double maxv = logits[0], sum = 0;
    for (std::size_t v = 1; v < c_.vocab; ++v) maxv = std::max(maxv, double{logits[v]});
    for (std::size_t v = 0; v < c_.vocab; ++v)
      sum += p[v] = std::exp((double{logits[v]} - maxv) / 0.8);
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    double u = static_cast<double>(*rng >> 11) * 0x1.0p-53 * sum;
    for (std::size_t v = 0; v < c_.vocab; ++v) {
      u -= p[v];
      if (u <= 0) return static_cast<std::int32_t>(v);
    }
    return static_cast<std::int32_t>(c_.vocab - 1);
  }

 private:
  // Adds the time since the last call to `*total` (if given).
  void Lap(double* total) {
    const auto now = Clock::now();
    if (total != nullptr) *total += std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }

  // Starts committing the pending step (memascend Note [background commit]); it is
  // reported once durable, by Settle().
  absl::Status CommitPending(const CommitFn& on_commit) {
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    MEMASCEND_RETURN_IF_ERROR(adam_->Commit(pending_->step));
    step_ = pending_->step;
    committing_ = pending_;
    committing_->loss_scale = adam_->loss_scale();
    pending_.reset();
    return absl::OkStatus();
  }
  // Waits for the commit in progress, if any, and reports its step.
  absl::Status Settle(const CommitFn& on_commit) {
    MEMASCEND_RETURN_IF_ERROR(adam_->Settle());
    if (committing_.has_value()) {
      const Committed c = *committing_;
      committing_.reset();
      if (on_commit) on_commit(c);
    }
    return absl::OkStatus();
  }

  // The group's fp32 gradient (scaled) into its stored gradient, part by part; the
  // optimizer checks each part for overflow and adds it to the norm.
  absl::Status StoreGrad(std::size_t g) {
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
          if (kind == GroupKind::kHead) model_.HeadGradient(df_.data(), at, to);
          if (kind == GroupKind::kEmbed) model_.EmbedGradient(df_.data(), at, to);
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

  void Sample(std::size_t g, const char* phase) {
    if (ledger_ != nullptr) ledger_->Sample(fmt::format("{}.{}", phase, GroupName(c_, g)));
  }

  TrainOptions o_;
  GptConfig c_;
  OffloadedAdam* adam_;
  memascend::KernelThreads* threads_;
  memascend::MemoryLedger* ledger_;
  bool overlap_;  // memascend Note [optimizer overlap]
  ParameterStream forward_, backward_;
  Gpt<float> model_;
  std::vector<float> wf_;  // one group's parameters in fp32
  std::vector<float> df_;  // a gradient in fp32 (Note [gradient parts])
  PhaseSeconds phases_;
  Clock::time_point mark_ = Clock::now();
  std::uint64_t step_ = 0;               // the last step committed
  std::optional<Committed> pending_;     // computed, not yet committed
  std::optional<Committed> committing_;  // committed, not yet known durable nor reported
};

}  // namespace

std::size_t OptimizerParts(const GptConfig& c, std::size_t group, std::size_t optimizer_chunk) {
  return MakeStateLayout(c, DType::kF16, optimizer_chunk, false).Parts(group);
}

std::size_t MinimumHostBudget(const GptConfig& c, DType dtype, std::size_t optimizer_chunk) {
  return OffloadedAdam::MinimumHostBudget(MakeStateLayout(c, dtype, optimizer_chunk, true));
}

std::size_t UsableHostBudget(const GptConfig& c, DType dtype, std::size_t optimizer_chunk) {
  return memascend::VersionedTrainingState::StoredBytes(
      MakeStateLayout(c, dtype, optimizer_chunk, true));
}

std::uint64_t ModelStateBytes(const GptConfig& c, DType dtype) {
  return static_cast<std::uint64_t>(TotalParams(c)) * (2 * memascend::SizeOf(dtype) + 12);
}

std::size_t DefaultHostBudget(const GptConfig& c, DType dtype, std::size_t optimizer_chunk) {
  const auto forty = static_cast<std::size_t>(static_cast<double>(ModelStateBytes(c, dtype)) * 0.4);
  const std::size_t b = std::max(forty, 2 * MinimumHostBudget(c, dtype, optimizer_chunk));
  return (b + 4095) / 4096 * 4096;
}

absl::StatusOr<TrainSummary> Train(const TrainOptions& options,
                                   const std::vector<std::int32_t>& tokens,
                                   const Tokenizer& tokenizer) {
  TrainOptions o = options;
  MEMASCEND_RETURN_IF_ERROR(Validate(o.model));
  if (o.dtype == DType::kF32)
    return absl::InvalidArgumentError("working parameters are fp16 or bf16");
  if (o.model.vocab != tokenizer.size()) {
    return absl::InvalidArgumentError(
        fmt::format("model vocab {} but the tokenizer has {}", o.model.vocab, tokenizer.size()));
  }
  if (tokens.size() < o.model.seq + 2) {
    return absl::InvalidArgumentError(fmt::format(
        "the corpus has {} tokens, fewer than one window of {}", tokens.size(), o.model.seq + 1));
  }
  if (o.optimizer_chunk == 0 || o.optimizer_chunk % kOptimizerChunkQuantum != 0) {
    return absl::InvalidArgumentError(
        fmt::format("optimizer chunk {} is not a positive multiple of {} elements",
                    o.optimizer_chunk, kOptimizerChunkQuantum));
  }
  if (o.policy == Policy::kZeroInfinity && o.mode == Mode::kOffload && o.resume) {
    return absl::InvalidArgumentError(
        "--resume: the zero-infinity policy keeps no crash-consistent state (as DeepSpeed)");
  }
  if (o.threads < 0 || o.threads > 1024 || o.io_threads < 1 || o.io_threads > 1024) {
    return absl::InvalidArgumentError(fmt::format(
        "--threads {} / --io-threads {}: 0..1024 compute threads (0: all cores), 1..1024 I/O "
        "threads",
        o.threads, o.io_threads));
  }
  if (!std::isfinite(o.lr) || o.lr < 0 || !std::isfinite(o.weight_decay) || o.weight_decay < 0 ||
      !std::isfinite(o.clip) || o.clip < 0 || !std::isfinite(o.initial_loss_scale) ||
      o.initial_loss_scale < 1 || o.initial_loss_scale > 16777216.0f) {
    return absl::InvalidArgumentError(fmt::format(
        "--lr {}, --weight-decay {}, --clip {} must be finite and >= 0, and --loss-scale {} "
        "in [1, 2^24]",
        o.lr, o.weight_decay, o.clip, o.initial_loss_scale));
  }
  const StateLayout layout = MakeStateLayout(o);
  const StateLayout parted = MakeStateLayout(o.model, o.dtype, o.optimizer_chunk, true);
  if (o.host_budget == 0) o.host_budget = DefaultHostBudget(o.model, o.dtype, o.optimizer_chunk);
  // A budget beyond what the store can ever hold (every stored tensor, both versions) is
  // capped there: the rest would be page-locked for nothing (UsableHostBudget).
  o.host_budget =
      std::min<std::size_t>(o.host_budget, UsableHostBudget(o.model, o.dtype, o.optimizer_chunk));
  const std::size_t minimum = OffloadedAdam::MinimumHostBudget(parted);
  {
    // OffloadedAdam Note [kept state]: what the budget leaves beyond the minimum and the
    // kept state goes to the read-ahead.
    const std::size_t spare = o.host_budget > minimum ? o.host_budget - minimum : 0;
    if (!MemAscendOffload(o)) o.keep_bytes = 0;
    if (o.keep_bytes > spare) {
      // Kept state beyond the spare budget would be evicted like any other: refuse it.
      return absl::InvalidArgumentError(
          fmt::format("--keep {} bytes exceeds what the host budget of {} leaves beyond the {} the "
                      "optimizer step needs ({} bytes); keep less or raise --host-budget",
                      o.keep_bytes, o.host_budget, minimum, spare));
    }
    if (o.read_ahead_bytes == 0)
      o.read_ahead_bytes = std::max(OffloadedAdam::MinimumReadAhead(parted), spare - o.keep_bytes);
  }
  if (MemAscendOffload(o) && ::geteuid() != 0) {
    // A budget this process may not page-lock is refused now, not at its first block.
    struct rlimit lim {};
    if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        o.host_budget > lim.rlim_cur) {
      return absl::ResourceExhaustedError(fmt::format(
          "host budget of {} bytes is more than this process may page-lock (RLIMIT_MEMLOCK "
          "{} bytes): lower --host-budget, or raise the limit (ulimit -l, or memlock in "
          "/etc/security/limits.conf)",
          o.host_budget, lim.rlim_cur));
    }
  }
  if (MemAscendOffload(o) && o.host_budget < minimum) {
    return absl::ResourceExhaustedError(fmt::format(
        "host budget of {} bytes is below the {} bytes that the optimizer step holds at once "
        "(the gradient, new parameters, master weights and moments of a part of up to {} "
        "parameters, --optimizer-chunk); give --host-budget {} or more",
        o.host_budget, minimum, parted.MaxPartElements(), minimum));
  }
  memascend::MemoryLedger own_ledger;
  memascend::MemoryLedger* ledger = o.ledger != nullptr ? o.ledger : &own_ledger;
  const int nthreads = o.threads > 0
                           ? o.threads
                           : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  memascend::KernelThreads threads(nthreads);

  OffloadState offload;
  std::unique_ptr<Backend> own;
  Backend* backend = nullptr;
  if (o.mode == Mode::kReference) {
    MEMASCEND_ASSIGN_OR_RETURN(own, memascend::InMemoryTrainingState::Create(layout));
    backend = own.get();
  } else if (o.policy == Policy::kZeroInfinity) {
    MEMASCEND_ASSIGN_OR_RETURN(own, MakeZeroInfinityBackend(o, layout, ledger));
    backend = own.get();
  } else {
    MEMASCEND_RETURN_IF_ERROR(OpenOffloadState(o, layout, ledger, &offload));
    backend = offload.state.get();
  }
  memascend::OffloadedAdamOptions ao;
  ao.lr = o.lr;
  ao.weight_decay = o.weight_decay;
  ao.max_grad_norm = o.clip;
  ao.scaler.initial_scale = o.initial_loss_scale;
  ao.fingerprint = Fingerprint(o, tokenizer, tokens.size());
  ao.read_ahead_bytes = o.read_ahead_bytes;
  ao.keep_bytes = o.keep_bytes;
  ao.gradient_room = o.overlap_optimizer && MemAscendOffload(o);
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedAdam> adam,
                             OffloadedAdam::Create(backend, ao, &threads));
  Run run(o, adam.get(), &threads, ledger);
  if (o.resume) {
    auto last = adam->Resume();
    if (!last.ok() && last.status().code() == absl::StatusCode::kFailedPrecondition) {
      return absl::FailedPreconditionError(fmt::format(
          "--resume: the volume's run had another model, data, seed or hyper-parameters ({})",
          std::string(last.status().message())));
    }
    MEMASCEND_RETURN_IF_ERROR(last.status());
    if (!last->has_value()) {
      return absl::NotFoundError(
          fmt::format("--resume: the volume '{}' holds no committed step; start without --resume",
                      o.volume_path));
    }
    run.Resume((*last)->step);
  } else {
    MEMASCEND_RETURN_IF_ERROR(run.Init());
    // The initial state is durable before the clock starts, as under ZeRO-Infinity's rules
    // (written synchronously): the first step's time is a step's, in every policy.
    MEMASCEND_RETURN_IF_ERROR(adam->Settle());
  }

  TrainSummary summary;
  summary.params = TotalParams(o.model);
  summary.model_state_bytes = ModelStateBytes(o.model, o.dtype);
  summary.host_budget = MemAscendOffload(o) ? o.host_budget : 0;
  summary.first_step = run.step() + 1;
  const auto start = Clock::now();
  auto last = start;  // of the last commit: a step's time runs from the one before
  std::uint64_t io_last = backend->io_read_bytes() + backend->io_write_bytes();
  const Run::CommitFn on_commit = [&](const Run::Committed& c) {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    const std::uint64_t io = backend->io_read_bytes() + backend->io_write_bytes();
    summary.losses.push_back(c.loss);
    summary.step_seconds.push_back(seconds);
    summary.step_skipped.push_back(c.skipped);
    summary.last_step = c.step;
    if (o.on_step) {
      StepReport r;
      r.step = c.step;
      r.steps = o.steps;
      r.loss = c.loss;
      r.loss_scale = c.loss_scale;
      r.skipped = c.skipped;
      r.seconds = seconds;
      r.tokens_per_second = static_cast<double>(o.model.batch * o.model.seq) / seconds;
      r.io_bytes = io - io_last;
      r.io_gib_per_second = static_cast<double>(r.io_bytes) / seconds / (1u << 30);
      r.pinned_bytes = ledger->Snapshot().tier(memascend::Tier::kPinnedHost).reserved;
      o.on_step(r);
    }
    last = now;
    io_last = io;
  };
  std::vector<std::int32_t> inputs, targets;
  for (std::size_t step = run.step() + 1; step <= o.steps; ++step) {
    SampleBatch(tokens, o.seed, step, o.model.batch, o.model.seq, &inputs, &targets);
    MEMASCEND_RETURN_IF_ERROR(run.Step(inputs, targets, on_commit));
  }
  MEMASCEND_RETURN_IF_ERROR(run.Finish(on_commit));
  summary.seconds = Since(start);
  summary.final_loss = summary.losses.empty() ? 0 : summary.losses.back();
  summary.skipped_steps = adam->scaler().skipped_steps();
  summary.activation_bytes = run.model().ActivationBytes();
  summary.phases = run.phases();

  if (o.sample_tokens > 0) {
    GptConfig one = o.model;
    one.batch = 1;
    Gpt<float> sampler(one, &threads);
    std::vector<std::int32_t> ctx(tokens.begin(), tokens.begin() + 8);
    for (std::int32_t t : ctx) summary.sample += tokenizer.Decode(t);
    std::uint64_t rng = o.seed;
    for (std::size_t i = 0; i < o.sample_tokens; ++i) {
      MEMASCEND_ASSIGN_OR_RETURN(std::int32_t next, run.NextToken(sampler, ctx, &rng));
      ctx.push_back(next);
      summary.sample += tokenizer.Decode(next);
    }
  }
  summary.io_read_bytes = backend->io_read_bytes();
  summary.io_write_bytes = backend->io_write_bytes();
  summary.store = backend->store_stats();
  summary.ledger = ledger->Snapshot();
  summary.peak_pinned_bytes =
      static_cast<std::uint64_t>(summary.ledger.tier(memascend::Tier::kPinnedHost).reserved_peak);
  summary.peak_rss_bytes = summary.ledger.peak_rss_bytes;
  return summary;
}

}  // namespace offload_train
