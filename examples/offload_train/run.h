// The training run's machinery, private to the trainer: the working buffers, the stash of
// checkpointed activations, and Run, which drives one model's steps through an
// OffloadedAdam (memascend/offloaded_optimizer.h) whatever stores its state.
//
// Run's members live by job: step.cpp (the forward and backward passes, the update, the
// commits), evaluate.cpp (the master weights, evaluation, sampling), data_parallel.cpp
// (Note [data parallel]: each rank's shard, gathered and reduced).
//
// Thread-safety: one thread (the trainer's) drives a Run.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <fmt/format.h>

#include <memascend/memory_ledger.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/safetensors.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>
#include <memascend/training_state.h>

#include "comm.h"
#include "model.h"
#include "network.h"
#include "trainer.h"

namespace offload_train {

// The fp32 gradient in hand (Note [gradient parts]): a block's (its backward pass makes it
// whole); the embeddings' and the head's are made a block's size at a time.
std::size_t GradientScratchParams(const ModelConfig& c);
// The largest group in the working buffer: with a tied head the embeddings have their own
// (Note [tied head]).
std::size_t WorkingParams(const ModelConfig& c);
// The tied embeddings' rows widened at a time (Note [tied head]): at most `chunk_bytes` of
// fp32, and no more rows than the embeddings' group has.
std::size_t TiedChunkRows(const ModelConfig& c, std::size_t chunk_bytes = kTiedChunkBytes);

// Note [data parallel] (data_parallel.cpp): the ranks' refusals, the newest step every rank
// holds on --resume, this rank's rows of a batch, every rank's figures to rank 0.
absl::Status CheckRanks(const TrainOptions& o, const Communicator& comm, bool volume_per_rank);
absl::Status ResumeOnEveryRank(Communicator& comm, memascend::OffloadedAdam* adam,
                               absl::StatusOr<std::optional<memascend::CommitRecord>>* resumed);
void TakeRankRows(int rank, std::size_t rows, std::vector<std::int32_t>* inputs,
                  std::vector<std::int32_t>* targets);
absl::Status GatherRankFigures(Communicator& comm, const memascend::StateLayout& layout,
                               TrainSummary* out);

// A float array whose pages are not touched until written (no zero fill): the buffers
// sized to the largest group cost resident memory only once a run uses them (an import
// with --steps 0 never touches the working buffers, a gigabyte at Llama-3.2-1B's size).
class FloatBuffer {
 public:
  explicit FloatBuffer(std::size_t n) : p_(n > 0 ? new float[n] : nullptr), n_(n) {}
  float* data() const { return p_.get(); }
  std::size_t size() const { return n_; }

 private:
  std::unique_ptr<float[]> p_;
  std::size_t n_;
};

// Note [tied head]: a tied head multiplies by the embedding matrix, which the forward pass
// loaded (or took from the update) first. It stays in a buffer of its own until the head
// has run, rather than being read (or rounded from the master weights) again: the blocks
// between use the working buffer, sized to the largest of the other groups. That buffer
// holds the embeddings in their stored 16 bits, not in fp32: the embedding and the head
// widen what they read a chunk of rows at a time (MatrixRows, kTiedChunkBytes), which
// gives the fp32 values a whole widened copy would (widening is exact) and, without the
// BLAS, the bits of whole products (ops::VocabForward). At Llama-3.2-1B's shapes the
// fp32 copy was 1 GiB of the step's ordinary memory; the 16-bit one is half of that, and
// the chunk at most 16 MiB. MemAscend's policy never makes the group whole in fp32 on the
// training path: Init makes it a part at a time (InitGroupRange,
// OffloadedAdam::InitializePart; ZeRO-Infinity's parts are whole groups). The master
// weights --eval and --export read are fp32: a process alone reads the tied ones a range
// at a time from the state (OffloadedAdam::ReadStateRange: the evaluation's embedding and
// head through MatrixRows into wr_, with we_ let go, the export a tensor piece at a time),
// so neither holds the group in any width. Data-parallel ranks gather it whole (Master());
// that buffer and we_ are made when used and never held together, so such a read costs
// what the fp32 copy did and training half of it.

// Each block's input between its forward and backward passes, for checkpointed
// activations: scratch tensors in the tensor store (pinned under its budget, on the volume
// beyond it) with MemAscend's policy, ordinary memory otherwise.
class ActivationStash {
 public:
  ActivationStash(memascend::TensorStore* store, std::size_t layers, std::size_t elements)
      : store_(store), elements_(elements), memory_(store == nullptr ? layers : 0) {}

