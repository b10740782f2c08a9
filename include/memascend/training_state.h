// memascend/training_state.h: a model's training state (16-bit parameters, gradients,
// fp32 master weights and Adam moments), group by group and part by part, kept either in
// ordinary memory or in a TensorStore on a volume, once (updated in place) or in two
// versions, with crash-safe commits.
//
//   memascend::StateLayout layout;
//   layout.groups = {{"embed", 4'194'304}, {"block.0", 786'432}, {"head", 4'194'304}};
//   layout.param_dtype = layout.grad_dtype = memascend::DType::kBF16;
//   layout.part_elements = 1 << 20;                // the optimizer holds one part at a time
//   MEMASCEND_ASSIGN_OR_RETURN(auto state,
//       memascend::VersionedTrainingState::Open(store.get(), volume.get(), layout));
//   MEMASCEND_ASSIGN_OR_RETURN(auto last, state->Resume(my_fingerprint));   // nullopt: new
//
// Note [state in place]: by default (options.in_place) every stored part is on the volume
// once, updated in place: the state takes 16 bytes per parameter (bf16 parameters and
// gradients, fp32 master weights and both moments: 2 + 2 + 4 + 4 + 4) plus what is in
// flight. Each write-back is staged (Note [staged puts] in volume.h: the new bytes go to
// new extents, the old stay until the next journal commit), so what the volume holds
// changes only at journal commits, and the state orders them:
//   - The gradients are durable tensors, the step's redo record. No gradient of a step
//     reaches the volume before the step before it is whole there: the backward pass's
//     gradients are staged while that step's commit may still run (it takes those staged
//     by then with its record), and any other commit of them waits for it first.
//   - A step whose new state is more than max_staged_bytes is committed in batches. Before
//     its first part is written (BeginUpdate), the gradients still resident are written
//     back and committed, a batch of max_staged_bytes at a time. Then whenever the parts
//     updated since the last batch exceed the bound (PartUpdated, between parts), every
//     part updated so far is written back and committed, in one journal commit with the
//     progress object "<record_name>.step": the step's intent (the commit record it ends
//     with and the optimizer's redo bytes: its Adam settings) and how many parts, in
//     layout order, hold the new step.
//   - The step's commit writes back the rest and stages its commit record: one journal
//     commit. A step that fits the bound is committed whole there; it writes no gradient
//     where its gradients fit the bound with it, and otherwise commits them first (at
//     BeginUpdate, as a batched step does: the update would evict them into the bound).
// A crash thus leaves the first `done` parts at the new step and the others at the last
// committed one, never a part half updated (its kinds are written back together, before
// a batch commits), and the gradients of the others durable. Resume() then returns the
// last commit and Unfinished() the torn step; the optimizer updates the remaining parts
// from their gradients with the intent's settings (a part's update depends on nothing
// else) and commits it as the intent says: the resumed run is the uninterrupted one, bit
// for bit. The store's own commit on a full volume is off (Note [commit when full] in
// tensor_store.h): only these commits happen, so such a state does not share its volume
// (share_volume is refused). Outside a step, writes staged past the bound (the backward
// pass's gradients; Initialize, WriteState) are committed as they go; a step's writes
// (Update, Overwrite of the next version) before BeginUpdate are refused. A step commits
// as the last commit's step plus one (what Resume commits a torn step as, with the last
// commit's user bytes), before the next one's update. Every commit also stages a progress
// object of no step in progress, so an earlier one is never taken for a torn step. A state
// destroyed part-way through a step (an error, a caller that stopped) commits the parts
// updated so far with their progress object first, for Resume to finish. The redo gives
// the uninterrupted run's bits on the same kernels (the same machine: FusedAdam's vector
// paths are chosen by the CPU). A volume whose record is of two versions (an earlier
// release) is opened in two versions. Data-parallel ranks, which must resume at a step
// every rank holds, keep two versions (in_place false).
//
// Note [gradient write-behind]: a step committed in batches writes every gradient (its
// redo record) before its first part, so the backward pass's gradients are written as
// each is whole (GradientWritten, which OffloadedAdam calls after each part's gradient),
// under the backward pass's compute, which leaves the volume nearly idle, rather than
// all at once before the update. They stay resident (the write is a copy, not an
// eviction) and are committed as other gradients of the backward pass are: past the
// bound, counting the writes in flight (a drain: they are waited for, then committed).
// BeginUpdate then finds them clean. A step that fits the bound writes no gradient, and
// with two versions or unbounded gradients are never written: nothing is done there.
//
// Note [train state versions]: with in_place false, parameters, master weights and
// moments exist in two versions on the volume. A step reads version v and writes version 1 - v;
// only after every tensor of the new version is durable (TensorStore::Flush) is the commit record
// (step, version, Adam step, loss scaler, the caller's fingerprint and bytes) written, as
// one journaled object. A process killed at any moment therefore resumes from the last
// committed step with a consistent state. Gradients are scratch: written in the backward
// pass, read by the optimizer, then discarded; never committed.
//
// Note [previous commit]: the record before the last is kept too ("<record_name>.previous"),
// and its version stays whole until the commit after next. A commit writes, in order: the
// last record as the previous one; the new version's tensors (Flush, which overwrites the
// version of the record before the last, no longer named by either); the new record. A
// crash between any two leaves both records naming whole versions. ResumeAtMost() goes
// back to the previous record by rewriting it as the last, so no record ever names a
// version that a later commit overwrites.
//
// Note [bounded staging] (two versions): the tensor store writes evicted dirty tensors back as
// staged objects (Note [staged puts] in volume.h), whose extents the volume holds beside the ones
// they replace until the next Sync; committing only at Commit would need room for a whole
// version more. So at a step's first write of the next version the last record is written
// as the previous one first (Note [previous commit]: then no record names the version being
// written), and from then on the staged tensors are committed whenever more than
// max_staged_bytes wait: a volume the size of the state plus that bound suffices. A crash
// in between resumes from the last record as before. Data-parallel ranks, whose last
// commits may be a step apart, set max_staged_bytes 0 and keep the previous step whole
// until their commit.
//
// Note [background commit]: Commit() starts the write-backs and the journal commit on a
// thread of its own and returns; the caller goes on computing and reading (the new
// version is resident or staged, so reads see it at once). Settle() waits for it.
// Writing the version the commit supersedes (Overwrite or Update of the next version)
// settles first by itself. This is the storage's interface; the optimizer names both
// ways: OffloadedAdam::Commit settles before it returns, CommitAsync returns a ticket
// (Note [commit durability] in offloaded_optimizer.h).
//
// Note [commit interval]: a state in place may make only every commit_every-th step
// durable (options.commit_every, 1 by default: every step). The whole state is then
// written once per interval rather than once per step: a step that fits in host memory
// writes nothing (nor does a step the overflow check skips), and on the GPU machines of
// docs/gpu.md the per-step write of the whole state (16 bytes a parameter) is what the
// step waits for. Commit() of a step in between returns with the step committed in
// memory only: later reads, steps and commits see it, a crash loses it, and Resume()
// then returns the last durable step (at most commit_every - 1 steps back), whose state
// is whole (the caller replays the steps after it, as from any checkpoint). The
// interval's commit, Persist() and the state's destruction make every step committed so
// far durable, in one journal commit: the state's parts written back (not the
// gradients), the record, a progress object of no step. Parts evicted in between are
// staged (Note [staged puts]), never committed before that commit, so the volume needs
// room for a whole version more (max_staged_bytes 0: no batches, and VolumeBytes counts
// a version); Open refuses commit_every > 1 with a bound (max_staged_bytes not 0), with
// two versions, or on a Volume without that room. The state's store commits nothing at
// its close (TensorStore::SetCommitAtClose(false)): if the state's own last commit
// fails, the volume keeps the last durable step rather than parts of later ones, and the
// state forgets what that commit left (its tensors' dirty bytes discarded from the
// store, their staged objects dropped: ObjectStore::DropStaged), so that no later commit
// on the volume (a Flush of the store) carries it. A step torn while steps wait (the
// state destroyed mid-update) is committed as Note [state in place] commits one, with
// the record of the step before it.
//
// Note [state layout]: a group of `elements` parameters is stored in parts of
// `part_elements` (the last part shorter); each kind of state has the same parts. A group
// with store_parameters false has no stored 16-bit parameters: they are derived from its
// master weights by rounding (the optimizer's update writes them only to the caller's
// buffer), which saves their writes when the caller needs them only after an update.
//
// Note [state ownership]: a volume holds one training state (its records, named by
// record_name, and its tensors) unless states share it on purpose (share_volume, each with
// its own record name and tensor prefix). Open refuses (kFailedPrecondition, naming what
// it found, and the override) a volume that holds another state's record or tensors, or
// this record's state of another layout (a changed model or part size), and a volume a
// state open in this process already uses: two owners would overwrite each other's
// objects. replace_existing deletes what was found first (records first, then tensors).
//
// Thread-safety: one thread drives a state; Commit's background work is internal.
// Lifetime: the store and the volume must outlive the state; a StateBuffer must be
// released before the state is destroyed.
#ifndef MEMASCEND_TRAINING_STATE_H_
#define MEMASCEND_TRAINING_STATE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/kernels.h>
#include <memascend/tensor_store.h>
#include <memascend/volume.h>

