// memascend/offloaded_optimizer.h: Adam/AdamW whose fp32 master weights and moments live
// in a TrainingStateStorage (on NVMe through a TensorStore, Note [train state versions]),
// updated part by part with the state read ahead under a byte budget; and a parameter
// stream that reads groups' parameters ahead in a window, forward or in reverse.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto adam,
//       memascend::OffloadedAdam::Create(state.get(), options, &threads));
//   for (g ...) MEMASCEND_RETURN_IF_ERROR(adam->Initialize(g, initial_fp32_weights));
//   MEMASCEND_RETURN_IF_ERROR(adam->Commit(0));
//   for each step:
//     adam->BeginBackward();                       // then, as each gradient is made:
//     MEMASCEND_RETURN_IF_ERROR(adam->SetGradient(g, part, grad_part_fp32));
//     MEMASCEND_ASSIGN_OR_RETURN(auto plan, adam->EndBackward());   // skipped on overflow
//     for (g ...) MEMASCEND_RETURN_IF_ERROR(adam->UpdateGroup(g, new_params_out));
//     MEMASCEND_ASSIGN_OR_RETURN(auto ticket, adam->CommitAsync(step));  // or Commit(step)
//
// A new user starts from memascend/offloaded_training.h, which owns the volume, the store,
// the state and this optimizer and sizes them from one budget; this header is for a
// trainer that wires them itself.
//
// Note [loss scaling]: by default the optimizer does not scale (OffloadedAdamOptions::
// scaler is NoLossScaling(): scale 1, never grown), so gradients go in as the backward
// pass made them and the update is plain AdamW's. An fp16 trainer opts in with
// `options.scaler = DynamicLossScaler::Options{}` (scale 65536, grown every 1000 good
// steps) and multiplies its loss by loss_scale(): its gradients then come scaled by it,
// and an overflow skips the step. An outside scaler's gradients: BeginBackward's
// `gradient_scale`.
//
// Note [failed update]: an update that fails part-way (an I/O error, a full budget) is
// not run again: UpdateGroup, UpdateAll and Commit then refuse (kFailedPrecondition with
// the first error), since parts updated in place would be updated twice. The storage
// keeps what is whole (Note [state in place]: the parts updated so far are committed as a
// torn step when it closes), and a reopened state resumes it.
//
// Note [commit durability]: Commit(step) returns once the step is durable (a process
// killed right after resumes at `step`); CommitAsync(step) starts the same commit in the
// background (Note [background commit] in training_state.h) and returns a CommitTicket
// at once, for a trainer that computes the next step meanwhile: a process killed before
// the ticket's Wait() (or Settle()) returned may resume at the step before. The storage's
// own TrainingStateStorage::Commit is the asynchronous one; OffloadedAdam names both.
// A storage with a commit interval (Note [commit interval] in training_state.h) makes
// only every commit_every-th step durable: Commit and the ticket then promise durability
// for those steps, and Persist() for every step committed so far.
//
// Note [parts]: every kind of state of a group is stored in parts (StateLayout). The
// update holds one part's gradient, next parameters, master weights and moments at a
// time and releases the gradient part at once, so what the update needs at once is a
// part, not a group: MinimumHostBudget(). Each part's new parameters go straight to the
// caller's buffer (UpdateGroup's `params_out`), so a forward pass interleaved with the
// update (Note [optimizer overlap]) reads none. Gradients are converted and checked part
// by part; the sum of squares for the clip coefficient runs on over the parts in order
// (SumOfSquares with a running total), which gives the bits of one sum over the group
// when parts are multiples of 2^16 elements (the sum's task): the results do not
// depend on the part size.
//
// Note [optimizer overlap]: the update of step s and the forward pass of step s + 1 can
// visit the groups in the same order, and the forward pass of group g needs only the new
// parameters of group g. UpdateGroup is therefore one call per group, for a caller to
// interleave with its forward pass; the arithmetic and its order are those of a
// sequential update. CommitAsync(step) after the last group makes the step durable in the
// background (Note [commit durability]).
//
// Note [read-ahead]: the update reads each part's gradient, master weights and moments
// ahead of its use, in update order, up to options.read_ahead_bytes beyond the part in
// hand. ReadAheadForUpdate() starts it before the gradients exist (under compute that
// reads little, such as the loss); their reads are added as they are written.
//
// Note [gradient room]: the backward pass writes every gradient before the update reads
// the first, and a gradient evicted in between costs a write and a read. With
// options.gradient_room, the read-ahead started before the update leaves room for the
// gradients still to come: it holds at most the read-ahead budget less the gradient bytes
// of the parts beyond its cursor (no less than three parts), and each gradient that fits
// is marked wanted when written (TensorStore Note [residency]). As the update discards
// each gradient part, the read-ahead takes its room.
//
// Note [kept state]: when the optimizer state is larger than the budget, least-recently-
// used eviction keeps none of it from one step to the next. options.keep_bytes of state,
// the first parts in update order, are marked kept (TensorStore Note [retention]): read
// once, then served from memory each step (still written back, as commits need).
//
// Note [derived parameters]: a group whose layout does not store its parameters gets them
// from its master weights, rounded to the parameter dtype (FusedAdam and Convert round to
// nearest even alike), so the bits are those that would have been stored.
//
// Note [step times]: times() splits the driving thread's time in the optimizer by phase
// (wall clock, summed): an update's time less its kernels' is the time its parts waited
// for the storage (reads, room, a batch's commit); a commit's wait can also fall in the
// next step's first gradient (its room), counted under gradients. A benchmark reads it
// per step to say where a step went; nothing in the optimizer depends on it.
//
// Thread-safety: one thread drives an optimizer (its kernels use `threads`).
// Lifetime: the storage and the threads must outlive the optimizer.
#ifndef MEMASCEND_OFFLOADED_OPTIMIZER_H_
#define MEMASCEND_OFFLOADED_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/kernels.h>
#include <memascend/training_state.h>

