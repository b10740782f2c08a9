// Train(): one run from its options to its summary, top to bottom: the checks, the state
// (MemAscend's volume, state.h; ZeRO-Infinity's files, zero_infinity.h; or memory), the
// optimizer over it, the initial or resumed state, the steps (step.cpp), then evaluation,
// export and samples (evaluate.cpp), and the figures. Under mpirun each rank runs it on its
// share (Note [data parallel] in data_parallel.cpp).
#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include <memascend/offloaded_optimizer.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

#include "backend.h"
#include "blas.h"
#include "network.h"
#include "run.h"
#include "run_identity.h"
#include "state.h"
#include "zero_infinity.h"

namespace offload_train {
namespace {

using memascend::DType;
using memascend::OffloadedAdam;
using memascend::StateLayout;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// `tokenizer`: the text's (samples are decoded with it), or null for token ids.
absl::StatusOr<TrainSummary> TrainOn(const TrainOptions& options,
                                     const std::vector<std::int32_t>& tokens,
                                     const Tokenizer* tokenizer) {
  TrainOptions o = options;
  MEMASCEND_RETURN_IF_ERROR(Validate(o.model));
  if (o.dtype == DType::kF32)
    return absl::InvalidArgumentError("working parameters are fp16 or bf16");
  if (tokenizer != nullptr && o.model.vocab != tokenizer->size()) {
    return absl::InvalidArgumentError(
        fmt::format("model vocab {} but the tokenizer has {}", o.model.vocab, tokenizer->size()));
  }
  for (const std::vector<std::int32_t>* ids : {&tokens, o.eval_tokens.get()}) {
    if (ids == nullptr) continue;
    const auto bad = std::find_if(ids->begin(), ids->end(), [&](std::int32_t t) {
      return t < 0 || static_cast<std::size_t>(t) >= o.model.vocab;
    });
    if (bad != ids->end()) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: token id {} at position {} is outside the model's vocabulary of {}",
          ids == &tokens ? "training data" : "--eval", *bad, bad - ids->begin(), o.model.vocab));
    }
  }
  if (!o.init_from.empty() && !o.model.hf.has_value())
    return absl::InvalidArgumentError("--init-from: the model must be the directory's config");
  if (!o.export_dir.empty() && !o.model.hf.has_value()) {
    return absl::InvalidArgumentError(
        "--export: only a Hugging Face model (--config or --init-from) exports");
  }
  if (o.blas && !blas::Available()) {
    return absl::FailedPreconditionError(
        "--matmul blas: this build has no BLAS (install libopenblas-dev and rebuild), use "
        "--matmul exact");
  }
  if (o.steps > 0 && tokens.size() < o.model.seq + 2) {
    return absl::InvalidArgumentError(fmt::format(
        "the training text has {} tokens; batches are windows of --seq + 1 = {} tokens drawn "
        "from at least two positions, so it needs at least {}: give more text or a smaller "
        "--seq",
        tokens.size(), o.model.seq + 1, o.model.seq + 2));
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
  if (o.commit_every > 1 && !MemAscendOffload(o)) {
    return absl::InvalidArgumentError(fmt::format(
        "--commit-every {}: only the memascend policy's offloaded state has a commit interval "
        "(memascend Note [commit interval]); the other policies and modes commit as they do",
        o.commit_every));
  }
  if (o.stage_whole_step && !MemAscendOffload(o)) {
    return absl::InvalidArgumentError(
        "--staging step: only the memascend policy's offloaded state stages its steps (memascend "
        "Note [state in place]); the other policies and modes write as they do");
  }
  if (o.threads < 0 || o.threads > 1024 || o.io_threads < 1 ||
      o.io_threads > memascend::TensorStore::kMaxPrefetchThreads) {
    return absl::InvalidArgumentError(fmt::format(
        "--threads {} / --io-threads {}: 0..1024 compute threads (0: all cores), 1..{} I/O "
        "threads",
        o.threads, o.io_threads, memascend::TensorStore::kMaxPrefetchThreads));
  }
  if (!std::isfinite(o.lr) || o.lr < 0 || !std::isfinite(o.weight_decay) || o.weight_decay < 0 ||
      !std::isfinite(o.clip) || o.clip < 0 || !std::isfinite(o.initial_loss_scale) ||
      o.initial_loss_scale < 1 || o.initial_loss_scale > 16777216.0f) {
    return absl::InvalidArgumentError(fmt::format(
        "--lr {}, --weight-decay {}, --clip {} must be finite and >= 0, and --loss-scale {} "
        "in [1, 2^24]",
        o.lr, o.weight_decay, o.clip, o.initial_loss_scale));
  }
  // Note [data parallel]: this process's rank, its share of the batch and of the state.
  Communicator* comm = o.comm != nullptr && o.comm->size() > 1 ? o.comm : nullptr;
  const int world = comm != nullptr ? comm->size() : 1;
  const int rank = comm != nullptr ? comm->rank() : 0;
  const bool volume_per_rank = o.volume_path.find("{rank}") != std::string::npos;
  for (std::size_t at; (at = o.volume_path.find("{rank}")) != std::string::npos;)
    o.volume_path.replace(at, 6, std::to_string(rank));
  if (comm != nullptr) MEMASCEND_RETURN_IF_ERROR(CheckRanks(o, *comm, volume_per_rank));
  const StateLayout whole = MakeStateLayout(o);
  std::optional<memascend::LayoutShard> shard;
  if (comm != nullptr) {
    auto s = memascend::ShardLayout(whole, rank, world);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          fmt::format("{} ranks: {} (lower --optimizer-chunk, a multiple of {})", world,
                      std::string(s.status().message()), kOptimizerChunkQuantum));
    }
    shard = std::move(*s);
  }
  const StateLayout& layout = shard.has_value() ? shard->layout : whole;
  StateLayout parted = MakeStateLayout(o.model, o.dtype, o.optimizer_chunk, true);
  if (comm != nullptr) {
    MEMASCEND_ASSIGN_OR_RETURN(memascend::LayoutShard s,
                               memascend::ShardLayout(parted, rank, world));
    parted = std::move(s.layout);
  }
  if (MemAscendOffload(o)) {
    // memascend Note [default host budget]: given (capped, or refused past the machine's
    // limits) or chosen from what the machine leaves; main chose it already to print it.
    if (!o.host_budget_choice.has_value()) {
      MEMASCEND_ASSIGN_OR_RETURN(o.host_budget_choice, ChooseTrainHostBudget(o, world, rank));
    }
    o.host_budget = o.host_budget_choice->bytes;
  } else {
    // Not used by the ZeRO-Infinity policy nor in reference mode: only capped below.
    if (o.host_budget == 0) o.host_budget = OffloadedAdam::MinimumHostBudget(parted);
    // A budget beyond what the store can ever hold (every stored tensor, in place or, for
    // data-parallel ranks, in both versions) is capped there: the rest would be page-locked
    // for nothing (UsableHostBudget).
    o.host_budget = std::min<std::size_t>(
        o.host_budget, memascend::VersionedTrainingState::StoredBytes(parted, world == 1));
  }
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
  if (o.blas) blas::SetThreads(nthreads);
  std::unique_ptr<memascend::SafetensorsCheckpoint> ckpt;
  if (!o.init_from.empty() && !o.resume) {
    MEMASCEND_ASSIGN_OR_RETURN(ckpt, memascend::SafetensorsCheckpoint::Open(o.init_from));
  }

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
    absl::Status opened = OpenOffloadState(o, layout, ledger, &offload);
    if (opened.code() == absl::StatusCode::kFailedPrecondition && o.resume) {
      // Another layout (Note [state ownership]): say what differs (Note [run identity]).
      const std::string diff = RunDifference(
          offload.objects(), "train.checkpoint",
          RunIdentity(o,
                      tokenizer != nullptr ? tokenizer->Fingerprint() : TokensFingerprint(tokens),
                      tokens.size(), world));
      if (!diff.empty()) {
        opened = absl::FailedPreconditionError(fmt::format(
            "--resume: the volume holds another model's training state ({}); start over with "
            "--force (its state is then lost) or give another --volume",
            diff));
      }
    }
    MEMASCEND_RETURN_IF_ERROR(opened);
    backend = offload.state.get();
  }
  memascend::OffloadedAdamOptions ao;
  ao.lr = o.lr;
  ao.weight_decay = o.weight_decay;
  ao.max_grad_norm = o.clip;
  ao.scaler = memascend::DynamicLossScaler::Options{};  // dynamic (bf16: from scale 1)
  ao.scaler.initial_scale = o.initial_loss_scale;
  ao.fingerprint =
      Fingerprint(o, tokenizer != nullptr ? tokenizer->Fingerprint() : TokensFingerprint(tokens),
                  tokens.size());
  ao.read_ahead_bytes = o.read_ahead_bytes;
  ao.keep_bytes = o.keep_bytes;
  ao.gradient_room = o.overlap_optimizer && MemAscendOffload(o);
  if (o.unfused_overflow_check)
    ao.overflow_check = memascend::OffloadedAdamOptions::OverflowCheck::kTemporaries;
  if (comm != nullptr) {
    // A rank's shard belongs to its rank of a run of this many ranks.
    ao.fingerprint = (ao.fingerprint ^ (static_cast<std::uint64_t>(world) << 32 |
                                        static_cast<std::uint32_t>(rank))) *
                     1099511628211ull;
    // memascend Note [global gradient check]
    ao.reduce_gradient_check =
        [comm](const memascend::GradientCheck& mine) -> absl::StatusOr<memascend::GradientCheck> {
      double v[] = {mine.overflow ? 1.0 : 0.0, mine.sum_squares};
      MEMASCEND_RETURN_IF_ERROR(comm->AllReduceSum(v));
      return memascend::GradientCheck{v[0] > 0, v[1]};
    };
  }
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedAdam> adam,
                             OffloadedAdam::Create(backend, ao, &threads));
  // The run's model computes this rank's rows of the batch.
  TrainOptions mine = o;
  mine.model.batch = o.model.batch / static_cast<std::size_t>(world);
  std::optional<ActivationStash> stash;
  if (o.checkpoint_activations) {
    stash.emplace(MemAscendOffload(o) ? offload.store.get() : nullptr, o.model.layers,
                  mine.model.batch * o.model.seq * o.model.channels);
    MEMASCEND_RETURN_IF_ERROR(stash->Register(o.model.layers));
  }
  Run run(mine, adam.get(), &threads, ledger, stash ? &*stash : nullptr, shard ? &*shard : nullptr,
          shard ? &whole : nullptr);
  const std::string identity =
      RunIdentity(o, tokenizer != nullptr ? tokenizer->Fingerprint() : TokensFingerprint(tokens),
                  tokens.size(), world);
  run.set_identity(identity);
  if (o.resume) {
    auto last = adam->Resume();
    if (!last.ok() && last.status().code() == absl::StatusCode::kFailedPrecondition) {
      const std::string diff = RunDifference(offload.objects(), "train.checkpoint", identity);
      last = absl::FailedPreconditionError(
          diff.empty() ? fmt::format("--resume: the volume's run had another model, data, seed, "
                                     "hyper-parameters{} ({})",
                                     comm != nullptr ? " or ranks" : "",
                                     std::string(last.status().message()))
                       : fmt::format("--resume: the volume's run differs from this one: {}", diff));
    } else if (last.ok() && !last->has_value()) {
      last = absl::NotFoundError(
          fmt::format("--resume: the volume '{}' holds no committed step; start without --resume",
                      o.volume_path));
    }
    if (comm != nullptr) MEMASCEND_RETURN_IF_ERROR(ResumeOnEveryRank(*comm, adam.get(), &last));
    MEMASCEND_RETURN_IF_ERROR(last.status());
    run.Resume((**last).step);
  } else {
    MEMASCEND_RETURN_IF_ERROR(run.Init(ckpt.get()));
    ckpt.reset();
    // The initial state is durable before the clock starts, as under ZeRO-Infinity's rules
    // (written synchronously): the first step's time is a step's, in every policy; with
    // several ranks, on every rank.
    MEMASCEND_RETURN_IF_ERROR(adam->Settle());
    if (comm != nullptr) MEMASCEND_RETURN_IF_ERROR(comm->Barrier());
  }

  TrainSummary summary;
  summary.params = TotalParams(o.model);
  summary.model_state_bytes = ModelStateBytes(o.model, o.dtype);
  summary.host_budget = MemAscendOffload(o) ? o.host_budget : 0;
  summary.first_step = run.step() + 1;
  summary.world = world;
  const auto start = Clock::now();
  auto last = start;  // of the last commit: a step's time runs from the one before
  std::uint64_t io_last = backend->io_read_bytes() + backend->io_write_bytes();
  std::uint64_t sent_last = comm != nullptr ? comm->bytes_sent() : 0;
  const Run::CommitFn on_commit = [&](const Run::Committed& c) {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    const std::uint64_t io = backend->io_read_bytes() + backend->io_write_bytes();
    summary.losses.push_back(c.loss);
    summary.step_seconds.push_back(seconds);
    summary.step_skipped.push_back(c.skipped);
    summary.step_io_bytes.push_back(io - io_last);
    if (comm != nullptr) {
      summary.step_comm_bytes.push_back(comm->bytes_sent() - sent_last);
      sent_last = comm->bytes_sent();
    }
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
    if (comm != nullptr) TakeRankRows(rank, mine.model.batch * o.model.seq, &inputs, &targets);
    MEMASCEND_RETURN_IF_ERROR(run.Step(inputs, targets, on_commit));
  }
  MEMASCEND_RETURN_IF_ERROR(run.Finish(on_commit));
  // memascend Note [commit interval]: the steps since the last durable one, durable.
  MEMASCEND_RETURN_IF_ERROR(adam->Persist());
  summary.seconds = Since(start);
  summary.final_loss = summary.losses.empty() ? 0 : summary.losses.back();
  summary.skipped_steps = adam->scaler().skipped_steps();
  summary.activation_bytes = run.ActivationBytes();
  summary.phases = run.phases();

  if (o.eval_tokens != nullptr) {
    MEMASCEND_ASSIGN_OR_RETURN(auto eval, run.Evaluate(*o.eval_tokens));
    summary.eval_loss = eval.first;
    summary.eval_tokens = eval.second;
  }
  if (!o.export_dir.empty() && rank != 0) {
    // Note [data parallel]: rank 0 writes; the others give their shards, group by group in
    // the export's order.
    for (std::size_t g = 0; g < GroupCount(o.model); ++g)
      MEMASCEND_RETURN_IF_ERROR(run.Master(g).status());
  } else if (!o.export_dir.empty()) {
    MEMASCEND_RETURN_IF_ERROR(
        ExportHfModel(o.model, o.export_dir, o.export_options,
                      [&run](std::size_t g, std::size_t first, std::size_t count, float* out) {
                        return run.ReadMaster(g, first, count, out);
                      }));
    for (std::size_t g = 0; g < GroupCount(o.model); ++g) {
      summary.export_bytes +=
          GroupParams(o.model, g) * memascend::SafetensorsElementBytes(o.export_options.dtype);
    }
  }
  if (o.sample_tokens > 0 && tokenizer != nullptr) {
    ModelConfig one = o.model;
    one.batch = 1;
    const std::unique_ptr<Network> sampler = MakeNetwork(one, {o.blas, false}, &threads);
    std::vector<std::int32_t> ctx(tokens.begin(), tokens.begin() + 8);
    for (std::int32_t t : ctx) summary.sample += tokenizer->Decode(t);
    std::uint64_t rng = o.seed;
    for (std::size_t i = 0; i < o.sample_tokens; ++i) {
      MEMASCEND_ASSIGN_OR_RETURN(std::int32_t next, run.NextToken(*sampler, ctx, &rng));
      ctx.push_back(next);
      summary.sample += tokenizer->Decode(next);
    }
  }
  summary.io_read_bytes = backend->io_read_bytes();
  summary.io_write_bytes = backend->io_write_bytes();
  summary.store = backend->store_stats();
  summary.ledger = ledger->Snapshot();
  summary.peak_pinned_bytes =
      static_cast<std::uint64_t>(summary.ledger.tier(memascend::Tier::kPinnedHost).reserved_peak);
  summary.peak_rss_bytes = summary.ledger.peak_rss_bytes;
  if (comm != nullptr) MEMASCEND_RETURN_IF_ERROR(GatherRankFigures(*comm, layout, &summary));
  return summary;
}

}  // namespace

absl::StatusOr<TrainSummary> Train(const TrainOptions& options,
                                   const std::vector<std::int32_t>& tokens,
                                   const Tokenizer& tokenizer) {
  return TrainOn(options, tokens, &tokenizer);
}

absl::StatusOr<TrainSummary> Train(const TrainOptions& options,
                                   const std::vector<std::int32_t>& tokens) {
  return TrainOn(options, tokens, nullptr);
}

}  // namespace offload_train