  absl::Status Register(std::size_t layers) {
    if (store_ == nullptr) return absl::OkStatus();
    for (std::size_t l = 0; l < layers; ++l) {
      memascend::TensorSpec spec;
      spec.name = fmt::format("activations.block.{}", l);
      spec.bytes = elements_ * sizeof(float);
      spec.dtype = memascend::DType::kF32;
      spec.shape = {static_cast<std::int64_t>(elements_)};
      spec.use = memascend::Use::kActivations;
      spec.durability = memascend::Durability::kScratch;
      MEMASCEND_ASSIGN_OR_RETURN(memascend::TensorId id, store_->Register(spec));
      ids_.push_back(id);
    }
    return absl::OkStatus();
  }
  absl::Status Put(std::size_t layer, const float* data) {
    if (store_ == nullptr) {
      memory_[layer].assign(data, data + elements_);
      return absl::OkStatus();
    }
    MEMASCEND_ASSIGN_OR_RETURN(memascend::TensorLease lease,
                               store_->AcquireForOverwrite(ids_[layer]));
    std::memcpy(lease.data(), data, elements_ * sizeof(float));
    return absl::OkStatus();
  }
  void Prefetch(std::size_t layer) {
    if (store_ != nullptr) (void)store_->Prefetch(ids_[layer]);
  }
  // Bytes in ordinary memory (without a store).
  std::size_t MemoryBytes() const {
    std::size_t n = 0;
    for (const std::vector<float>& v : memory_) n += v.capacity() * sizeof(float);
    return n;
  }
  // Into `out`, then dropped (its bytes are dead).
  absl::Status Take(std::size_t layer, float* out) {
    if (store_ == nullptr) {
      std::copy(memory_[layer].begin(), memory_[layer].end(), out);
      return absl::OkStatus();
    }
    {
      MEMASCEND_ASSIGN_OR_RETURN(memascend::TensorLease lease, store_->Acquire(ids_[layer]));
      std::memcpy(out, lease.data(), elements_ * sizeof(float));
    }
    return store_->Discard(ids_[layer]);
  }

 private:
  memascend::TensorStore* store_;
  std::size_t elements_;
  std::vector<memascend::TensorId> ids_;
  std::vector<std::vector<float>> memory_;
};

// Mixed-precision training of the model with its state behind an OffloadedAdam.
class Run {
 public:
  // `o.model.batch` is this rank's share of the batch; `shard` (with `comm`) this rank's
  // of the whole layout `whole` (Note [data parallel]); null for one process.
  Run(const TrainOptions& o, memascend::OffloadedAdam* adam, memascend::KernelThreads* threads,
      memascend::MemoryLedger* ledger, ActivationStash* stash,
      const memascend::LayoutShard* shard = nullptr, const memascend::StateLayout* whole = nullptr);

  // Builds the network, which holds a batch's activations: at the first pass, so that a
  // run that only imports or exports never allocates them.
  void MakeNet() {
    if (net_ == nullptr) net_ = MakeNetwork(c_, {o_.blas, stash_ != nullptr}, threads_);
  }

  // The initial state: the architecture's initialisation, or `ckpt`'s weights, read group
  // by group in the checkpoint's dtype (an import holds one group in that dtype).
  absl::Status Init(const memascend::SafetensorsCheckpoint* ckpt);
  void Resume(std::uint64_t step) { step_ = step; }
  // Kept with each commit (Note [run identity]).
  void set_identity(std::string identity) { identity_ = std::move(identity); }

  std::uint64_t step() const { return step_; }
  const PhaseSeconds& phases() const { return phases_; }
  // The network's, and checkpointed inputs kept in ordinary memory; zero before the first
  // pass.
  std::size_t ActivationBytes() const {
    return (net_ != nullptr ? net_->ActivationBytes() : 0) +
           (stash_ != nullptr ? stash_->MemoryBytes() : 0);
  }

