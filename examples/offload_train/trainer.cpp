#include "trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <sys/stat.h>
#include <thread>

#include <fmt/format.h>

#include <memascend/status.h>
#include <memascend/volume.h>

#include "backend.h"
#include "zero_backend.h"

namespace offload_train {
namespace {

using memascend::DType;
using memascend::TensorId;
using memascend::TensorLease;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

constexpr std::array<Kind, 5> kKinds = {Kind::kParam, Kind::kGrad, Kind::kMaster, Kind::kExpAvg,
                                        Kind::kExpAvgSq};
const char* KindName(Kind k) {
  switch (k) {
    case Kind::kParam:
      return "param";
    case Kind::kGrad:
      return "grad";
    case Kind::kMaster:
      return "master";
    case Kind::kExpAvg:
      return "exp_avg";
    case Kind::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}
bool Versioned(Kind k) { return k != Kind::kGrad; }
// Whether a MemAscend volume holds this kind of group `g`: not the 16-bit parameters of
// the embedding and the head (Note [derived parameters] in trainer.h).
bool Stored(const GptConfig& c, Kind k, std::size_t g) {
  return k != Kind::kParam || (g != 0 && g + 1 != GroupCount(c));
}
std::size_t ElementBytes(Kind k, DType dtype) {
  return (k == Kind::kParam || k == Kind::kGrad) ? memascend::SizeOf(dtype) : 4;
}
memascend::Use UseOf(Kind k) {
  switch (k) {
    case Kind::kParam:
      return memascend::Use::kParameters;
    case Kind::kGrad:
      return memascend::Use::kGradients;
    default:
      return memascend::Use::kOptimizerState;
  }
}

std::string Encode(const Checkpoint& c) {
  return fmt::format(
      "step={};version={};adam_step={};scale={:a};good={};hysteresis={};skipped={};"
      "fingerprint={}",
      c.step, c.version, c.adam_step, c.scaler.scale, c.scaler.good_steps, c.scaler.hysteresis_left,
      c.scaler.skipped, c.fingerprint);
}

absl::StatusOr<Checkpoint> Decode(const std::string& text) {
  Checkpoint c;
  int fields = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t end = std::min(text.find(';', pos), text.size());
    const std::string kv = text.substr(pos, end - pos);
    pos = end + 1;
    const std::size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    ++fields;
    if (k == "step")
      c.step = std::stoull(v);
    else if (k == "version")
      c.version = std::stoi(v);
    else if (k == "adam_step")
      c.adam_step = std::stoll(v);
    else if (k == "scale")
      c.scaler.scale = std::strtof(v.c_str(), nullptr);
    else if (k == "good")
      c.scaler.good_steps = std::stoll(v);
    else if (k == "hysteresis")
      c.scaler.hysteresis_left = std::stoi(v);
    else if (k == "skipped")
      c.scaler.skipped = std::stoll(v);
    else if (k == "fingerprint")
      c.fingerprint = std::stoull(v);
    else
      --fields;
  }
  if (fields != 8 || (c.version != 0 && c.version != 1))
    return absl::DataLossError(fmt::format("checkpoint record unreadable: '{}'", text));
  return c;
}

// What the volume's tensors are (2: every kind in parts, Note [parts] in trainer.h; 3: no
// 16-bit parameters of the embedding and the head, Note [derived parameters]); a volume
// of another layout is not resumed.
constexpr std::uint64_t kLayoutVersion = 3;

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

// [begin, end) elements of part `part` of group `g` (every kind alike).
std::pair<std::size_t, std::size_t> PartRange(const GptConfig& c, std::size_t g, std::size_t part,
                                              std::size_t chunk) {
  const std::size_t n = GroupParams(c, g);
  return {std::min(n, part * chunk), std::min(n, (part + 1) * chunk)};
}

class ReferenceBackend final : public Backend {
 public:
  ReferenceBackend(const GptConfig& c, DType dtype, std::size_t chunk)
      : c_(c), dtype_(dtype), chunk_(chunk) {
    for (Kind k : kKinds) {
      for (std::size_t g = 0; g < GroupCount(c); ++g)
        state_[static_cast<int>(k)].emplace_back(GroupParams(c, g) * ElementBytes(k, dtype));
    }
  }
  absl::StatusOr<Buf> Read(Kind k, std::size_t g, std::size_t part, bool) override {
    return At(k, g, part);  // one version, updated in place
  }
  absl::StatusOr<Buf> Overwrite(Kind k, std::size_t g, std::size_t part, bool) override {
    return At(k, g, part);
  }
  absl::StatusOr<Buf> Update(Kind k, std::size_t g, std::size_t part) override {
    return At(k, g, part);
  }
  void Prefetch(Kind, std::size_t, std::size_t) override {}
  absl::Status Discard(Kind, std::size_t, std::size_t) override { return absl::OkStatus(); }
  absl::Status Commit(const Checkpoint&) override { return absl::OkStatus(); }
  absl::StatusOr<std::optional<Checkpoint>> Load() override { return std::nullopt; }
  std::uint64_t IoReadBytes() const override { return 0; }
  std::uint64_t IoWriteBytes() const override { return 0; }