namespace memascend {

enum class StateKind : std::uint8_t { kParameters, kGradient, kMaster, kExpAvg, kExpAvgSq };
std::string_view ToString(StateKind k) noexcept;

struct StateGroup {
  std::string name;  // [A-Za-z0-9_.-]+, unique
  std::size_t elements = 0;
  bool store_parameters = true;  // Note [state layout]
};

struct StateLayout {
  std::vector<StateGroup> groups;
  DType param_dtype = DType::kF16;  // the stored parameters (the master weights are fp32)
  DType grad_dtype = DType::kF16;
  std::size_t part_elements = SIZE_MAX;  // SIZE_MAX: every group is one part

  // kInvalidArgument for no groups, an empty group, a bad or repeated name, or a zero
  // part size.
  absl::Status Validate() const;
  std::size_t Parts(std::size_t group) const;
  // Elements [begin, end) of the group that `part` covers.
  std::pair<std::size_t, std::size_t> PartRange(std::size_t group, std::size_t part) const;
  std::size_t ElementBytes(StateKind k) const;
  bool Stored(StateKind k, std::size_t group) const;  // false for derived parameters
  std::size_t MaxGroupElements() const;
  std::size_t MaxPartElements() const;
  std::uint64_t TotalElements() const;
  // What identifies the layout (names, sizes, dtypes, parts): a state of another layout
  // is refused on resume.
  std::uint64_t Fingerprint() const;
};

// Note [layout shards]: data-parallel ranks each own a share of the state, as ZeRO
// partitions it. The layout's parts, in order (group by group), are cut into `world`
// contiguous runs of about equal elements (a part goes to the rank whose share of the
// elements holds its middle); rank r owns run r. A rank's share of a group is therefore
// whole parts, contiguous, cut where the whole's are; its own layout has one group per
// group it has a share of, named as the whole's, with the whole's dtypes and part size.
// A rank holds its shard on a storage of its own (its own volume); the gradients are
// reduced to, and the new parameters gathered from, the owner of each part.
struct LayoutShard {
  StateLayout layout;  // the rank's
  int rank = 0, world = 1;
  // Per group of the whole: its group in `layout` (nullopt: none of it is this rank's) and
  // the elements [begin, end) of the whole group that it holds (empty: none).
  std::vector<std::optional<std::size_t>> local;
  std::vector<std::pair<std::size_t, std::size_t>> range;
  // Per group of the whole, per part: the rank that owns it.
  std::vector<std::vector<int>> owner;
};
// kInvalidArgument for a bad layout, rank or world, or a world with more ranks than there
// are parts to share (some rank would own nothing: smaller parts would do).
absl::StatusOr<LayoutShard> ShardLayout(const StateLayout& whole, int rank, int world);

// What one commit makes durable with the state (Note [train state versions]).
struct CommitRecord {
  std::uint64_t step = 0;  // steps completed
  int version = 0;         // the version that holds the state after `step`
  std::int64_t adam_step = 0;
  DynamicLossScaler::State scaler;
  std::uint64_t fingerprint = 0;  // the caller's: of the model, data and hyper-parameters
  std::uint64_t layout = 0;       // StateLayout::Fingerprint(), set by the storage
  std::string user;               // the caller's bytes (at most 1 MiB)
};
// The record as stored, checksummed; and back. kDataLoss for anything but a whole record.
std::string EncodeCommitRecord(const CommitRecord& r);
absl::StatusOr<CommitRecord> DecodeCommitRecord(std::string_view bytes);

// How to finish a step updated in place should a crash tear it (Note [state in place]).
struct StepIntent {
  CommitRecord record;  // the commit it ends with (the storage sets step, user and layout)
  std::string redo;     // the optimizer's: what the update of a remaining part needs
};
struct UnfinishedStep {
  StepIntent intent;
  std::size_t parts_done = 0;  // parts, in layout order (group by group), at the new step
};

// A part in hand: its bytes stay valid until the buffer is destroyed (a store lease, or
// a backend's own buffer, kept by `hold`). Move-only in effect: copies share the hold.
struct StateBuffer {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  std::shared_ptr<void> hold;
  template <typename T>
  std::span<T> as() const noexcept {
    return {reinterpret_cast<T*>(data), bytes / sizeof(T)};
  }
};

// Where an optimizer's state lives. The SDK's are VersionedTrainingState (a tensor store
// on a volume) and InMemoryTrainingState (ordinary memory, one version: the reference);
// a caller may supply its own, such as a comparison baseline with its own buffers.
class TrainingStateStorage {
 public:
  virtual ~TrainingStateStorage() = default;
  virtual const StateLayout& layout() const = 0;

