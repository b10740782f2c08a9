#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
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
#include "blas.h"
#include "network.h"
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

// An order-dependent digest of token ids (the data of a --tokens run).
std::uint64_t TokensFingerprint(const std::vector<std::int32_t>& tokens) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::int32_t t : tokens) h = (h ^ static_cast<std::uint32_t>(t)) * 1099511628211ull;
  return h;
}

std::uint64_t Fingerprint(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens) {
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
  if (o.model.hf.has_value()) {
    for (char ch : HfConfigJson(*o.model.hf, "")) mix(static_cast<unsigned char>(ch));
  }
  mix(data);
  mix(corpus_tokens);
  mix(kLayoutVersion);
  return h;
}

// Note [run identity]: what the fingerprint digests, as "key=value" lines, kept in each
// commit record's caller bytes, so that a refused --resume says what differs rather than
// that a digest does.
std::string RunIdentity(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens,
                        int world) {
  std::string out;
  const auto add = [&out](std::string_view key, const auto& value) {
    out += fmt::format("{}={}\n", key, value);
  };
  if (o.model.hf.has_value()) {
    const HfConfig& h = *o.model.hf;
    add("model", h.arch == Arch::kLlama ? "llama" : "gpt2");
    add("hidden_size", h.hidden);
    add("num_hidden_layers", h.layers);
    add("num_attention_heads", h.heads);
    add("vocab_size", h.vocab);
    add("parameters", h.ParameterCount());
  } else {
    add("vocab", o.model.vocab);
    add("channels", o.model.channels);
    add("layers", o.model.layers);
    add("heads", o.model.heads);
  }
  add("seq", o.model.seq);
  add("batch", o.model.batch);
  add("dtype", o.dtype == memascend::DType::kBF16 ? "bf16" : "fp16");
  add("seed", o.seed);
  add("lr", o.lr);
  add("warmup", o.warmup);
  add("weight_decay", o.weight_decay);
  add("clip", o.clip);
  add("loss_scale", o.initial_loss_scale);
  add("optimizer_chunk", o.optimizer_chunk);
  add("data", fmt::format("{} tokens, digest {:#x}", corpus_tokens, data));
  add("ranks", world);
  return out;
}

// "layers: 1 on the volume, 2 in this run; ..." from the record `name` on the volume and
// this run's identity; empty when the record is missing or carries none.
std::string RunDifference(memascend::ObjectStore* volume, const std::string& name,
                          const std::string& ours) {
  if (volume == nullptr) return {};
  auto info = volume->Stat(name);
  if (!info.ok()) return {};
  std::string bytes(info->size, '\0');
  if (!volume->Get(name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).ok())
    return {};
  auto record = memascend::DecodeCommitRecord(bytes);
  if (!record.ok() || record->user.empty()) return {};
  const auto parse = [](const std::string& text) {
    std::map<std::string, std::string> m;
    std::size_t at = 0;
    while (at < text.size()) {
      std::size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(at, end - at);
      if (const std::size_t eq = line.find('='); eq != std::string::npos)
        m[line.substr(0, eq)] = line.substr(eq + 1);
      at = end + 1;
    }
    return m;
  };
  const std::map<std::string, std::string> theirs = parse(record->user), mine = parse(ours);
  std::string out;
  for (const auto& [key, value] : mine) {
    auto it = theirs.find(key);
    const std::string was = it == theirs.end() ? "none" : it->second;
    if (was == value) continue;
    out += fmt::format("{}{}: {} on the volume, {} in this run", out.empty() ? "" : "; ", key,
                       was, value);
  }
  for (const auto& [key, value] : theirs) {
    if (!mine.count(key))
      out += fmt::format("{}{}: {} on the volume, none in this run", out.empty() ? "" : "; ", key,
                         value);
  }
  return out;
}