 private:
  Buf At(Kind k, std::size_t g, std::size_t part) {
    auto& v = state_[static_cast<int>(k)][g];
    const auto [begin, end] = PartRange(c_, g, part, chunk_);
    Buf b;
    b.data = v.data() + begin * ElementBytes(k, dtype_);
    b.bytes = (end - begin) * ElementBytes(k, dtype_);
    return b;
  }
  GptConfig c_;
  DType dtype_;
  std::size_t chunk_;
  std::array<std::vector<std::vector<std::byte>>, kKinds.size()> state_;
};

constexpr const char* kCheckpointName = "train.checkpoint";

class OffloadBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<OffloadBackend>> Open(const TrainOptions& o,
                                                              memascend::MemoryLedger* ledger) {
    auto b = std::unique_ptr<OffloadBackend>(new OffloadBackend());
    MEMASCEND_RETURN_IF_ERROR(b->OpenVolume(o));
    memascend::TensorStoreOptions so;
    so.host_budget_bytes = o.host_budget;
    so.prefetch_threads = o.io_threads;
    // Every new version is written back before the step commits anyway: write it at
    // once, overlapping the compute, so evictions find clean tensors.
    so.write_behind = o.write_behind;
    // The read-ahead never waits on its tickets, and holds more than the room left while
    // the gradients are resident (Note [gradient room]): its reads wait for room.
    so.defer_prefetches = true;
    so.ledger = ledger;
    // This trainer computes on the CPU: its pinned memory needs no CUDA registration,
    // whose CUDA context would add about 100 MiB to the RSS on a GPU machine (as
    // ZeroBackend's buffers, mlock'ed as DeepSpeed's newest releases do).
    so.host_backing = memascend::ArenaBacking::kMlock;
    MEMASCEND_ASSIGN_OR_RETURN(b->store_, memascend::TensorStore::Open(b->volume_.get(), so));
    for (Kind k : kKinds) {
      auto& ids = b->ids_[static_cast<int>(k)];
      ids.resize(GroupCount(o.model));
      for (std::size_t g = 0; g < GroupCount(o.model); ++g) {
        if (!Stored(o.model, k, g)) continue;
        const std::size_t parts = OptimizerParts(o.model, g, o.optimizer_chunk);
        for (std::size_t part = 0; part < parts; ++part) {
          for (int v = 0; v < (Versioned(k) ? 2 : 1); ++v) {
            const auto [begin, end] = PartRange(o.model, g, part, o.optimizer_chunk);
            memascend::TensorSpec spec;
            spec.name = fmt::format("{}.{}.p{}{}", GroupName(o.model, g), KindName(k), part,
                                    Versioned(k) ? fmt::format(".v{}", v) : "");
            spec.dtype = ElementBytes(k, o.dtype) == 4 ? DType::kF32 : o.dtype;
            spec.bytes = (end - begin) * ElementBytes(k, o.dtype);
            spec.shape = {static_cast<std::int64_t>(end - begin)};
            spec.use = UseOf(k);
            spec.durability =
                Versioned(k) ? memascend::Durability::kDurable : memascend::Durability::kScratch;
            MEMASCEND_ASSIGN_OR_RETURN(TensorId id, b->store_->Register(spec));
            ids[g].push_back(id);
          }
        }
      }
    }
    return b;
  }

  ~OffloadBackend() override {
    (void)Settle();
    store_.reset();  // before the volume
  }