  // The current version of a part (next == false) or the next one, already written; for
  // reading only (a VersionedTrainingState's buffer may be on its way to the volume).
  virtual absl::StatusOr<StateBuffer> Read(StateKind k, std::size_t group, std::size_t part,
                                           bool next) = 0;
  // The caller writes every byte: of the current version (next == false) or the next.
  virtual absl::StatusOr<StateBuffer> Overwrite(StateKind k, std::size_t group, std::size_t part,
                                                bool next) = 0;
  // The next version, starting as a copy of the current one.
  virtual absl::StatusOr<StateBuffer> Update(StateKind k, std::size_t group, std::size_t part) = 0;
  // Starts reading the current version ahead of a Read; a hint.
  virtual void Prefetch(StateKind k, std::size_t group, std::size_t part) = 0;
  // Both versions stay resident from one step to the next when the budget allows; a hint.
  virtual absl::Status Keep(StateKind, std::size_t /*group*/, std::size_t /*part*/) {
    return absl::OkStatus();
  }
  // Drops a part's bytes without writing them (a gradient once used).
  virtual absl::Status Discard(StateKind k, std::size_t group, std::size_t part) = 0;
  // The part's gradient is whole for this step (written, its lease released, not to be
  // written again before the update): a storage that writes it anyway may start now
  // (Note [gradient write-behind]). Errors are the write's or a commit's.
  virtual absl::Status GradientWritten(std::size_t /*group*/, std::size_t /*part*/) {
    return absl::OkStatus();
  }
  // The current version of a stored part on the GPU tier, its copy queued on `stream`.
  virtual absl::StatusOr<TensorLease> ReadOnDevice(StateKind, std::size_t, std::size_t,
                                                   CudaStreamView) {
    return absl::FailedPreconditionError("this training state has no GPU tier");
  }