namespace memascend {

struct AdamGroupOptions {
  float lr = 1e-3f;
  float weight_decay = 0.0f;
};

// Note [global gradient check]: data-parallel ranks that each hold a shard of the
// gradients (Note [layout shards]) must plan the same step. EndBackward hands this rank's
// overflow flag and sum of squares (of the scaled gradients it holds) to the options'
// reduce_gradient_check, which returns every rank's together (an all-reduce: any overflow,
// the sum of the sums), before the loss scaler and the clip use them. It must return the
// same on every rank (MPI_Allreduce does); an error fails EndBackward.
struct GradientCheck {
  bool overflow = false;
  double sum_squares = 0;
};

// Note [loss scaling]: the options of a scaler that does not scale (scale 1, never grown;
// an overflow still skips its step). OffloadedAdamOptions' default.
DynamicLossScaler::Options NoLossScaling() noexcept;

struct OffloadedAdamOptions {
  float lr = 1e-3f;  // every group's, unless `groups` says otherwise
  float weight_decay = 0.0f;
  std::vector<AdamGroupOptions> groups;  // empty, or one per layout group
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  bool adamw = true;        // decoupled weight decay (AdamW) or L2 (Adam)
  float max_grad_norm = 0;  // clip the global norm to this; 0: no clipping
  // Note [loss scaling]: none by default (gradients as they are). fp16: set it to
  // DynamicLossScaler::Options{} (dynamic, from 65536) and scale the loss by loss_scale().
  DynamicLossScaler::Options scaler = NoLossScaling();
  std::uint64_t fingerprint = 0;  // the caller's: committed, and checked by Resume()
  // Optimizer state read ahead of the part being updated, in bytes (Note [read-ahead]);
  // at least MinimumReadAhead() is used.
  std::size_t read_ahead_bytes = 0;
  std::size_t keep_bytes = 0;  // Note [kept state]
  bool gradient_room = false;  // Note [gradient room]
  // How each gradient part is checked for inf/NaN: fused into the pass that sums its
  // squares for the norm (a non-finite sum is an overflow: Note [one pass], one read of
  // the part for both), or PyTorch's way with a byte-per-element temporary per pass
  // (HasOverflowWithTemporaries) before the sum, kept to measure what fusing saves (the
  // ablation). The same answer either way.
  enum class OverflowCheck { kFused, kTemporaries };
  OverflowCheck overflow_check = OverflowCheck::kFused;
  // Note [global gradient check]; empty: this optimizer holds every gradient.
  std::function<absl::StatusOr<GradientCheck>(const GradientCheck&)> reduce_gradient_check;
};

// What EndBackward() decided for the step.
struct StepPlan {
  bool skipped = false;  // overflow: no update; the gradients were discarded
  double grad_norm = 0;  // global, unscaled (0 when skipped)
  float loss_scale = 0;  // the scale the gradients were made with
  AdamConfig adam;       // group 0's (lr and weight decay differ per group)
};

class OffloadedAdam;

// A commit started by OffloadedAdam::CommitAsync (Note [commit durability]). Move-only.
// Destroying it neither waits nor cancels: the commit goes on, and the optimizer's next
// commit, its Settle() or the storage's destruction waits for it.
// Thread-safety: one thread, the optimizer's. Lifetime: the optimizer (its storage) must
// outlive the ticket's Wait().
class CommitTicket {
 public:
  CommitTicket() noexcept = default;  // empty: Wait() returns OK at once
  CommitTicket(CommitTicket&& other) noexcept
      : storage_(std::exchange(other.storage_, nullptr)), step_(other.step_) {}
  CommitTicket& operator=(CommitTicket&& other) noexcept {
    storage_ = std::exchange(other.storage_, nullptr);
    step_ = other.step_;
    return *this;
  }
  CommitTicket(const CommitTicket&) = delete;
  CommitTicket& operator=(const CommitTicket&) = delete;
  ~CommitTicket() = default;