  // Group g's fp32 master weights, in its working buffer (the tied embeddings' in a buffer
  // of their own: Note [tied head]), valid until the next call for a group in the same
  // buffer.
  // With several ranks, a collective: each reads its shard, and all are gathered.
  absl::StatusOr<const float*> Master(std::size_t g);
  // Elements [first, first + count) of group g's fp32 master weights into `out`, for an
  // export (once a run, the groups in order): read from the state as asked, with no buffer
  // for the group, and the tied embeddings' 16 bits let go (with several ranks, each group
  // gathered whole by Master() when it or a later one is first asked for, a collective
  // every rank joins in the same order: Note [data parallel]).
  absl::Status ReadMaster(std::size_t g, std::size_t first, std::size_t count, float* out);

  // The mean next-token loss over `tokens` cut into windows of seq + 1 (a partial last
  // window dropped), each predicting its tokens 1..seq from 0..seq-1, in fp32 from the
  // master weights; `batch` windows a pass (the last pass padded with its first window,
  // whose rows are not counted). Passes go group by group in chunks whose residual
  // streams take at most kEvalStreamBytes, so each group's master weights are read once
  // per chunk, not once per pass. Returns {mean, positions}.
  absl::StatusOr<std::pair<double, std::uint64_t>> Evaluate(
      const std::vector<std::int32_t>& tokens);

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
                    const std::vector<std::int32_t>& targets, const CommitFn& on_commit);

  // Runs and commits the pending update, if any (the last step's, when overlapped).
  absl::Status Finish(const CommitFn& on_commit);

  // Forward only, for sampling: the model must be built for batch 1.
  absl::StatusOr<std::int32_t> NextToken(Network& model, const std::vector<std::int32_t>& ctx,
                                         std::uint64_t* rng);

 private:
  // Note [data parallel]: every rank's elements of each group, this rank's first part of
  // each (data_parallel.cpp).
  void InitShards();

  // Where group g's parameters go: the embeddings with a tied head in we_ in their
  // stored dtype, every other group in wf_ in fp32 (Note [tied head]).
  memascend::MutableTensorView Working(std::size_t g) {
    if (g != 0 || !tied_) return {wf_.data(), GroupParams(c_, g), memascend::DType::kF32};
    if (we_ == nullptr) {  // made (again) after a Master(0): Note [tied head]
      master_embed_ = FloatBuffer(0);
      we_.reset(new std::byte[GroupParams(c_, 0) * memascend::SizeOf(param_dtype_)]);
    }
    return {we_.get(), GroupParams(c_, 0), param_dtype_};
  }
  // The embeddings as Embed and Head read them: the tied ones from we_, widened a chunk at
  // a time into wr_; otherwise group 0 whole in wf_ (for Head: none, its own matrix).
  MatrixRows<float> EmbedRows();
  MatrixRows<float> HeadRows() { return tied_ ? EmbedRows() : MatrixRows<float>(); }
  // The tied embeddings' master weights as Head reads them, for an evaluation by one
  // process: a chunk of rows at a time from the state into wr_, in ascending order (Note
  // [tied head]); a failed read is kept in rows_status_, which the caller checks after.
  MatrixRows<float> MasterEmbedRows();
  // ...and as Embed reads them for `tokens`: Embed asks for a row per token, in the
  // tokens' order, and a row read from the state leases its whole part, so a row at a time
  // could read a part from the volume per token. The rows it will ask for (found by a run
  // of Embed whose reads are only recorded) are read first, ascending, a window of at most
  // wr_'s rows at a time, into rows_; the reader then finds them there.
  absl::StatusOr<MatrixRows<float>> MasterEmbedRowsFor(const std::int32_t* tokens);

  // ---- Note [data parallel]: each rank's shard, gathered

  // Every rank's elements of group g, of `element_bytes` each, gathered in place in `data`
  // (which holds the group's elements of that size, this rank's at their place).
  absl::Status Gather(std::size_t g, void* data, std::size_t element_bytes);

  // The group's 16-bit parameters, at the front of `out` (this rank's shard at its place),
  // gathered from every rank; then, where `out` is fp32, widened in place: element i's 16
  // bits lie at bytes [2i, 2i + 2), below its fp32 at [4i, 4i + 4), so converting from the
  // back, a run [a, b) with b - a <= a at a time, never overwrites what is still to be
  // read. (`out` in the stored dtype: the tied embeddings, Note [tied head].)
  absl::Status GatherParameters(std::size_t g, memascend::MutableTensorView out);