  // Note [state in place]. The update of a step is about to write its first part (after
  // the backward pass): `intent` says how to finish it. Then, after each part, in layout
  // order, once every kind of it holds the new step and none is leased: PartUpdated.
  virtual absl::Status BeginUpdate(const StepIntent& /*intent*/) { return absl::OkStatus(); }
  virtual absl::Status PartUpdated(std::size_t /*group*/, std::size_t /*part*/) {
    return absl::OkStatus();
  }
  // After Resume: the step a crash tore, for the optimizer to finish (the remaining parts,
  // then its commit) before anything else; nullopt when none.
  virtual std::optional<UnfinishedStep> Unfinished() const { return std::nullopt; }

  // Makes `r` the committed state (r.version may name the next version). May return
  // before it is durable (Note [background commit]); Settle() waits and returns the
  // commit's error. Once a commit failed, the storage stays failed.
  virtual absl::Status Commit(const CommitRecord& r) = 0;
  virtual absl::Status Settle() { return absl::OkStatus(); }
  // Note [commit interval]: makes every step committed so far durable, then settles.
  // kFailedPrecondition during a step's update with steps committed in memory before it.
  virtual absl::Status Persist() { return Settle(); }
  // The last committed record; nullopt when nothing was committed. kFailedPrecondition
  // when the record carries another fingerprint or layout (another run's state).
  virtual absl::StatusOr<std::optional<CommitRecord>> Resume(std::uint64_t fingerprint) = 0;
  // The newest committed record at or before `step` (Note [previous commit]): the last
  // one, or the one before it, which then becomes the last (the later one is dropped).
  // For the ranks of a data-parallel run, whose last commits may be a step apart after a
  // crash. kFailedPrecondition when neither is; errors as Resume otherwise. A storage
  // that keeps only its last commit refuses any step before it.
  virtual absl::StatusOr<std::optional<CommitRecord>> ResumeAtMost(std::uint64_t fingerprint,
                                                                   std::uint64_t step);

