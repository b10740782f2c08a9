// The training loop: mixed precision (fp16 or bf16 working parameters, fp32 master
// weights and Adam moments, dynamic loss scaling, fused overflow check and Adam), with
// every layer's state either in a TensorStore on a volume (Mode::kOffload) or in
// ordinary memory (Mode::kReference). Both run the same operations in the same order, so
// their losses agree bit for bit.
//
// The machinery of an offloaded step is the SDK's: the versioned training state and its
// commits (memascend/training_state.h: Note [train state versions], [background commit],
// [state layout]) and the offloaded optimizer with its parameter streams
// (memascend/offloaded_optimizer.h: Note [parts], [optimizer overlap], [read-ahead],
// [gradient room], [kept state], [derived parameters]). This file is the model's side:
// the options of a run and its summary. Where each part lives:
//   trainer.cpp        Train(): the checks, the state, the loop over the steps, the figures
//   step.cpp           one step: forward, backward, update, commit (Note [gradient parts])
//   evaluate.cpp       --eval, the master weights for --export, sampling
//   data_parallel.cpp  under mpirun (Note [data parallel])
//   host_budget.cpp    MemAscend's pinned host budget
//   state.h            the layout (Note [derived parameters]) and MemAscend's volume
//   zero_infinity.h    the ZeRO-Infinity baseline (Note [zero rules])
//   run_identity.h     what a volume's run is (Note [run identity])
//
// Thread-safety: one Train() call at a time per volume.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_TRAINER_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_TRAINER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/host_budget.h>
#include <memascend/kernels.h>
#include <memascend/memory_ledger.h>
#include <memascend/tensor_store.h>

#include "checkpoint_io.h"
#include "comm.h"
#include "data.h"
#include "model.h"

namespace offload_train {

enum class Mode { kOffload, kReference };

// Whose host-memory and storage rules an offloaded run follows.
enum class Policy { kMemAscend, kZeroInfinity };

// Which DeepSpeed release's rules the baseline follows (Note [zero rules], zero_infinity.h):
// 0.16.5's, or those 0.19.5 (August 2026) changed: swap buffers page-locked at their exact
// size, and both offloads' pin_memory on by default.
enum class ZeroRelease { k0_16_5, k0_19_5 };
std::string_view ToString(ZeroRelease release) noexcept;

// ZeRO-Infinity's settings, DeepSpeed's defaults (zero_infinity.h, ../shared/guide/ANCHORS.md).
// The pin_memory defaults are 0.16.5's; ZeroDefaults(release) gives a release's.
struct ZeroOptions {
  ZeroRelease release = ZeroRelease::k0_16_5;
  std::size_t param_buffer_count = 5;             // offload_param.buffer_count
  std::uint64_t param_buffer_size = 100'000'000;  // elements; raised to the largest parameter
  std::size_t optimizer_buffer_count = 4;         // offload_optimizer.buffer_count
  std::uint64_t sub_group_size = 1'000'000'000;   // elements
  std::size_t aio_block_bytes = 1u << 20;         // aio.block_size
  std::size_t aio_queue_depth = 8;                // aio.queue_depth: requests in flight
  // DeepSpeed's MIN_AIO_BYTES: a tensor is swapped from max(this, aio_block_bytes) bytes;
  // smaller ones stay in memory.
  std::size_t min_swap_bytes = 1u << 20;
  // offload_param.max_in_cpu (elements): while the 16-bit parameters total at most this,
  // stage 3 keeps them in one pinned buffer and never swaps them; the sub-groups beyond
  // it go to NVMe (zero_infinity.h, Note [zero rules]).
  std::uint64_t max_in_cpu = 1'000'000'000;
  // offload_optimizer.pin_memory: the flat gradient buffer is pinned only when set.
  bool optimizer_pin_memory = false;
  // offload_param.pin_memory: the parameters too small to swap, kept in CPU memory, are
  // pinned (each through torch's allocator) only when set.
  bool param_pin_memory = false;
  // reduce_bucket_size (elements): gradients are partitioned, and their fp32 copies
  // swapped out, a bucket at a time.
  std::uint64_t reduce_bucket_size = 500'000'000;
  // offload_optimizer.pipeline_read / pipeline_write: the next sub-group's states read
  // while one steps / its states written while the next steps. Each sub-group in flight
  // needs four optimizer buffers (8 with one of them, 12 with both).
  bool pipeline_read = false;
  bool pipeline_write = false;
  std::string nvme_path;  // the swap directory (one file per tensor); empty: next to the volume