// Note [gradient parts]: the fp32 gradient in hand, a block's (its backward pass makes it
// whole); the embeddings' and the head's are made a block's size at a time.
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
// between use the working buffer, sized to the largest of the other groups.

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
      spec.dtype = DType::kF32;
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
  Run(const TrainOptions& o, OffloadedAdam* adam, memascend::KernelThreads* threads,
      memascend::MemoryLedger* ledger, ActivationStash* stash,
      const memascend::LayoutShard* shard = nullptr, const StateLayout* whole = nullptr)
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
        we_(tied_ ? GroupParams(o.model, 0) : 0),
        df_(std::max(GradientScratchParams(o.model),
                     whole != nullptr ? whole->MaxPartElements() : std::size_t{0})),
        block_in_(stash != nullptr ? o.model.batch * o.model.seq * o.model.channels : 0) {
    if (shard_ == nullptr) return;
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

  // Builds the network, which holds a batch's activations: at the first pass, so that a
  // run that only imports or exports never allocates them.
  void MakeNet() {
    if (net_ == nullptr) net_ = MakeNetwork(c_, {o_.blas, stash_ != nullptr}, threads_);
  }

  // The initial state: the architecture's initialisation, or `ckpt`'s weights, read group
  // by group in the checkpoint's dtype (an import holds one group in that dtype).
  absl::Status Init(const memascend::SafetensorsCheckpoint* ckpt) {
    std::vector<std::byte> raw;
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
        float* w = Working(g);
        InitGroup(c_, g, o_.seed, w);
        MEMASCEND_RETURN_IF_ERROR(adam_->Initialize(*local, {w + begin, count}));
      }
    }
    raw = {};
    step_ = 0;
    return adam_->Commit(0, identity_);
  }
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

  // Group g's fp32 master weights, in its working buffer (valid until the next call).
  // With several ranks, a collective: each reads its shard, and all are gathered.
  absl::StatusOr<const float*> Master(std::size_t g) {
    float* w = Working(g);
    if (shard_ == nullptr) {
      MEMASCEND_RETURN_IF_ERROR(
          adam_->ReadState(memascend::StateKind::kMaster, g, {w, GroupParams(c_, g), DType::kF32}));
      return w;
    }
    if (const auto local = shard_->local[g]) {
      const auto [b, e] = shard_->range[g];
      MEMASCEND_RETURN_IF_ERROR(
          adam_->ReadState(memascend::StateKind::kMaster, *local, {w + b, e - b, DType::kF32}));
    }
    MEMASCEND_RETURN_IF_ERROR(Gather(g, w, sizeof(float)));
    return w;
  }

  // The mean next-token loss over `tokens` cut into windows of seq + 1 (a partial last
  // window dropped), each predicting its tokens 1..seq from 0..seq-1, in fp32 from the
  // master weights; `batch` windows a pass (the last pass padded with its first window,
  // whose rows are not counted). Passes go group by group in chunks whose residual
  // streams take at most kEvalStreamBytes, so each group's master weights are read once
  // per chunk, not once per pass. Returns {mean, positions}.
  absl::StatusOr<std::pair<double, std::uint64_t>> Evaluate(
      const std::vector<std::int32_t>& tokens) {
    const std::size_t seq = c_.seq, batch = c_.batch, groups = GroupCount(c_);
    const std::size_t windows = tokens.size() / (seq + 1);
    if (windows == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "--eval: {} tokens, fewer than one window of --seq + 1 = {}", tokens.size(), seq + 1));
    }
    MakeNet();
    constexpr std::size_t kEvalStreamBytes = std::size_t{256} << 20;
    const std::size_t stream = batch * seq * c_.channels;  // one pass's residual stream
    const std::size_t passes = (windows + batch - 1) / batch;
    const std::size_t per_chunk = std::max<std::size_t>(1, kEvalStreamBytes / (stream * 4));
    std::vector<std::int32_t> inputs(batch * seq), targets(batch * seq);
    // Pass p's windows into inputs/targets; returns how many are real.
    const auto fill = [&](std::size_t p) {
      const std::size_t first = p * batch, n = std::min(batch, windows - first);
      for (std::size_t b = 0; b < batch; ++b) {
        const std::int32_t* w = tokens.data() + (first + (b < n ? b : 0)) * (seq + 1);
        std::copy(w, w + seq, inputs.begin() + static_cast<std::ptrdiff_t>(b * seq));
        std::copy(w + 1, w + seq + 1, targets.begin() + static_cast<std::ptrdiff_t>(b * seq));
      }
      return n;
    };
    // Note [data parallel]: each rank takes its run of the passes; every rank reads (and
    // gathers) the master weights as often as the rank with the most.
    const std::size_t world = shard_ != nullptr ? static_cast<std::size_t>(shard_->world) : 1;
    const std::size_t rank = shard_ != nullptr ? static_cast<std::size_t>(shard_->rank) : 0;
    const std::size_t lo = passes * rank / world, mine = passes * (rank + 1) / world - lo;
    const std::size_t most = (passes + world - 1) / world;
    std::vector<float> streams;
    double sum = 0;
    for (std::size_t chunk = 0; chunk < most; chunk += per_chunk) {
      const std::size_t k = chunk < mine ? std::min(per_chunk, mine - chunk) : 0;
      streams.resize(k * stream);
      for (std::size_t g = 0; g < groups; ++g) {
        MEMASCEND_ASSIGN_OR_RETURN(const float* w, Master(g));
        for (std::size_t p = 0; p < k; ++p) {
          const std::size_t n = fill(lo + chunk + p);
          float* kept = streams.data() + p * stream;
          if (g == 0) {
            net_->Embed(w, inputs.data());
          } else {
            net_->SetResidual(kept);
            if (g + 1 < groups) {
              net_->Block(g - 1, w);
            } else {
              net_->Head(w, tied_ ? we_.data() : nullptr, targets.data(), 1.0f,
                         /*backward=*/false);
              const float* rows = net_->RowLosses();
              for (std::size_t r = 0; r < n * seq; ++r) sum += static_cast<double>(rows[r]);
              continue;
            }
          }
          std::copy(net_->Residual(), net_->Residual() + stream, kept);
        }
      }
    }
    if (comm_ != nullptr) {
      double all[] = {sum};
      MEMASCEND_RETURN_IF_ERROR(comm_->AllReduceSum(all));
      sum = all[0];
    }
    const std::uint64_t positions = static_cast<std::uint64_t>(windows) * seq;
    return std::make_pair(sum / static_cast<double>(positions), positions);
  }

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
      const MutableTensorView working{Working(g), GroupParams(c_, g), DType::kF32};
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
        net_->Embed(Working(0), inputs.data());
      } else if (g < head) {
        if (stash_ != nullptr) MEMASCEND_RETURN_IF_ERROR(stash_->Put(g - 1, net_->Residual()));
        net_->Block(g - 1, wf_.data());
      } else {
        loss = net_->Head(wf_.data(), tied_ ? we_.data() : nullptr, targets.data(), grad_scale,
                          /*backward=*/true);
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
    MEMASCEND_RETURN_IF_ERROR(adam_->UpdateAll([this](std::size_t g) {
      Sample(shard_ != nullptr ? global_[g] : g, "opt");  // g: the optimizer's group
    }));
    Lap(&phases_.optimizer);
    MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    Lap(&phases_.commit);
    return absl::OkStatus();
  }

  // Forward only, for sampling: the model must be built for batch 1.
  absl::StatusOr<std::int32_t> NextToken(Network& model, const std::vector<std::int32_t>& ctx,
                                         std::uint64_t* rng) {
    const std::size_t groups = GroupCount(c_);
    std::vector<std::int32_t> window(c_.seq, 0);
    const std::size_t n = std::min(ctx.size(), c_.seq);
    std::copy(ctx.end() - static_cast<std::ptrdiff_t>(n), ctx.end(), window.begin());
    for (std::size_t g = 0; g < groups; ++g) {
      MEMASCEND_RETURN_IF_ERROR(
          LoadInto(g, {Working(g), GroupParams(c_, g), DType::kF32}, nullptr));
      if (g == 0) {
        model.Embed(Working(0), window.data());
      } else if (g + 1 < groups) {
        model.Block(g - 1, wf_.data());
      } else {
        model.Head(wf_.data(), tied_ ? we_.data() : nullptr, window.data(), 1.0f,
                   /*backward=*/false);
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
  // Where group g's fp32 parameters go (Note [tied head]).
  float* Working(std::size_t g) { return g == 0 && tied_ ? we_.data() : wf_.data(); }

  // ---- Note [data parallel]: each rank's shard, gathered

  // Every rank's elements of group g, of `element_bytes` each, gathered in place in `data`
  // (which holds the group's elements of that size, this rank's at their place).
  absl::Status Gather(std::size_t g, void* data, std::size_t element_bytes) {
    const std::size_t world = ranges_[g].size();
    std::vector<std::size_t> counts(world), offsets(world);
    for (std::size_t r = 0; r < world; ++r) {
      offsets[r] = ranges_[g][r].first;
      counts[r] = ranges_[g][r].second - ranges_[g][r].first;
    }
    return comm_->AllGather(data, element_bytes, counts, offsets);
  }

  // The group's 16-bit parameters, at the front of the fp32 buffer `out` (this rank's
  // shard at its place), gathered from every rank, then widened to fp32 in place: element
  // i's 16 bits lie at bytes [2i, 2i + 2), below its fp32 at [4i, 4i + 4), so converting
  // from the back, a run [a, b) with b - a <= a at a time, never overwrites what is still
  // to be read.
  absl::Status GatherParameters(std::size_t g, float* out) {
    const DType d = adam_->layout().param_dtype;
    auto* bytes = reinterpret_cast<std::byte*>(out);
    MEMASCEND_RETURN_IF_ERROR(Gather(g, bytes, memascend::SizeOf(d)));
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

  // This rank's group for group g, and where its shard's 16-bit parameters go in the fp32
  // buffer `f` (GatherParameters); nullopt where it holds none of the group.
  std::optional<std::pair<std::size_t, MutableTensorView>> Shard16(std::size_t g, float* f) {
    const auto local = shard_->local[g];
    if (!local.has_value()) return std::nullopt;
    const DType d = adam_->layout().param_dtype;
    const auto [b, e] = shard_->range[g];
    return std::pair{
        *local,
        MutableTensorView{reinterpret_cast<std::byte*>(f) + b * memascend::SizeOf(d), e - b, d}};
  }

  // Group g's parameters into `out` (fp32): loaded (through `stream`, if given, which
  // prefetches the next groups), or with several ranks, this rank's shard loaded and every
  // rank's gathered.
  absl::Status LoadInto(std::size_t g, MutableTensorView out, ParameterStream* stream) {
    if (shard_ == nullptr) {
      return stream != nullptr ? stream->Load(g, out, ParameterStream::Direction::kReverse)
                               : adam_->LoadParameters(g, out);
    }
    if (stream != nullptr) PrefetchAfter(*stream, g, ParameterStream::Direction::kReverse);
    auto* f = static_cast<float*>(out.data);
    if (const auto mine = Shard16(g, f))
      MEMASCEND_RETURN_IF_ERROR(adam_->LoadParameters(mine->first, mine->second));
    return GatherParameters(g, f);
  }

  // The previous step's update of group g, its new parameters into `out` (fp32); with
  // several ranks, this rank's shard updated and every rank's gathered.
  absl::Status UpdateInto(std::size_t g, MutableTensorView out) {
    if (shard_ == nullptr) return adam_->UpdateGroup(g, out);
    auto* f = static_cast<float*>(out.data);
    if (const auto mine = Shard16(g, f))
      MEMASCEND_RETURN_IF_ERROR(adam_->UpdateGroup(mine->first, mine->second));
    return GatherParameters(g, f);
  }

  // Prefetches the window after group g in `direction`: one process's stream, or this
  // rank's groups among the next `window`.
  void PrefetchAfter(ParameterStream& stream, std::size_t g, ParameterStream::Direction d) {
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
    MEMASCEND_RETURN_IF_ERROR(adam_->CommitAsync(pending_->step, identity_).status());
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
      // Note [data parallel]: the step is committed once every rank's shard of it is
      // durable; no rank writes the version it superseded before.
      if (comm_ != nullptr) MEMASCEND_RETURN_IF_ERROR(comm_->Barrier());
      const Committed c = *committing_;
      committing_.reset();
      if (on_commit) on_commit(c);
    }
    return absl::OkStatus();
  }

  // The group's fp32 gradient (scaled) into its stored gradient, part by part; the
  // optimizer checks each part for overflow and adds it to the norm.
  absl::Status StoreGrad(std::size_t g) {
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

  // Note [data parallel]: each part of the whole group's fp32 gradient (this rank's rows'),
  // made whole in df_ (a block's is there already), reduced to the part's owner, which
  // stores it.
  absl::Status StoreGradSharded(std::size_t g) {
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
      MEMASCEND_RETURN_IF_ERROR(
          adam_->WriteGradient(*shard_->local[g], part - first_part_[g], fill));
    }
    return absl::OkStatus();
  }

  void Sample(std::size_t g, const char* phase) {
    if (ledger_ != nullptr) ledger_->Sample(fmt::format("{}.{}", phase, GroupName(c_, g)));
  }

  TrainOptions o_;
  ModelConfig c_;
  OffloadedAdam* adam_;
  memascend::KernelThreads* threads_;
  memascend::MemoryLedger* ledger_;
  bool overlap_;  // memascend Note [optimizer overlap]
  bool tied_;     // Note [tied head]
  // Note [data parallel]: this rank's shard of the whole layout, every rank's elements of
  // each group, this rank's first part of each; null / empty for one process.
  const memascend::LayoutShard* shard_;
  const StateLayout* whole_;
  Communicator* comm_;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> ranges_;
  std::vector<std::size_t> first_part_;
  std::vector<std::size_t> global_;  // per group of this rank's layout: the model's group
  ParameterStream forward_, backward_;
  std::unique_ptr<Network> net_;
  ActivationStash* stash_;  // null: activations not checkpointed
  FloatBuffer wf_;          // one group's parameters in fp32
  FloatBuffer we_;          // the embeddings', with a tied head (Note [tied head])
  FloatBuffer df_;          // a gradient in fp32 (Note [gradient parts])
  FloatBuffer block_in_;    // a checkpointed block's input
  PhaseSeconds phases_;
  Clock::time_point mark_ = Clock::now();
  std::uint64_t step_ = 0;               // the last step committed
  std::string identity_;                 // Note [run identity]
  std::optional<Committed> pending_;     // computed, not yet committed
  std::optional<Committed> committing_;  // committed, not yet known durable nor reported
};

}  // namespace

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
                                 bool checkpoint_activations) {
  // The trainer's working buffers (Run: wf_, we_, df_), fp32.
  std::uint64_t floats =
      WorkingParams(c) + (TiedHead(c) ? GroupParams(c, 0) : 0) + GradientScratchParams(c);
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
  want.maximum_bytes = memascend::VersionedTrainingState::StoredBytes(parted);
  want.other_bytes = WorkingMemoryBytes(o.model, o.model.batch / static_cast<std::size_t>(world),
                                        o.checkpoint_activations);
  // The store has no GPU tier: the budget is mlock'ed (TensorStoreOptions::host_backing).
  want.backing = memascend::HostBackingKind::kMlock;
  want.given_bytes = o.host_budget;
  return memascend::ChooseHostBudget(want);
}