  virtual std::uint64_t io_read_bytes() const { return 0; }
  virtual std::uint64_t io_write_bytes() const { return 0; }
  virtual std::optional<TensorStoreStats> store_stats() const { return std::nullopt; }

  // For a storage that runs the update its own way (ZeRO-Infinity's sub-groups and
  // swap buffers, in the example's baseline): the optimizer calls these instead.
  virtual bool ChecksOverflowAfterBackward() const { return false; }
  virtual absl::StatusOr<bool> CheckOverflow() { return false; }
  virtual bool OwnsUpdate() const { return false; }
  virtual absl::Status UpdateAll(const AdamConfig&, KernelThreads*) {
    return absl::UnimplementedError("UpdateAll");
  }
};

// One version in ordinary memory, updated in place; commits nothing. The reference that
// offloaded runs are compared with.
class InMemoryTrainingState final : public TrainingStateStorage {
 public:
  static absl::StatusOr<std::unique_ptr<InMemoryTrainingState>> Create(const StateLayout& layout);
  const StateLayout& layout() const override { return layout_; }
  absl::StatusOr<StateBuffer> Read(StateKind k, std::size_t g, std::size_t part, bool) override;
  absl::StatusOr<StateBuffer> Overwrite(StateKind k, std::size_t g, std::size_t part,
                                        bool) override;
  absl::StatusOr<StateBuffer> Update(StateKind k, std::size_t g, std::size_t part) override;
  void Prefetch(StateKind, std::size_t, std::size_t) override {}
  absl::Status Discard(StateKind, std::size_t, std::size_t) override { return absl::OkStatus(); }
  absl::Status Commit(const CommitRecord& r) override;
  absl::StatusOr<std::optional<CommitRecord>> Resume(std::uint64_t fingerprint) override;

 private:
  explicit InMemoryTrainingState(StateLayout layout);
  absl::StatusOr<StateBuffer> At(StateKind k, std::size_t g, std::size_t part);
  StateLayout layout_;
  std::vector<std::vector<std::vector<std::byte>>> state_;  // [kind][group]
  std::optional<CommitRecord> committed_;
};

struct VersionedTrainingStateOptions {
  // The journaled object that holds the commit record.
  std::string record_name = "memascend.train_state";
  // Prefixed to every tensor's name ("<prefix><group>.<kind>.p<part>.v<version>").
  std::string tensor_prefix;
  // Note [state ownership]. Several states on one volume, each with its own record name
  // and tensor prefix (none a prefix of another's).
  bool share_volume = false;
  // Deletes what another state left on the volume (and this record's state of another
  // layout) instead of refusing it: that state is lost.
  bool replace_existing = false;
  // Note [state in place]: one version, updated in place (the state once on the volume);
  // false: two versions (Note [train state versions]), for data-parallel ranks.
  bool in_place = true;
  // Note [state in place], [bounded staging]: written-back tensors are committed once more
  // than this many bytes wait (the volume keeps the extents they replace until then); 0:
  // only at Commit. What the volume needs beyond the state (VolumeBytes).
  std::uint64_t max_staged_bytes = std::uint64_t{256} << 20;
  // Note [commit interval]: every commit_every-th step is durable (in place only; above
  // 1, max_staged_bytes 0 or at least the state). In [1, 1'000'000].
  std::uint32_t commit_every = 1;

  // A trainer's options (memascend-train's and memascend.torch's): in place, but for
  // data-parallel ranks (`two_versions`: the previous step kept whole until their commit,
  // Note [bounded staging]); staged unbounded under a commit interval, or with the whole
  // step staged and committed once (`stage_whole_step`, Note [commit interval]). Other
  // fields as default.
  static VersionedTrainingStateOptions ForTrainer(bool two_versions, std::uint32_t commit_every,
                                                  bool stage_whole_step);
};

// A training state in a TensorStore, in place or in two versions (Note [state in place],
// [train state versions], [background commit]).
class VersionedTrainingState final : public TrainingStateStorage {
 public:
  // Registers every part's tensors (of a volume that holds them, their stored bytes).
  // kAlreadyExists when the store already has tensors of these names.
  static absl::StatusOr<std::unique_ptr<VersionedTrainingState>> Open(
      TensorStore* store, ObjectStore* volume, const StateLayout& layout,
      const VersionedTrainingStateOptions& options = {});
  ~VersionedTrainingState() override;  // settles a commit in progress

  const StateLayout& layout() const override { return layout_; }
  int current_version() const noexcept { return current_; }
  // The tensor of a part in a version (0 or 1; gradients, and a state in place, have one:
  // both name it); kNotFound for a part not stored.
  absl::StatusOr<TensorId> Tensor(StateKind k, std::size_t group, std::size_t part,
                                  int version) const;