  // Returns once the commit is durable (and any commit started after it), or the
  // commit's error: once a commit failed, the storage stays failed. Repeatable.
  absl::Status Wait();
  std::uint64_t step() const noexcept { return step_; }
  bool valid() const noexcept { return storage_ != nullptr; }

 private:
  friend class OffloadedAdam;
  CommitTicket(TrainingStateStorage* storage, std::uint64_t step) noexcept
      : storage_(storage), step_(step) {}
  TrainingStateStorage* storage_ = nullptr;
  std::uint64_t step_ = 0;
};

class OffloadedAdam {
 public:
  // kInvalidArgument for a bad layout, hyper-parameter or group count.
  static absl::StatusOr<std::unique_ptr<OffloadedAdam>> Create(TrainingStateStorage* storage,
                                                               const OffloadedAdamOptions& options,
                                                               KernelThreads* threads);

  // The least pinned memory a run over a TensorStore needs: twice what the update holds at
  // once (one part's gradient, next parameters, next master weights and moments, each made
  // from the current one in place), the room that keeps the pool from failing it for
  // fragments.
  static std::size_t MinimumHostBudget(const StateLayout& layout);
  // The least read-ahead: three parts' gradients, master weights and moments.
  static std::size_t MinimumReadAhead(const StateLayout& layout);

  const StateLayout& layout() const { return storage_->layout(); }
  TrainingStateStorage* storage() const { return storage_; }

  // ---- the state
  // Writes group g's current version from fp32 weights (group size): parameters rounded
  // (if stored), master weights, zero moments. For a new run, before the first Commit.
  absl::Status Initialize(std::size_t group, std::span<const float> weights);
  // The same from weights of any dtype (converted part by part: no fp32 copy of the group).
  absl::Status InitializeFrom(std::size_t group, TensorView weights);
  // The same for part `part` of group g alone (`weights`: its elements, any dtype), for a
  // caller that makes or reads a group a part at a time (a group larger than the memory
  // it may take). Every part of every group, before the first Commit. kOutOfRange for
  // a group or part that does not exist, kInvalidArgument for a wrong element count.
  absl::Status InitializePart(std::size_t group, std::size_t part, TensorView weights);
  // The last committed step's record, its scaler and Adam step restored; nullopt for a
  // state never committed. kFailedPrecondition for another run's state. A step a crash
  // tore in a state updated in place (Note [state in place] in training_state.h) is
  // finished first, from its durable gradients, and committed (durably): the record is
  // then its, as the uninterrupted run would have committed it (step: the last commit's
  // plus one; user bytes: the last commit's).
  absl::StatusOr<std::optional<CommitRecord>> Resume();
  // The same at the newest commit at or before `step` (TrainingStateStorage::ResumeAtMost):
  // for data-parallel ranks agreeing on the step every rank holds.
  absl::StatusOr<std::optional<CommitRecord>> ResumeAtMost(std::uint64_t step);
  // Commits the current state as `step` (after a whole update, or a skipped step, or the
  // initial state): version, Adam step, scaler, fingerprint and `user` bytes; returns
  // once it is durable (Note [commit durability]), or with the commit's error.
  // kFailedPrecondition with an update begun and not finished.
  absl::Status Commit(std::uint64_t step, std::string_view user = {});
  // The same commit, started in the background: returns at once with a ticket whose
  // Wait() says when it is durable. The next commit settles this one first. Errors that
  // refuse the commit (as Commit's) come back here, the write's from the ticket.
  absl::StatusOr<CommitTicket> CommitAsync(std::uint64_t step, std::string_view user = {});
  // Waits for the commit in progress, if any: durable, or its error.
  absl::Status Settle();
  // Every step committed so far durable (Note [commit interval] in training_state.h).
  absl::Status Persist();