  // This rank's group for group g, and where its shard's 16-bit parameters go in `out`
  // (GatherParameters); nullopt where it holds none of the group.
  std::optional<std::pair<std::size_t, memascend::MutableTensorView>> Shard16(
      std::size_t g, memascend::MutableTensorView out);

  // Group g's parameters into `out` (Working(g)): loaded (through `stream`, if given, which
  // prefetches the next groups), or with several ranks, this rank's shard loaded and every
  // rank's gathered.
  absl::Status LoadInto(std::size_t g, memascend::MutableTensorView out,
                        memascend::ParameterStream* stream);

  // The previous step's update of group g, its new parameters into `out` (Working(g)); with
  // several ranks, this rank's shard updated and every rank's gathered.
  absl::Status UpdateInto(std::size_t g, memascend::MutableTensorView out);

  // Prefetches the window after group g in `direction`: one process's stream, or this
  // rank's groups among the next `window`.
  void PrefetchAfter(memascend::ParameterStream& stream, std::size_t g,
                     memascend::ParameterStream::Direction d);

  // Adds the time since the last call to `*total` (if given).
  void Lap(double* total) {
    const auto now = std::chrono::steady_clock::now();
    if (total != nullptr) *total += std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }

  // Starts committing the pending step (memascend Note [background commit]); it is
  // reported once durable, by Settle().
  absl::Status CommitPending(const CommitFn& on_commit);
  // Waits for the commit in progress, if any, and reports its step.
  absl::Status Settle(const CommitFn& on_commit);

  // The group's fp32 gradient (scaled) into its stored gradient, part by part; the
  // optimizer checks each part for overflow and adds it to the norm.
  absl::Status StoreGrad(std::size_t g);

  // Note [data parallel]: each part of the whole group's fp32 gradient (this rank's rows'),
  // made whole in df_ (a block's is there already), reduced to the part's owner, which
  // stores it.
  absl::Status StoreGradSharded(std::size_t g);

  void Sample(std::size_t g, const char* phase) {
    if (ledger_ != nullptr) ledger_->Sample(fmt::format("{}.{}", phase, GroupName(c_, g)));
  }

  TrainOptions o_;
  ModelConfig c_;
  memascend::OffloadedAdam* adam_;
  memascend::KernelThreads* threads_;
  memascend::MemoryLedger* ledger_;
  bool overlap_;  // memascend Note [optimizer overlap]
  bool tied_;     // Note [tied head]
  // Note [data parallel]: this rank's shard of the whole layout, every rank's elements of
  // each group, this rank's first part of each; null / empty for one process.
  const memascend::LayoutShard* shard_;
  const memascend::StateLayout* whole_;
  Communicator* comm_;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> ranges_;
  std::vector<std::size_t> first_part_;
  std::vector<std::size_t> global_;  // per group of this rank's layout: the model's group
  memascend::ParameterStream forward_, backward_;
  std::unique_ptr<Network> net_;
  ActivationStash* stash_;        // null: activations not checkpointed
  FloatBuffer wf_;                // one group's parameters in fp32
  memascend::DType param_dtype_;  // the stored parameters'
  // With a tied head (Note [tied head]): the embeddings in 16 bits, a chunk of their rows
  // widened, and their master weights for Master(0); we_ and master_embed_ are made when
  // used, never both at once.
  std::unique_ptr<std::byte[]> we_;
  FloatBuffer wr_;
  FloatBuffer master_embed_;
  absl::Status rows_status_;              // MasterEmbedRows' first failed read
  std::vector<std::size_t> wanted_;       // MasterEmbedRowsFor's rows, ascending
  std::vector<float> rows_;               // ...and their master weights
  std::size_t gathered_ = 0;              // ReadMaster, with several ranks: groups gathered
  const float* gathered_data_ = nullptr;  // ...and the last one's weights
  FloatBuffer df_;                        // a gradient in fp32 (Note [gradient parts])
  FloatBuffer block_in_;                  // a checkpointed block's input
  PhaseSeconds phases_;
  std::chrono::steady_clock::time_point mark_ = std::chrono::steady_clock::now();
  std::uint64_t step_ = 0;               // the last step committed
  std::string identity_;                 // Note [run identity]
  std::optional<Committed> pending_;     // computed, not yet committed
  std::optional<Committed> committing_;  // committed, not yet known durable nor reported
};

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_H_