  absl::StatusOr<StateBuffer> Read(StateKind k, std::size_t g, std::size_t part,
                                   bool next) override;
  absl::StatusOr<StateBuffer> Overwrite(StateKind k, std::size_t g, std::size_t part,
                                        bool next) override;
  absl::StatusOr<StateBuffer> Update(StateKind k, std::size_t g, std::size_t part) override;
  void Prefetch(StateKind k, std::size_t g, std::size_t part) override;
  absl::Status Keep(StateKind k, std::size_t g, std::size_t part) override;
  absl::Status Discard(StateKind k, std::size_t g, std::size_t part) override;
  absl::Status GradientWritten(std::size_t g, std::size_t part) override;
  absl::StatusOr<TensorLease> ReadOnDevice(StateKind k, std::size_t g, std::size_t part,
                                           CudaStreamView stream) override;
  absl::Status BeginUpdate(const StepIntent& intent) override;
  absl::Status PartUpdated(std::size_t g, std::size_t part) override;
  std::optional<UnfinishedStep> Unfinished() const override;
  absl::Status Commit(const CommitRecord& r) override;
  absl::Status Settle() override;
  absl::Status Persist() override;
  // Note [commit interval]: the last step known durable (its commit settled: Settle(),
  // the next step's update, Persist), and the steps committed in memory since the last
  // commit began, which a crash would lose; whether a step's update is under way
  // (BeginUpdate ran, its Commit not yet).
  std::uint64_t durable_step() const noexcept;
  std::uint64_t deferred_steps() const noexcept;
  bool in_update() const noexcept;
  // The options the state runs with: Open's, but in two versions where the volume already
  // held this record so (an earlier release's state).
  const VersionedTrainingStateOptions& options() const noexcept;
  absl::StatusOr<std::optional<CommitRecord>> Resume(std::uint64_t fingerprint) override;
  absl::StatusOr<std::optional<CommitRecord>> ResumeAtMost(std::uint64_t fingerprint,
                                                           std::uint64_t step) override;
  std::uint64_t io_read_bytes() const override;
  std::uint64_t io_write_bytes() const override;
  std::optional<TensorStoreStats> store_stats() const override;

  // Volume bytes the layout's tensors take: every stored part once in place, else in both
  // versions (gradients once), rounded to the volume's 64 KiB extents.
  static std::uint64_t StoredBytes(const StateLayout& layout, bool in_place = true);
  // Note [volume size]: the size of a file volume for the layout: StoredBytes, what is
  // staged in flight (max_staged_bytes and a part's tensors, at most a whole version),
  // the journal Volume::Format makes for that size (1/512), and 16 MiB for the records.
  // Never twice the state, but with commit_every > 1 (Note [commit interval]: a whole
  // version staged). In place and bf16: 16 bytes per parameter and about 300 MiB.
  static std::uint64_t VolumeBytes(const StateLayout& layout,
                                   const VersionedTrainingStateOptions& options = {});
  // Of that, the data region the state needs: StoredBytes and what is staged in flight.
  static std::uint64_t DataBytes(const StateLayout& layout,
                                 const VersionedTrainingStateOptions& options = {});

 private:
  struct Impl;
  explicit VersionedTrainingState(std::unique_ptr<Impl> impl, StateLayout layout);
  std::string PreviousName() const;
  std::string ProgressName() const;
  absl::Status WritingNext();
  absl::Status WritingInPlace(StateKind k, bool step_write);
  absl::Status CommitBatch(bool background);
  absl::Status CommitWhole(std::string record, std::uint64_t step, bool background);
  absl::Status PartTensors(std::size_t from, std::size_t to, bool gradient,
                           std::vector<TensorId>* ids, std::vector<std::string>* names) const;
  absl::Status WriteBackParts(std::size_t from, std::size_t to, bool gradient);
  absl::Status DrainGradients();
  absl::Status RewritingGradient(TensorId id);
  absl::Status PutRecord(const std::string& name, const std::string& bytes);
  absl::StatusOr<std::optional<std::pair<CommitRecord, std::string>>> ReadRecord(
      const std::string& name, std::uint64_t fingerprint) const;
  StateLayout layout_;
  std::unique_ptr<Impl> impl_;
  int current_ = 0;
};

}  // namespace memascend

#endif  // MEMASCEND_TRAINING_STATE_H_