  // ---- the state, whole: export to and import from another optimizer's format
  // Group g's current `kind` into `out` (the group's elements), part by part: kMaster,
  // kExpAvg and kExpAvgSq in any dtype (they are fp32), kParameters as LoadParameters.
  // kInvalidArgument for the gradient kind or a wrong element count.
  absl::Status ReadState(StateKind kind, std::size_t group, MutableTensorView out);
  // Elements [first, first + out.elements) of the same: a large group a range at a time,
  // with no buffer for the whole of it (the parts the range covers are read, each once).
  // kOutOfRange for a range past the group's end; kInvalidArgument for the gradient kind.
  absl::Status ReadStateRange(StateKind kind, std::size_t group, std::size_t first,
                              MutableTensorView out);
  // Overwrites group g's current `kind` from `in` (converted to the stored dtype). A group
  // with stored parameters keeps them apart from its master weights: write both (derived
  // parameters follow the master weights by themselves). Committed by the next Commit.
  // kFailedPrecondition with an update planned; kInvalidArgument as ReadState.
  absl::Status WriteState(StateKind kind, std::size_t group, TensorView in);
  // The Adam step the next update follows (its bias correction), for an imported state.
  // kInvalidArgument for a negative step; kFailedPrecondition with an update planned.
  absl::Status SetAdamStep(std::int64_t step);
  // A fresh start over a resumed state (a caller that writes new weights with Initialize
  // rather than continue): the Adam step back to 0 and the loss scaler to the options'
  // initial one, which Resume() had taken from the last commit. kFailedPrecondition with an
  // update planned.
  absl::Status StartOver();