  absl::StatusOr<Buf> Read(Kind k, std::size_t g, std::size_t part, bool next) override {
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease,
                               store_->Acquire(Id(k, g, part, next ? 1 - current_ : current_)));
    return Wrap(std::move(lease));
  }
  absl::StatusOr<Buf> Overwrite(Kind k, std::size_t g, std::size_t part, bool next) override {
    if (next) MEMASCEND_RETURN_IF_ERROR(Settle());  // the old version is about to be written
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, store_->AcquireForOverwrite(Id(
                                                      k, g, part, next ? 1 - current_ : current_)));
    return Wrap(std::move(lease));
  }
  absl::StatusOr<Buf> Update(Kind k, std::size_t g, std::size_t part) override {
    // The current version's block becomes the next version's (read straight into it if
    // cold): one block per state, never both versions at once.
    MEMASCEND_RETURN_IF_ERROR(Settle());
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease next, store_->AcquireCopy(Id(k, g, part, current_),
                                                                     Id(k, g, part, 1 - current_)));
    return Wrap(std::move(next));
  }
  void Prefetch(Kind k, std::size_t g, std::size_t part) override {
    (void)store_->Prefetch(Id(k, g, part, current_));
  }
  absl::Status Keep(Kind k, std::size_t g, std::size_t part) override {
    for (int v = 0; v < (Versioned(k) ? 2 : 1); ++v)
      MEMASCEND_RETURN_IF_ERROR(
          store_->SetRetention(Id(k, g, part, v), memascend::Retention::kKeep));
    return absl::OkStatus();
  }
  absl::Status Discard(Kind k, std::size_t g, std::size_t part) override {
    return store_->Discard(Id(k, g, part, current_));
  }

  // Note [background commit]: the new version's write-backs and the journal commit run on
  // a thread of their own; the caller goes on computing and reading (the new version is
  // resident or staged, so reads see it at once) and waits only before writing again.
  absl::Status Commit(const Checkpoint& c) override {
    MEMASCEND_RETURN_IF_ERROR(Settle());
    current_ = c.version;
    committer_ = std::thread([this, c] {
      absl::Status s = store_->Flush();
      if (s.ok()) {
        const std::string record = Encode(c);
        s = volume_->Put(kCheckpointName,
                         {reinterpret_cast<const std::byte*>(record.data()), record.size()},
                         memascend::Durability::kDurable, "offload_train checkpoint");
      }
      commit_status_ = std::move(s);
    });
    return absl::OkStatus();
  }
  absl::Status Settle() override {
    if (committer_.joinable()) committer_.join();
    return commit_status_;  // once failed, the backend stays failed
  }
  absl::StatusOr<std::optional<Checkpoint>> Load() override {
    MEMASCEND_RETURN_IF_ERROR(Settle());
    auto info = volume_->Stat(kCheckpointName);
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
      return info.status();
    }
    std::string text(info->size, '\0');
    MEMASCEND_RETURN_IF_ERROR(
        volume_->Get(kCheckpointName, {reinterpret_cast<std::byte*>(text.data()), text.size()})
            .status());
    MEMASCEND_ASSIGN_OR_RETURN(Checkpoint c, Decode(text));
    current_ = c.version;
    return c;
  }
  std::uint64_t IoReadBytes() const override { return store_->stats().bytes_read; }
  std::uint64_t IoWriteBytes() const override { return store_->stats().bytes_written; }
  std::optional<memascend::TensorStoreStats> StoreStats() const override { return store_->stats(); }

 private:
  OffloadBackend() = default;

  TensorId Id(Kind k, std::size_t g, std::size_t part, int version) const {
    const std::size_t versions = Versioned(k) ? 2 : 1;
    return ids_[static_cast<int>(k)][g]
               [part * versions + static_cast<std::size_t>(Versioned(k) ? version : 0)];
  }
  static Buf Wrap(TensorLease lease) {
    Buf b;
    b.data = lease.data();
    b.bytes = lease.size();
    b.hold = std::make_shared<TensorLease>(std::move(lease));
    return b;
  }

  absl::Status OpenVolume(const TrainOptions& o) {
    if (o.volume_path.empty()) return absl::InvalidArgumentError("no volume path");
    memascend::VolumeOpenOptions open;
    if (o.resume) {
      MEMASCEND_ASSIGN_OR_RETURN(volume_, memascend::Volume::Open(o.volume_path, open));
      return absl::OkStatus();
    }
    struct stat st {};
    const bool exists = ::stat(o.volume_path.c_str(), &st) == 0;
    const bool regular = !exists || S_ISREG(st.st_mode);
    memascend::VolumeFormatOptions f;
    f.force = o.force;
    if (regular) {
      f.size = o.volume_bytes != 0 ? o.volume_bytes : DefaultVolumeBytes(o);
      // A file holding an earlier run's volume is ours to reformat; any other content
      // is refused unless forced (Note [foreign data]).
      if (exists && memascend::Volume::Open(o.volume_path, open).ok()) f.force = true;
    }
    MEMASCEND_RETURN_IF_ERROR(memascend::Volume::Format(o.volume_path, f));
    MEMASCEND_ASSIGN_OR_RETURN(volume_, memascend::Volume::Open(o.volume_path, open));
    return absl::OkStatus();
  }

  static std::uint64_t DefaultVolumeBytes(const TrainOptions& o) {
    constexpr std::uint64_t kUnit = 64 * 1024;
    std::uint64_t need = 0;
    for (Kind k : kKinds) {
      for (std::size_t g = 0; g < GroupCount(o.model); ++g) {
        if (!Stored(o.model, k, g)) continue;
        for (std::size_t part = 0; part < OptimizerParts(o.model, g, o.optimizer_chunk); ++part) {
          const auto [begin, end] = PartRange(o.model, g, part, o.optimizer_chunk);
          const std::uint64_t bytes = (end - begin) * ElementBytes(k, o.dtype);
          need += (Versioned(k) ? 2 : 1) * ((bytes + kUnit - 1) / kUnit * kUnit);
        }
      }
    }
    return 2 * need + (64ull << 20);  // room to write new extents before old ones are freed
  }

  std::unique_ptr<memascend::Volume> volume_;
  std::unique_ptr<memascend::TensorStore> store_;
  std::thread committer_;       // the commit in progress (Note [background commit])
  absl::Status commit_status_;  // the last commit's; written by committer_ before it ends
  std::array<std::vector<std::vector<TensorId>>, kKinds.size()>
      ids_;  // [kind][group][part, version]
  int current_ = 0;
};

std::size_t MaxGroupParams(const GptConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 0; g < GroupCount(c); ++g) n = std::max(n, GroupParams(c, g));
  return n;
}

// Note [gradient parts]: the fp32 gradient in hand, a block's (its backward pass makes it
// whole); the embeddings' and the head's are made a block's size at a time.
std::size_t GradientScratchParams(const GptConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 1; g + 1 < GroupCount(c); ++g) n = std::max(n, GroupParams(c, g));
  return n;
}

std::size_t RoundPage(std::size_t b) { return (b + 4095) / 4096 * 4096; }

// The least read-ahead: three parts' gradients, master weights and moments.
std::size_t MinimumReadAhead(const GptConfig& c, DType dtype, std::size_t chunk) {
  return 3 * std::min(MaxGroupParams(c), chunk) * (12 + memascend::SizeOf(dtype));
}

// Mixed-precision training over a backend.
class Run {
 public:
  Run(const TrainOptions& o, Backend* backend, memascend::KernelThreads* threads,
      memascend::MemoryLedger* ledger)
      : o_(o),
        c_(o.model),
        backend_(backend),
        threads_(threads),
        ledger_(ledger),
        chunk_(o.policy == Policy::kMemAscend ? o.optimizer_chunk : SIZE_MAX),
        overlap_(o.overlap_optimizer && o.policy == Policy::kMemAscend && o.mode == Mode::kOffload),
        derive_(o.policy == Policy::kMemAscend && o.mode == Mode::kOffload),
        read_ahead_(o.read_ahead_bytes),
        keep_bytes_(o.keep_bytes),
        model_(o.model, threads),
        wf_(MaxGroupParams(o.model)),
        df_(GradientScratchParams(o.model)) {
    // Note [gradient room]: the gradients' bytes in update order, and how much of the
    // read-ahead they may claim.
    const std::size_t half = memascend::SizeOf(o.dtype);
    grad_before_.push_back(0);
    for (std::size_t g = 0; g < GroupCount(c_); ++g) {
      part_base_.push_back(grad_before_.size() - 1);
      for (std::size_t part = 0; part < Parts(g); ++part) {
        const auto [begin, end] = PartRange(c_, g, part, chunk_);
        grad_before_.push_back(grad_before_.back() + (end - begin) * half);
      }
    }
    const std::size_t floor = MinimumReadAhead(c_, o.dtype, chunk_);
    grad_room_ = overlap_ && read_ahead_ > floor ? read_ahead_ - floor : 0;
    if (derive_) {
      // Note [derived parameters]: one part's 16-bit parameters of the embedding or the head.
      const std::size_t head = GroupCount(c_) - 1;
      derived_.resize(std::min(chunk_, std::max(GroupParams(c_, 0), GroupParams(c_, head))) * half);
    }
  }