  // The size from which a tensor is swapped (swappable_tensor's min_aio_bytes).
  std::size_t SwapThresholdBytes() const { return std::max(min_swap_bytes, aio_block_bytes); }
};

// DeepSpeed's defaults under `release`'s rules.
ZeroOptions ZeroDefaults(ZeroRelease release);

// Note [tied head] (run.h): the tied embeddings' rows widened at a time, at most this many
// bytes of fp32 (TrainOptions::tied_chunk_bytes).
constexpr std::size_t kTiedChunkBytes = std::size_t{16} << 20;

struct TrainOptions {
  ModelConfig model;  // the demo's GPT, or a Hugging Face model (ModelConfig::hf)
  // A Hugging Face model directory whose weights the run starts from (model.hf must be its
  // config); empty: the architecture's random initialisation.
  std::string init_from;
  // After the last step: the model (its fp32 master weights) as a Hugging Face directory
  // (ExportHfModel); empty: none.
  std::string export_dir;
  HfExportOptions export_options;
  // After the last step (after the import with steps 0): the mean next-token loss over
  // these token ids, cut into windows of seq + 1 (EvalLoss); null: none.
  std::shared_ptr<const std::vector<std::int32_t>> eval_tokens;
  // The matrix products through OpenBLAS (blas.h): fast, and the same bits only at the
  // same thread count; off, the exact loops (the same bits at any thread count).
  bool blas = false;
  // Keep each block's input only and recompute the block in the backward pass;
  // the inputs go through the tensor store with MemAscend's policy, ordinary memory
  // otherwise (ZeRO-Infinity's cpu_checkpointing).
  bool checkpoint_activations = false;
  memascend::DType dtype = memascend::DType::kF16;  // working parameters and gradients
  Mode mode = Mode::kOffload;
  Policy policy = Policy::kMemAscend;
  ZeroOptions zero;
  // MemAscend: every tensor is stored in parts of this many elements (Note [parts]; a
  // multiple of 2^16, the sum of squares' task size, so results do not depend on it).
  std::size_t optimizer_chunk = 1u << 20;
  // The tied embeddings are widened from 16 bits at most this many bytes of fp32 at a
  // time (Note [tied head] in run.h); a test sets it small to cut them into many chunks.
  std::size_t tied_chunk_bytes = kTiedChunkBytes;
  std::size_t steps = 200;  // total, counting the steps of a run resumed from
  std::uint64_t seed = 1;
  float lr = 3e-3f;
  std::size_t warmup = 20;  // steps of linear learning-rate warm-up
  float weight_decay = 0.0f;
  float clip = 1.0f;  // global gradient norm; 0: no clipping
  float initial_loss_scale = 65536.0f;
  int threads = 0;  // compute threads; 0: all cores
  // Offload only.
  std::string volume_path;         // a file (created) or a block device
  std::uint64_t volume_bytes = 0;  // size of a file volume; 0: what the run needs, doubled
  bool force = false;              // format a device that holds other data
  bool resume = false;             // continue from the volume's last committed step
  std::size_t host_budget = 0;     // pinned bytes; 0: ChooseTrainHostBudget()'s default
  // The budget as ChooseTrainHostBudget() chose it (main prints it before training);
  // unset: Train() chooses it. Its `locked` false holds the budget unlocked.
  std::optional<memascend::HostBudget> host_budget_choice;
  std::size_t window = 1;  // groups prefetched ahead
  // Optimizer state (gradients, master weights, moments) read ahead of the part being
  // updated, in bytes; 0: the host budget less MinimumHostBudget() and keep_bytes, at
  // least 3 parts.
  std::size_t read_ahead_bytes = 0;
  // Optimizer state kept resident from one step to the next (Note [kept state]), in
  // bytes; MemAscend policy, offload mode only. At most the host budget less
  // MinimumHostBudget() (kInvalidArgument otherwise).
  std::size_t keep_bytes = 0;
  // Run each step's optimizer update group by group interleaved with the next step's
  // forward pass (Note [optimizer overlap]); MemAscend policy, offload mode only.
  bool overlap_optimizer = true;
  // The store's prefetch threads: reads (and write-behinds) in flight. With every tensor
  // in parts (Note [parts]) the read-ahead holds many small parts; four threads, two of
  // them often writing, left it short of reads.
  int io_threads = 8;
  // TensorStoreOptions::write_behind: new versions are written as soon as released, so
  // the writes overlap the compute (Note [optimizer overlap]).
  bool write_behind = true;
  // The store's pinned pool in powers of two (PyTorch's caching host allocator's rule),
  // not its adaptive classes: for ablations (bench/frontier.py).
  bool pow2_pool = false;
  // Each gradient part checked for inf/NaN with byte-per-element temporaries, PyTorch's
  // way, not the fused kernel (OffloadedAdamOptions::overflow_check): for ablations.
  bool unfused_overflow_check = false;
  // The state in a directory with a file per tensor (FileObjectStore, ZeRO-Infinity's
  // layout: volume_path names the directory), not a volume: for ablations.
  bool file_per_tensor = false;
  // The state in two versions, each step's written beside the last and committed once a
  // step (as data-parallel ranks keep it; memascend Note [state in place]): for ablations.
  bool two_versions = false;
  // memascend Note [commit interval]: every commit_every-th step durable (the state in
  // place, staged unbounded); the steps between are lost by a crash, never torn.
  std::uint32_t commit_every = 1;
  // memascend Note [gradient write-behind] and [state in place]: a whole step's writes
  // staged, committed once (no batches, no gradients written: the update's writes overlap
  // the next forward and backward passes; the volume is a version larger), rather than
  // 256 MiB of them in flight beyond the state.
  bool stage_whole_step = false;
  std::size_t sample_tokens = 0;  // generate this many tokens at the end
  std::function<void(const struct StepReport&)> on_step;
  memascend::MemoryLedger* ledger = nullptr;  // null: the trainer keeps its own
  // Tests: faults under the volume's I/O engine (EIO, ENOSPC, short transfers).
  std::shared_ptr<memascend::FaultInjector> fault_injector;
  // Note [data parallel] (data_parallel.cpp): this process's rank among several (volume_path's
  // "{rank}" is replaced by the rank); null: one process.
  Communicator* comm = nullptr;
};

struct StepReport {
  std::size_t step = 0;  // 1-based
  std::size_t steps = 0;
  double loss = 0;
  float loss_scale = 0;
  bool skipped = false;  // overflow: the optimizer did not run
  double seconds = 0;
  double tokens_per_second = 0;
  double io_gib_per_second = 0;
  std::uint64_t io_bytes = 0;  // read + written by the store this step
  std::int64_t pinned_bytes = 0;
};

// Where the steps' time went (summed over the steps of a call).
struct PhaseSeconds {
  double forward = 0;  // including the head's backward pass
  double backward = 0;
  double optimizer = 0;  // overflow check, clipping and Adam over every group
  double commit = 0;     // making the new version durable (Flush + checkpoint record)
};

struct TrainSummary {
  std::size_t first_step = 1;  // > 1 for a resumed run
  std::size_t last_step = 0;
  std::vector<double> losses;                // of the steps this call ran
  std::vector<double> step_seconds;          // likewise, each from the previous commit
  std::vector<bool> step_skipped;            // likewise: overflow, no update
  std::vector<std::uint64_t> step_io_bytes;  // likewise: the store's reads and writes
  PhaseSeconds phases;
  double final_loss = 0;
  double seconds = 0;
  std::size_t params = 0;
  std::uint64_t model_state_bytes = 0;  // params + grads (16-bit) + master, m, v (fp32)
  std::uint64_t host_budget = 0;
  std::uint64_t peak_pinned_bytes = 0;
  std::uint64_t peak_rss_bytes = 0;
  std::uint64_t activation_bytes = 0;
  std::uint64_t io_read_bytes = 0;
  std::uint64_t io_write_bytes = 0;
  std::int64_t skipped_steps = 0;
  memascend::LedgerSnapshot ledger;
  // The tensor store's counters (memascend offload runs): how often a use found its
  // tensor read ahead, and how long the trainer waited for its tensors.
  std::optional<memascend::TensorStoreStats> store;
  std::string sample;  // generated text
  // With TrainOptions::eval_tokens: the mean loss and the positions it is over.
  std::optional<double> eval_loss;
  std::uint64_t eval_tokens = 0;
  std::uint64_t export_bytes = 0;  // with TrainOptions::export_dir
  // Note [data parallel]: the ranks, and the payload bytes this rank sent each step.
  int world = 1;
  std::vector<std::uint64_t> step_comm_bytes;
  // On rank 0 of several: every rank's figures, rank by rank.
  struct Rank {
    std::uint64_t peak_rss_bytes = 0;
    std::uint64_t peak_pinned_bytes = 0;
    double mean_step_seconds = 0;
    double comm_bytes_per_step = 0;
    double io_bytes_per_step = 0;
    std::uint64_t state_elements = 0;  // of its shard
  };
  std::vector<Rank> ranks;
};

// The least pinned memory a MemAscend run needs: the optimizer step holds, for one part
// (Note [parts]), its gradient, next parameters, next master weights and moments. A
// budget close to it may fragment (the pool does not move blocks): twice it is safe.
std::size_t MinimumHostBudget(const ModelConfig& c, memascend::DType dtype,
                              std::size_t optimizer_chunk = 1u << 20);
// The pinned host budget of a MemAscend offload run, for rank `rank` of `world`
// (memascend Note [default host budget]): o.host_budget when given (capped at what the
// rank's state can hold; refused past the memory limit or, locked, RLIMIT_MEMLOCK), else
// what the machine leaves beyond WorkingMemoryBytes(), at least the minimum.
absl::StatusOr<memascend::HostBudget> ChooseTrainHostBudget(const TrainOptions& o, int world = 1,
                                                            int rank = 0);
// The run's ordinary (not pinned) memory, estimated from the model: the working buffers
// of a group's parameters (fp32; tied embeddings in 16 bits and a chunk of them widened,
// Note [tied head] in run.h) and gradient, the activations of `batch` sequences (a
// block's input per layer with checkpoint_activations), and 256 MiB of heap. With
// `reads_masters` (--eval, --export on data-parallel ranks, which gather a group whole;
// one process reads ranges) the tied embeddings' master weights whole in fp32, which
// replace their 16 bits while read.
std::uint64_t WorkingMemoryBytes(const ModelConfig& c, std::size_t batch,
                                 bool checkpoint_activations, bool reads_masters = false);
std::size_t OptimizerParts(const ModelConfig& c, std::size_t group, std::size_t optimizer_chunk);
// The most a MemAscend run's store can hold: every stored tensor in both versions (in
// 64 KiB units). A larger --host-budget is capped to it.
std::size_t UsableHostBudget(const ModelConfig& c, memascend::DType dtype,
                             std::size_t optimizer_chunk = 1u << 20);
constexpr std::size_t kOptimizerChunkQuantum = std::size_t{1} << 18;
std::uint64_t ModelStateBytes(const ModelConfig& c, memascend::DType dtype);

// Trains on the tokens of a text (the tokenizer's: samples are decoded with it) ...
absl::StatusOr<TrainSummary> Train(const TrainOptions& options,
                                   const std::vector<std::int32_t>& tokens,
                                   const Tokenizer& tokenizer);
// ... or on token ids (--tokens): each below the model's vocabulary (kInvalidArgument
// naming the first that is not). No samples.
absl::StatusOr<TrainSummary> Train(const TrainOptions& options,
                                   const std::vector<std::int32_t>& tokens);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_TRAINER_H_