  // ---- the gradients
  // Starts a step's gradients: the overflow flag and the norm are reset. May be called
  // while the previous step's update is still to run (Note [optimizer overlap]).
  // `gradient_scale` > 0: the gradients come scaled by it, not by loss_scale() (an outside
  // loss scaler's, such as PyTorch's GradScaler; the options' scaler then keeps scale 1).
  void BeginBackward(float gradient_scale = 0);
  // Part `part` of group g's gradient (its elements, scaled by loss_scale()), converted
  // to the layout's gradient dtype, checked for overflow, added to the norm. Every
  // gradient entry below is kFailedPrecondition outside a backward pass (before
  // BeginBackward, or after EndBackward until the next): its norm and overflow flag would
  // be the last step's, and its scale the last step's scale. Note [every part once]: each
  // part takes one gradient a step (a second is kFailedPrecondition: its squares would
  // count twice in the norm), and EndBackward refuses a step that left one out (its
  // stored gradient is the last step's, or nothing: give a parameter without a gradient
  // zeros, as memascend.torch and DeepSpeed do), planning nothing: BeginBackward again and
  // give every part. With a reduce_gradient_check (data parallel) that refusal comes after
  // the ranks' check, on the rank that left a part out only: agree on a rank's failed
  // gradients before EndBackward (memascend.torch does), as on any other failure.
  absl::Status SetGradient(std::size_t group, std::size_t part, TensorView gradient);
  // The same, for a caller that writes the gradient in place: `fill` gets the part's
  // stored gradient to write every element of.
  absl::Status WriteGradient(std::size_t group, std::size_t part,
                             const std::function<absl::Status(MutableTensorView)>& fill);
  // For a caller that fills a part asynchronously (a copy from the device:
  // DeviceGradients): the part's stored gradient buffer (its elements in the layout's
  // gradient dtype, every byte to be written), then, once its bytes are there,
  // EndGradient does what WriteGradient does after `fill` (the overflow check, the norm)
  // and lets the buffer go. The buffer holds a pinned block of the store meanwhile.
  absl::StatusOr<StateBuffer> BeginGradient(std::size_t group, std::size_t part);
  absl::Status EndGradient(std::size_t group, std::size_t part, StateBuffer gradient);
  // The scale the step's gradients carry, when it is known only after they were made (an
  // outside scaler's, read at the optimizer's step while the gradients went out during the
  // backward pass); as BeginBackward's `gradient_scale`, without resetting the checks.
  void SetGradientScale(float gradient_scale);
  // After every part's gradient: the overflow check (one, for a storage that checks
  // after the backward pass), the loss scaler's update, and the step's plan; a skipped
  // step discards the gradients. `lr_factor` scales every group's lr (a schedule).
  // kFailedPrecondition without a BeginBackward since the last EndBackward (the plan would
  // be of the last step's norm and gradients).
  absl::StatusOr<StepPlan> EndBackward(double lr_factor = 1.0);
  float loss_scale() const noexcept { return scaler_.scale(); }
  const DynamicLossScaler& scaler() const noexcept { return scaler_; }
  std::int64_t adam_step() const noexcept { return adam_step_; }
  // Where the driving thread's time went, summed since construction (Note [step times]).
  struct Times {
    double gradients = 0;       // Begin/End/Write/SetGradient: conversion, checks, and
                                // the storage's waits for a gradient's room
    double end_backward = 0;    // EndBackward: the overflow check, the scaler, the plan
    double update = 0;          // UpdateGroup, whole
    double update_kernels = 0;  // of which the fused Adam and the parameters' copy out
    double commit = 0;          // Commit, CommitAsync, Settle, Persist: starting and waiting
  };
  const Times& times() const noexcept { return times_; }
  bool update_pending() const noexcept { return pending_.has_value(); }

  // ---- the update
  // Starts the read-ahead before the gradients exist (Note [read-ahead]); optional.
  void ReadAheadForUpdate();
  // Updates group g part by part (Note [parts]); the new parameters also go to
  // `params_out` (the group's elements, any dtype; empty: none). Groups in order, once
  // each. kFailedPrecondition without a planned update.
  absl::Status UpdateGroup(std::size_t group, MutableTensorView params_out = {});
  // Every group in order (or the storage's own update), calling `after_group` after each.
  absl::Status UpdateAll(const std::function<void(std::size_t)>& after_group = {});
  // Sets a group's lr and weight decay for the steps planned (EndBackward) after this call.
  absl::Status SetGroupOptions(std::size_t group, const AdamGroupOptions& options);

  // ---- the parameters
  // Group g's newest parameters into `out` (its elements, any dtype), part by part (of a
  // derived group, rounded from the master weights): those of the update in progress
  // once it has reached the group (Note [optimizer overlap]: a forward pass interleaved
  // with the update reads the new parameters before they are committed), else the
  // current ones.
  absl::Status LoadParameters(std::size_t group, MutableTensorView out);
  // Part `part` of group g's newest stored parameters, in place (as LoadParameters picks
  // the version); kFailedPrecondition for derived parameters.
  absl::StatusOr<StateBuffer> ReadParameters(std::size_t group, std::size_t part);
  // True while an update is planned that has not reached group g yet: its parameters
  // will change before the step is committed (a reader ahead of the update waits).
  bool UpdatePendingFor(std::size_t group) const noexcept {
    return pending_.has_value() && group >= pending_->next_group;
  }
  void PrefetchParameters(std::size_t group);