  // Marks the optimizer state kept across steps (Note [kept state]): the first parts in
  // update order, up to keep_bytes_.
  absl::Status KeepState() {
    std::size_t kept = 0;
    for (std::size_t g = 0; g < GroupCount(c_); ++g) {
      for (std::size_t part = 0; part < Parts(g); ++part) {
        if (kept + PartStateBytes(g, part) > keep_bytes_) return absl::OkStatus();
        kept += PartStateBytes(g, part);
        for (Kind k : {Kind::kMaster, Kind::kExpAvg, Kind::kExpAvgSq})
          MEMASCEND_RETURN_IF_ERROR(backend_->Keep(k, g, part));
        keep_end_ = {g, part + 1};
      }
    }
    return absl::OkStatus();
  }
  bool Kept(std::size_t g, std::size_t part) const {
    return g < keep_end_.first || (g == keep_end_.first && part < keep_end_.second);
  }

  absl::Status Init(std::uint64_t fingerprint) {
    for (std::size_t g = 0; g < GroupCount(c_); ++g) {
      InitGroup(c_, g, o_.seed, wf_.data());
      for (std::size_t part = 0; part < Parts(g); ++part) {
        const auto [begin, end] = PartRange(c_, g, part, chunk_);
        if (!Derived(g)) {
          MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf param,
                                     backend_->Overwrite(Kind::kParam, g, part, false));
          MEMASCEND_RETURN_IF_ERROR(
              memascend::Convert({wf_.data() + begin, end - begin, DType::kF32},
                                 {param.data, end - begin, o_.dtype}, {threads_}));
        }
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf master,
                                   backend_->Overwrite(Kind::kMaster, g, part, false));
        std::memcpy(master.data, wf_.data() + begin, (end - begin) * 4);
        for (Kind k : {Kind::kExpAvg, Kind::kExpAvgSq}) {
          MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf st, backend_->Overwrite(k, g, part, false));
          std::memset(st.data, 0, st.bytes);
        }
      }
    }
    ck_ = Checkpoint{};
    ck_.scaler = scaler_.state();
    ck_.fingerprint = fingerprint;
    return backend_->Commit(ck_);
  }

  absl::Status Resume(const Checkpoint& c) {
    MEMASCEND_RETURN_IF_ERROR(scaler_.Restore(c.scaler));
    ck_ = c;
    return absl::OkStatus();
  }

  const Checkpoint& checkpoint() const { return ck_; }
  const PhaseSeconds& phases() const { return phases_; }
  memascend::DynamicLossScaler& scaler() { return scaler_; }
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
    const float scale = scaler_.scale();
    Lap(nullptr);
    const bool update = pending_.has_value();  // the previous step's, interleaved
    if (update) {
      // The last commit is durable before the update writes the version it superseded.
      MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
      Lap(&phases_.commit);
      ContinueReadAhead();
    }
    overflow_ = false;
    sum_squares_ = 0;
    // Forward, streaming the working parameters (or taking them from the update).
    double loss = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      if (update) {
        // The new parameters go to the working copy as each part is updated.
        MEMASCEND_RETURN_IF_ERROR(Optimize(g, pending_->adam, /*to_working=*/true));
        Sample(g, "opt");
        Lap(&phases_.optimizer);
      } else {
        for (std::size_t a = g + 1; a <= std::min(head, g + o_.window); ++a) PrefetchParams(a);
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
        for (std::size_t a = head - 1; a >= 1 && a + o_.window >= head; --a) PrefetchParams(a);
        if (overlap_) StartReadAhead(/*grads_ready=*/false);
      }
      if (!update) MEMASCEND_RETURN_IF_ERROR(LoadParams(g, false));
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
      for (std::size_t a = g - 1; a >= 1 && a + o_.window >= g; --a) PrefetchParams(a);
      MEMASCEND_RETURN_IF_ERROR(LoadParams(g, false));
      std::fill_n(df_.begin(), GroupParams(c_, g), 0.0f);
      model_.BlockBackward(g - 1, wf_.data(), df_.data());
      MEMASCEND_RETURN_IF_ERROR(StoreGrad(g));
      Sample(g, "bwd");
      Lap(&phases_.backward);
    }
    MEMASCEND_RETURN_IF_ERROR(StoreGrad(0));
    Sample(0, "bwd");
    Lap(&phases_.backward);

    if (backend_->ChecksOverflowAfterBackward()) {
      MEMASCEND_ASSIGN_OR_RETURN(overflow_, backend_->CheckOverflow());
    }
    Lap(&phases_.optimizer);  // the overflow check (ZeRO-Infinity's pass with temporaries)
    Pending p;
    p.next = ck_;
    p.next.step = ck_.step + 1;
    p.loss = loss;
    p.skipped = !scaler_.Update(overflow_);
    p.next.scaler = scaler_.state();
    if (p.skipped) {
      for (std::size_t g = 0; g < groups; ++g) {
        for (std::size_t part = 0; part < Parts(g); ++part)
          MEMASCEND_RETURN_IF_ERROR(backend_->Discard(Kind::kGrad, g, part));
      }
      Lap(&phases_.optimizer);
      pending_ = p;
      // Settled at once: nothing runs under this commit, and the step's report (its
      // time) must not wait for the next update's.
      MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
      MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
      Lap(&phases_.commit);
      return absl::OkStatus();
    }
    const double norm = std::sqrt(sum_squares_) / static_cast<double>(scale);
    const double ramp =
        o_.warmup == 0
            ? 1.0
            : std::min(1.0, static_cast<double>(ck_.step + 1) / static_cast<double>(o_.warmup));
    p.adam.lr = static_cast<float>(static_cast<double>(o_.lr) * ramp);
    p.adam.weight_decay = o_.weight_decay;
    p.adam.step = ck_.adam_step + 1;
    p.adam.grad_multiplier = memascend::ClipCoefficient(norm, o_.clip) / scale;
    p.next.adam_step = ck_.adam_step + 1;
    p.next.version = 1 - ck_.version;
    pending_ = p;
    if (overlap_) return absl::OkStatus();  // the next Step() or Finish() updates
    return Finish(on_commit);
  }

  // Runs and commits the pending update, if any (the last step's, when overlapped).
  absl::Status Finish(const CommitFn& on_commit) {
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    if (!pending_.has_value()) return absl::OkStatus();
    if (backend_->OwnsOptimizerStep()) {
      MEMASCEND_RETURN_IF_ERROR(backend_->OptimizerStep(pending_->adam, threads_));
      Sample(GroupCount(c_) - 1, "opt");
    } else {
      ContinueReadAhead();
      for (std::size_t g = 0; g < GroupCount(c_); ++g) {
        MEMASCEND_RETURN_IF_ERROR(Optimize(g, pending_->adam, /*to_working=*/false));
        Sample(g, "opt");
      }
    }
    Lap(&phases_.optimizer);
    MEMASCEND_RETURN_IF_ERROR(CommitPending(on_commit));
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    Lap(&phases_.commit);
    return absl::OkStatus();
  }

  // Forward only (dparams null), for sampling: the model must be built for batch 1.
  absl::StatusOr<std::int32_t> NextToken(Gpt<float>& model, const std::vector<std::int32_t>& ctx,
                                         std::uint64_t* rng) {
    const std::size_t groups = GroupCount(c_);
    std::vector<std::int32_t> window(c_.seq, 0);
    const std::size_t n = std::min(ctx.size(), c_.seq);
    std::copy(ctx.end() - static_cast<std::ptrdiff_t>(n), ctx.end(), window.begin());
    for (std::size_t g = 0; g < groups; ++g) {
      MEMASCEND_RETURN_IF_ERROR(LoadParams(g, false));
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
  // A step computed but not yet committed (its update not yet run, unless skipped).
  struct Pending {
    Checkpoint next;
    memascend::AdamConfig adam;
    double loss = 0;
    bool skipped = false;
  };

  // Adds the time since the last call to `*total` (if given).
  void Lap(double* total) {
    const auto now = Clock::now();
    if (total != nullptr) *total += std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }

  // Starts committing the pending step (Note [background commit]); it is reported once
  // durable, by Settle().
  absl::Status CommitPending(const CommitFn& on_commit) {
    ahead_started_ = false;
    MEMASCEND_RETURN_IF_ERROR(Settle(on_commit));
    MEMASCEND_RETURN_IF_ERROR(backend_->Commit(pending_->next));
    ck_ = pending_->next;
    Committed c;
    c.step = ck_.step;
    c.loss = pending_->loss;
    c.skipped = pending_->skipped;
    c.loss_scale = scaler_.scale();
    committing_ = c;
    pending_.reset();
    return absl::OkStatus();
  }
  // Waits for the commit in progress, if any, and reports its step.
  absl::Status Settle(const CommitFn& on_commit) {
    MEMASCEND_RETURN_IF_ERROR(backend_->Settle());
    if (committing_.has_value()) {
      const Committed c = *committing_;
      committing_.reset();
      if (on_commit) on_commit(c);
    }
    return absl::OkStatus();
  }

  // The group's parameters into the fp32 working copy, part by part (of a derived group,
  // rounded from the master weights: Note [derived parameters]).
  absl::Status LoadParams(std::size_t g, bool next) {
    for (std::size_t part = 0; part < Parts(g); ++part) {
      const auto [begin, end] = PartRange(c_, g, part, chunk_);
      const std::size_t n = end - begin;
      const memascend::MutableTensorView to{wf_.data() + begin, n, DType::kF32};
      if (Derived(g)) {
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf m, backend_->Read(Kind::kMaster, g, part, next));
        const memascend::MutableTensorView half{derived_.data(), n, o_.dtype};
        MEMASCEND_RETURN_IF_ERROR(memascend::Convert({m.data, n, DType::kF32}, half, {threads_}));
        MEMASCEND_RETURN_IF_ERROR(memascend::Convert({half.data, n, o_.dtype}, to, {threads_}));
        continue;
      }
      MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf p, backend_->Read(Kind::kParam, g, part, next));
      MEMASCEND_RETURN_IF_ERROR(memascend::Convert({p.data, n, o_.dtype}, to, {threads_}));
    }
    return absl::OkStatus();
  }
  void PrefetchParams(std::size_t g) {
    const Kind k = Derived(g) ? Kind::kMaster : Kind::kParam;
    for (std::size_t part = 0; part < Parts(g); ++part) backend_->Prefetch(k, g, part);
  }
  // Note [derived parameters]: the embedding's and the head's 16-bit parameters are not
  // stored on a MemAscend volume.
  bool Derived(std::size_t g) const { return derive_ && !Stored(c_, Kind::kParam, g); }

  // The group's fp32 gradient (scaled) into its 16-bit gradient tensors, part by part,
  // each checked for overflow and added to the norm while in hand. The sum of squares
  // runs on over every part of every group (parts are multiples of the kernels' 2^18-
  // element tasks): the same bits in every policy, whatever its parts.
  absl::Status StoreGrad(std::size_t g) {
    for (std::size_t part = 0; part < Parts(g); ++part) {
      const auto [begin, end] = PartRange(c_, g, part, chunk_);
      const std::size_t n = end - begin;
      {
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf grad,
                                   backend_->Overwrite(Kind::kGrad, g, part, false));
        // A block's gradient is whole in df_ (one range); the embeddings' and the head's
        // are made here, df_'s size at a time (Note [gradient parts]).
        const bool block = KindOf(c_, g) == GroupKind::kBlock;
        for (std::size_t at = begin; at < end; at += block ? n : df_.size()) {
          const std::size_t to = block ? end : std::min(end, at + df_.size());
          if (KindOf(c_, g) == GroupKind::kHead) model_.HeadGradient(df_.data(), at, to);
          if (KindOf(c_, g) == GroupKind::kEmbed) model_.EmbedGradient(df_.data(), at, to);
          MEMASCEND_RETURN_IF_ERROR(memascend::Convert(
              {df_.data() + (block ? at : 0), to - at, DType::kF32},
              {grad.data + (at - begin) * memascend::SizeOf(o_.dtype), to - at, o_.dtype},
              {threads_}));
        }
        const memascend::TensorView view[] = {{grad.data, n, o_.dtype}};
        if (!backend_->ChecksOverflowAfterBackward() && memascend::HasOverflow(view, {threads_}))
          overflow_ = true;
        if (!overflow_) sum_squares_ = memascend::SumOfSquares(view, {threads_}, sum_squares_);
      }
      // Note [gradient room]: a gradient the budget has room for stays until the update
      // (marked wanted, so neither eviction nor the read-ahead takes it first).
      if (GradBytesBefore(g, part + 1) <= grad_room_) backend_->Prefetch(Kind::kGrad, g, part);
    }
    return absl::OkStatus();
  }

  // Read-ahead of the update's inputs, in update order: each part's gradient, master
  // weights and moments, up to read_ahead_ bytes beyond the part being updated. Started
  // under the head's compute when the update is overlapped, before the gradients exist:
  // the window's gradients are prefetched once they do (a gradient still resident from
  // the backward pass is then marked wanted, so the read-ahead does not evict it).
  void StartReadAhead(bool grads_ready) {
    ahead_.clear();
    ahead_bytes_ = 0;
    cursor_g_ = 0;
    cursor_part_ = 0;
    grads_ready_ = grads_ready;
    ahead_started_ = true;
    if (!grads_ready) Fill();  // part 0 of group 0 included: ReadAhead(0, 0) keeps it
  }
  // At the update: the read-ahead started before goes on, with the gradients of the parts
  // it holds.
  void ContinueReadAhead() {
    if (!ahead_started_) {
      StartReadAhead(/*grads_ready=*/true);
      return;
    }
    grads_ready_ = true;
    for (const Ahead& a : ahead_) backend_->Prefetch(Kind::kGrad, a.g, a.part);
  }
  void ReadAhead(std::size_t g, std::size_t part) {
    while (!ahead_.empty() &&
           (ahead_.front().g < g || (ahead_.front().g == g && ahead_.front().part <= part))) {
      ahead_bytes_ -= ahead_.front().bytes;
      ahead_.pop_front();
    }
    if (cursor_g_ < g || (cursor_g_ == g && cursor_part_ <= part)) {
      cursor_g_ = g;
      cursor_part_ = part + 1;
    }
    Fill();
  }
  void Fill() {
    for (;;) {
      if (cursor_part_ >= Parts(cursor_g_)) {
        cursor_part_ = 0;
        ++cursor_g_;
      }
      if (cursor_g_ >= GroupCount(c_)) return;
      // The gradients beyond the cursor keep their room (Note [gradient room]).
      const std::size_t grads_beyond =
          grad_before_.back() - GradBytesBefore(cursor_g_, cursor_part_);
      if (ahead_bytes_ + std::min(grads_beyond, grad_room_) >= read_ahead_) return;
      const auto [begin, end] = PartRange(c_, cursor_g_, cursor_part_, chunk_);
      // Kept parts hold their share of the budget already.
      const std::size_t bytes =
          (end - begin) * memascend::SizeOf(o_.dtype) +
          (Kept(cursor_g_, cursor_part_) ? 0 : PartStateBytes(cursor_g_, cursor_part_));
      if (grads_ready_) backend_->Prefetch(Kind::kGrad, cursor_g_, cursor_part_);
      for (Kind k : {Kind::kMaster, Kind::kExpAvg, Kind::kExpAvgSq})
        backend_->Prefetch(k, cursor_g_, cursor_part_);
      ahead_.push_back({cursor_g_, cursor_part_, bytes});
      ahead_bytes_ += bytes;
      ++cursor_part_;
    }
  }

  // One group, part by part: each part's gradient, next parameters and optimizer state
  // are held together, read ahead. `to_working`: each part's new parameters also go to
  // the fp32 working copy (the overlapped forward pass, which then reads none).
  absl::Status Optimize(std::size_t g, const memascend::AdamConfig& adam, bool to_working) {
    for (std::size_t part = 0; part < Parts(g); ++part) {
      ReadAhead(g, part);
      const auto [begin, end] = PartRange(c_, g, part, chunk_);
      const std::size_t n = end - begin;
      {
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf grad, backend_->Read(Kind::kGrad, g, part, false));
        // A derived group's new parameters go to the working copy only (Note [derived
        // parameters]), if anywhere.
        Backend::Buf param;
        if (!Derived(g)) {
          MEMASCEND_ASSIGN_OR_RETURN(param, backend_->Overwrite(Kind::kParam, g, part, true));
        } else if (to_working) {
          param.data = derived_.data();
        }
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf master, backend_->Update(Kind::kMaster, g, part));
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf m, backend_->Update(Kind::kExpAvg, g, part));
        MEMASCEND_ASSIGN_OR_RETURN(Backend::Buf v, backend_->Update(Kind::kExpAvgSq, g, part));
        MEMASCEND_RETURN_IF_ERROR(memascend::FusedAdam(adam, {master.f32(), n}, {m.f32(), n},
                                                       {v.f32(), n}, {grad.data, n, o_.dtype},
                                                       {param.data, n, o_.dtype}, {threads_}));
        if (to_working) {
          MEMASCEND_RETURN_IF_ERROR(memascend::Convert(
              {param.data, n, o_.dtype}, {wf_.data() + begin, n, DType::kF32}, {threads_}));
        }
      }
      MEMASCEND_RETURN_IF_ERROR(backend_->Discard(Kind::kGrad, g, part));
    }
    return absl::OkStatus();
  }

  std::size_t Parts(std::size_t g) const { return OptimizerParts(c_, g, chunk_); }
  // Gradient bytes of the parts before part `part` of group `g`, in update order (`part`
  // may be Parts(g): the group's whole gradient counts).
  std::size_t GradBytesBefore(std::size_t g, std::size_t part) const {
    return grad_before_[part_base_[g] + part];
  }
  // Bytes of a part's master weights and two moments (fp32).
  std::size_t PartStateBytes(std::size_t g, std::size_t part) const {
    const auto [begin, end] = PartRange(c_, g, part, chunk_);
    return 3 * (end - begin) * 4;
  }

  void Sample(std::size_t g, const char* phase) {
    if (ledger_ != nullptr) ledger_->Sample(fmt::format("{}.{}", phase, GroupName(c_, g)));
  }

  TrainOptions o_;
  GptConfig c_;
  Backend* backend_;
  memascend::KernelThreads* threads_;
  memascend::MemoryLedger* ledger_;
  memascend::DynamicLossScaler scaler_{[&] {
    memascend::DynamicLossScaler::Options so;
    so.initial_scale = o_.initial_loss_scale;
    return so;
  }()};
  std::size_t chunk_;
  bool overlap_;            // Note [optimizer overlap]
  bool derive_;             // Note [derived parameters]
  std::size_t read_ahead_;  // bytes of optimizer state read ahead
  // Note [gradient room]: part_base_[g] is group g's first part in update order;
  // grad_before_[i] the gradient bytes of the parts before part i; grad_room_ what of the
  // read-ahead the gradients may hold.
  std::vector<std::size_t> part_base_, grad_before_;
  std::size_t grad_room_ = 0;
  std::size_t keep_bytes_;  // of optimizer state kept resident across steps
  std::pair<std::size_t, std::size_t> keep_end_{0, 0};  // the first part not kept
  Gpt<float> model_;
  std::vector<float> wf_;           // one group's parameters in fp32
  std::vector<float> df_;           // a gradient in fp32 (Note [gradient parts])
  std::vector<std::byte> derived_;  // Note [derived parameters]: one part's, 16-bit
  bool overflow_ = false;
  double sum_squares_ = 0;
  PhaseSeconds phases_;
  Clock::time_point mark_ = Clock::now();
  Checkpoint ck_;
  std::optional<Pending> pending_;
  std::optional<Committed> committing_;  // committed, not yet known durable nor reported
  struct Ahead {
    std::size_t g, part, bytes;
  };
  std::deque<Ahead> ahead_;  // read ahead, not yet updated
  std::size_t ahead_bytes_ = 0;
  std::size_t cursor_g_ = 0, cursor_part_ = 0;  // the next part to read ahead
  bool ahead_started_ = false;                  // by the backward pass, for the pending update
  bool grads_ready_ = false;                    // the gradients read ahead may be prefetched
};

}  // namespace