namespace {

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
  if (tokens.size() < o.model.seq + 2) {
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
  // Note [data parallel]: this process's rank, its share of the batch and of the state.
  Communicator* comm = o.comm != nullptr && o.comm->size() > 1 ? o.comm : nullptr;
  const int world = comm != nullptr ? comm->size() : 1;
  const int rank = comm != nullptr ? comm->rank() : 0;
  const bool volume_per_rank = o.volume_path.find("{rank}") != std::string::npos;
  for (std::size_t at; (at = o.volume_path.find("{rank}")) != std::string::npos;)
    o.volume_path.replace(at, 6, std::to_string(rank));
  if (comm != nullptr) {
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
    if (MemAscendOffload(o) && comm->local_size() > 1 && !volume_per_rank) {
      return absl::InvalidArgumentError(fmt::format(
          "--volume {}: {} ranks run on this host and each needs a volume of its own: put "
          "{{rank}} in the path (it becomes the rank's number)",
          o.volume_path, comm->local_size()));
    }
  }
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
    if (o.host_budget == 0) o.host_budget = 2 * OffloadedAdam::MinimumHostBudget(parted);
    // A budget beyond what the store can ever hold (every stored tensor, both versions) is
    // capped there: the rest would be page-locked for nothing (UsableHostBudget).
    o.host_budget = std::min<std::size_t>(o.host_budget,
                                          memascend::VersionedTrainingState::StoredBytes(parted));
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
          RunIdentity(o, tokenizer != nullptr ? tokenizer->Fingerprint() : TokensFingerprint(tokens),
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
  const std::string identity = RunIdentity(
      o, tokenizer != nullptr ? tokenizer->Fingerprint() : TokensFingerprint(tokens), tokens.size(),
      world);
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
    if (comm != nullptr) {
      // Note [data parallel]: the newest step every rank holds; a rank one step ahead goes
      // back to it (its previous commit is whole).
      std::uint64_t v[] = {last.ok() ? 1u : 0u, last.ok() ? (**last).step : 0};
      const absl::Status reduced = comm->AllReduceMin(v);
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
    }
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
    if (comm != nullptr) {  // this rank's rows
      const std::size_t rows = mine.model.batch * o.model.seq;
      const auto first = static_cast<std::ptrdiff_t>(rows * static_cast<std::size_t>(rank));
      inputs.assign(inputs.begin() + first,
                    inputs.begin() + first + static_cast<std::ptrdiff_t>(rows));
      targets.assign(targets.begin() + first,
                     targets.begin() + first + static_cast<std::ptrdiff_t>(rows));
    }
    MEMASCEND_RETURN_IF_ERROR(run.Step(inputs, targets, on_commit));
  }
  MEMASCEND_RETURN_IF_ERROR(run.Finish(on_commit));
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
    MEMASCEND_RETURN_IF_ERROR(ExportHfModel(o.model, o.export_dir, o.export_options,
                                            [&run](std::size_t g) { return run.Master(g); }));
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
  if (comm != nullptr) {
    // Every rank's figures to rank 0.
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
    MEMASCEND_RETURN_IF_ERROR(comm->GatherToRoot(figures, all));
    for (std::size_t r = 0; rank == 0 && r < static_cast<std::size_t>(world); ++r) {
      const double* f = all.data() + r * kFigures;
      summary.ranks.push_back({static_cast<std::uint64_t>(f[0]), static_cast<std::uint64_t>(f[1]),
                               f[2], f[3], f[4], static_cast<std::uint64_t>(f[5])});
    }
  }
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