 private:
  OffloadedAdam(TrainingStateStorage* storage, const OffloadedAdamOptions& options,
                KernelThreads* threads);
  absl::Status KeepState();
  absl::Status FinishTornStep();
  absl::Status UpdateParts(std::size_t g, const AdamConfig& adam, MutableTensorView params_out);
  absl::Status FailedUpdate() const;
  absl::Status LoadParameterRange(std::size_t g, std::size_t first, MutableTensorView out);
  std::string EncodeRedo() const;
  // The update in progress has written group g's next version (not yet committed).
  bool Updated(std::size_t g) const noexcept {
    return pending_.has_value() && g < pending_->next_group;
  }
  bool Kept(std::size_t g, std::size_t part) const;
  std::size_t GradBytesBefore(std::size_t g, std::size_t part) const;
  std::size_t PartStateBytes(std::size_t g, std::size_t part) const;
  absl::Status FinishGradient(std::size_t g, std::size_t part, const StateBuffer& grad);
  void StartReadAhead(bool grads_ready);
  void ContinueReadAhead();
  void ReadAhead(std::size_t g, std::size_t part);
  void Fill();
  KernelOptions K() const { return {threads_}; }

  TrainingStateStorage* storage_;
  OffloadedAdamOptions o_;
  KernelThreads* threads_;
  DynamicLossScaler scaler_;
  std::vector<AdamGroupOptions> groups_;
  int version_ = 0;  // the committed version
  std::int64_t adam_step_ = 0;
  Times times_;
  // Gradients of the step in progress.
  float scale_ = 1;
  bool overflow_ = false;
  double sum_squares_ = 0;
  bool in_backward_ = false;  // BeginBackward ran, EndBackward not yet
  std::vector<bool> given_;   // Note [every part once]: by part_base_[g] + part
  // The update planned by EndBackward: its Adam step, lr factor and multiplier.
  struct Pending {
    AdamConfig adam;
    double lr_factor = 1;
    std::vector<AdamGroupOptions> groups;  // each group's lr and weight decay, as planned
    std::size_t next_group = 0;            // groups updated so far
    bool begun = false;          // the storage was told (TrainingStateStorage::BeginUpdate)
    std::string failed;          // Note [failed update]: why the update stopped part-way
    std::size_t skip_parts = 0;  // parts, in layout order, a torn step finished already
  };
  std::optional<Pending> pending_;
  bool skipped_ = false;  // the last plan was a skipped step, not yet committed
  std::size_t read_ahead_;
  std::size_t grad_room_ = 0;
  std::vector<std::size_t> part_base_, grad_before_;    // Note [gradient room]
  std::pair<std::size_t, std::size_t> keep_end_{0, 0};  // the first part not kept
  std::vector<std::byte> derived_;  // one part's parameters, for a derived group
  struct Ahead {
    std::size_t g, part, bytes;
  };
  std::deque<Ahead> ahead_;
  std::size_t ahead_bytes_ = 0;
  std::size_t cursor_g_ = 0, cursor_part_ = 0;  // the next part to read ahead
  bool ahead_started_ = false;
  bool grads_ready_ = false;
};

// Streams groups' parameters in a window: loading group g first prefetches the next
// `window` groups in the walk's direction, within [first, last).
// Thread-safety: one thread at a time. Lifetime: the optimizer must outlive the stream.
class ParameterStream {
 public:
  enum class Direction { kForward, kReverse };
  ParameterStream(OffloadedAdam* optimizer, std::size_t first, std::size_t last,
                  std::size_t window);
  // Prefetches the window after `group` in `direction`, then loads `group` into `out`.
  absl::Status Load(std::size_t group, MutableTensorView out, Direction direction);
  // Prefetches the window after `group` (which is not loaded).
  void PrefetchAfter(std::size_t group, Direction direction);
  // A stored part of the group's current parameters on the GPU tier (its copy queued on
  // `stream`): kFailedPrecondition without a GPU tier, kNotFound for derived parameters.
  absl::StatusOr<TensorLease> AcquireOnDevice(std::size_t group, std::size_t part,
                                              CudaStreamView stream);

 private:
  OffloadedAdam* optimizer_;
  std::size_t first_, last_, window_;
};

}  // namespace memascend

#endif  // MEMASCEND_OFFLOADED_OPTIMIZER_H_