std::size_t OptimizerParts(const GptConfig& c, std::size_t group, std::size_t optimizer_chunk) {
  const std::size_t n = GroupParams(c, group);
  return optimizer_chunk >= n ? 1 : (n + optimizer_chunk - 1) / optimizer_chunk;
}

std::size_t MinimumHostBudget(const GptConfig& c, DType dtype, std::size_t optimizer_chunk) {
  const std::size_t part = std::min(MaxGroupParams(c), optimizer_chunk);
  const std::size_t half = memascend::SizeOf(dtype);
  // Of one part: the gradient, the next parameters, the next master weights and moments
  // (each made from the current one in place: TensorStore::AcquireCopy).
  return 2 * RoundPage(part * half) + 3 * RoundPage(part * 4);
}

std::uint64_t ModelStateBytes(const GptConfig& c, DType dtype) {
  return static_cast<std::uint64_t>(TotalParams(c)) * (2 * memascend::SizeOf(dtype) + 12);
}

std::size_t DefaultHostBudget(const GptConfig& c, DType dtype, std::size_t optimizer_chunk) {
  const auto forty = static_cast<std::size_t>(static_cast<double>(ModelStateBytes(c, dtype)) * 0.4);
  return RoundPage(std::max(forty, 2 * MinimumHostBudget(c, dtype, optimizer_chunk)));
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
  if (o.host_budget == 0) o.host_budget = DefaultHostBudget(o.model, o.dtype, o.optimizer_chunk);
  const std::size_t minimum = MinimumHostBudget(o.model, o.dtype, o.optimizer_chunk);
  {
    // Note [kept state]: what the budget leaves beyond the minimum and the kept state
    // goes to the read-ahead.
    const std::size_t spare = o.host_budget > minimum ? o.host_budget - minimum : 0;
    if (o.policy != Policy::kMemAscend || o.mode != Mode::kOffload) o.keep_bytes = 0;
    if (o.keep_bytes > spare) {
      // Kept state beyond the spare budget would be evicted like any other: refuse it.
      return absl::InvalidArgumentError(
          fmt::format("--keep {} bytes exceeds what the host budget of {} leaves beyond the {} the "
                      "optimizer step needs ({} bytes); keep less or raise --host-budget",
                      o.keep_bytes, o.host_budget, minimum, spare));
    }
    if (o.read_ahead_bytes == 0)
      o.read_ahead_bytes =
          std::max(MinimumReadAhead(o.model, o.dtype, o.optimizer_chunk), spare - o.keep_bytes);
  }
  if (o.mode == Mode::kOffload && o.policy == Policy::kMemAscend && o.host_budget < minimum) {
    return absl::ResourceExhaustedError(fmt::format(
        "host budget of {} bytes is below the {} bytes that the optimizer step holds at once "
        "(the gradient, new parameters, master weights and moments of a part of up to {} "
        "parameters, --optimizer-chunk); give --host-budget {} or more",
        o.host_budget, minimum, std::min(MaxGroupParams(o.model), o.optimizer_chunk), minimum));
  }
  memascend::MemoryLedger own_ledger;
  memascend::MemoryLedger* ledger = o.ledger != nullptr ? o.ledger : &own_ledger;
  const int nthreads = o.threads > 0
                           ? o.threads
                           : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  memascend::KernelThreads threads(nthreads);

  std::unique_ptr<Backend> backend;
  if (o.mode == Mode::kReference) {
    // Parts as the policy's (Run::chunk_): ZeRO-Infinity's rules keep groups whole.
    backend = std::make_unique<ReferenceBackend>(
        o.model, o.dtype, o.policy == Policy::kMemAscend ? o.optimizer_chunk : SIZE_MAX);
  } else if (o.policy == Policy::kZeroInfinity) {
    MEMASCEND_ASSIGN_OR_RETURN(backend, MakeZeroInfinityBackend(o, ledger));
  } else {
    MEMASCEND_ASSIGN_OR_RETURN(backend, OffloadBackend::Open(o, ledger));
  }
  const std::uint64_t fingerprint = Fingerprint(o, tokenizer, tokens.size());
  Run run(o, backend.get(), &threads, ledger);
  MEMASCEND_RETURN_IF_ERROR(run.KeepState());
  if (o.resume) {
    MEMASCEND_ASSIGN_OR_RETURN(std::optional<Checkpoint> ck, backend->Load());
    if (!ck.has_value()) {
      return absl::NotFoundError(
          fmt::format("--resume: the volume '{}' holds no committed step; start without --resume",
                      o.volume_path));
    }
    if (ck->fingerprint != fingerprint) {
      return absl::FailedPreconditionError(
          "--resume: the volume's run had another model, data, seed or hyper-parameters");
    }
    MEMASCEND_RETURN_IF_ERROR(run.Resume(*ck));
  } else {
    MEMASCEND_RETURN_IF_ERROR(run.Init(fingerprint));
    // The initial state is durable before the clock starts, as under ZeRO-Infinity's rules
    // (written synchronously): the first step's time is a step's, in every policy.
    MEMASCEND_RETURN_IF_ERROR(backend->Settle());
  }

  TrainSummary summary;
  summary.params = TotalParams(o.model);
  summary.model_state_bytes = ModelStateBytes(o.model, o.dtype);
  summary.host_budget =
      o.mode == Mode::kOffload && o.policy == Policy::kMemAscend ? o.host_budget : 0;
  summary.first_step = run.checkpoint().step + 1;
  const auto start = Clock::now();
  auto last = start;  // of the last commit: a step's time runs from the one before
  std::uint64_t io_last = backend->IoReadBytes() + backend->IoWriteBytes();
  const Run::CommitFn on_commit = [&](const Run::Committed& c) {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    const std::uint64_t io = backend->IoReadBytes() + backend->IoWriteBytes();
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
  for (std::size_t step = run.checkpoint().step + 1; step <= o.steps; ++step) {
    SampleBatch(tokens, o.seed, step, o.model.batch, o.model.seq, &inputs, &targets);
    MEMASCEND_RETURN_IF_ERROR(run.Step(inputs, targets, on_commit));
  }
  MEMASCEND_RETURN_IF_ERROR(run.Finish(on_commit));
  summary.seconds = Since(start);
  summary.final_loss = summary.losses.empty() ? 0 : summary.losses.back();
  summary.skipped_steps = run.scaler().skipped_steps();
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
  summary.io_read_bytes = backend->IoReadBytes();
  summary.io_write_bytes = backend->IoWriteBytes();
  summary.store = backend->StoreStats();
  summary.ledger = ledger->Snapshot();
  summary.peak_pinned_bytes =
      static_cast<std::uint64_t>(summary.ledger.tier(memascend::Tier::kPinnedHost).reserved_peak);
  summary.peak_rss_bytes = summary.ledger.peak_rss_bytes;
  return summary;
}

}  // namespace offload_train
