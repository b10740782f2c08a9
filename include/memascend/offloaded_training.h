// memascend/offloaded_training.h: the entry point of a trainer that keeps its optimizer
// state on NVMe. One call opens (or creates) the volume, sizes the pinned host budget, the
// read-ahead and the volume from the layout, checks them, opens the tensor store, the
// versioned training state and the AdamW optimizer over it, and resumes or initializes
// the state; one object owns them all.
//
//   memascend::OffloadedTrainingOptions o;
//   o.volume_path = "/nvme/run.vol";                  // created when missing
//   o.groups = {{"embed", 4'194'304}, {"block.0", 786'432}};
//   o.dtype = memascend::DType::kBF16;
//   o.lr = 3e-4f;                                     // AdamW: plain gradients, no scaling
//   o.resume = true;                                  // continue a committed state if any
//   o.initial_weights = [&](std::size_t g, std::span<float> w) { ...; return absl::OkStatus(); };
//   MEMASCEND_ASSIGN_OR_RETURN(auto run, memascend::OffloadedTraining::Open(o));
//   for (std::uint64_t step = run->step(); step < steps; ++step) {
//     for (g ...) MEMASCEND_RETURN_IF_ERROR(run->LoadParameters(g, {w, n, DType::kF32}));
//     ...forward, backward...
//     run->BeginStep();
//     for (g ...) MEMASCEND_RETURN_IF_ERROR(run->SetGradient(g, {grad, n, DType::kF32}));
//     MEMASCEND_ASSIGN_OR_RETURN(memascend::StepPlan plan, run->Step());
//     MEMASCEND_RETURN_IF_ERROR(run->Commit(step + 1));     // durable when it returns
//   }
//   MEMASCEND_RETURN_IF_ERROR(run->Close());
//
// Note [open checks]: what a wrong figure would break later is refused by Open, before
// anything is written to the volume (a volume file Open created is removed again):
// - a given host budget below OffloadedAdam::MinimumHostBudget (kResourceExhausted, both
//   figures, the option and the part size); with none given, ChooseHostBudget's refusal
//   when the machine leaves less (Note [default host budget] in host_budget.h);
// - a volume whose data region is below RequiredVolumeBytes (kResourceExhausted: bytes
//   needed and present, and the option that sizes a new volume);
// - a volume holding another state, or this state of another layout (a changed model,
//   dtype or part size): kFailedPrecondition, VersionedTrainingState's Note [state
//   ownership]; `overwrite` replaces it;
// - a volume holding a committed state with neither `resume` nor `overwrite`
//   (kFailedPrecondition naming its step), and one of another run (`run_id`) on resume;
// - `resume` with `overwrite`, bad hyper-parameters (kInvalidArgument); a new state and
//   neither `initial_weights` nor `initial_weights_part`, or both (kInvalidArgument).
//
// Note [one budget]: the pinned host budget (given, or chosen from the machine) is the
// only figure of memory: the update holds half of MinimumHostBudget() at once, and the rest
// is read-ahead (OffloadedAdam Note [read-ahead]), at least MinimumReadAhead(). Nothing is
// kept across steps (OffloadedAdam Note [kept state]: at the minimum budget, keeping half
// the spare budget read less but ran slower, docs/training.md); a budget that holds the
// whole state keeps it all resident anyway.
//
// Note [volume room]: the volume holds both versions of every stored part
// (VersionedTrainingState::StoredBytes) and what is staged in flight before it is committed
// (training_state.h Note [bounded staging]): RequiredVolumeBytes is
// VersionedTrainingState::DataBytes. A new volume file gets VolumeBytes (Note [volume size]:
// that, its journal and a margin), never twice the state.
//
// Thread-safety: one thread drives an OffloadedTraining (the optimizer's background
// commit is internal). Lifetime: the object owns the volume, store, state, threads and
// optimizer; the pointers its accessors return live as long as it (until Close()).
#ifndef MEMASCEND_OFFLOADED_TRAINING_H_
#define MEMASCEND_OFFLOADED_TRAINING_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/host_budget.h>
#include <memascend/kernels.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/tensor_store.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

namespace memascend {

struct OffloadedTrainingOptions {
  // A regular file (created, of volume_bytes, when missing or empty) or a formatted block
  // device or file.
  std::string volume_path;

  // The model: its groups (name, elements, whether 16-bit parameters are stored:
  // StateLayout Note [state layout]), the dtype of its parameters and gradients (fp16,
  // bf16 or fp32) and the elements the update holds at once (a multiple of 2^18 keeps
  // the results independent of it). `layout`, when given (groups not empty), is used
  // instead of these four.
  std::vector<StateGroup> groups;
  DType dtype = DType::kBF16;
  std::size_t part_elements = std::size_t{1} << 20;
  StateLayout layout;

  // AdamW's hyper-parameters, PyTorch's defaults (torch.optim.AdamW).
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  std::vector<AdamGroupOptions> group_options;  // empty, or each group's lr and decay
  float max_grad_norm = 0;                      // clip the global norm to this; 0: none
  // OffloadedAdam Note [loss scaling]: none by default. fp16: DynamicLossScaler::Options{}.
  DynamicLossScaler::Options loss_scaler = NoLossScaling();
  std::uint64_t run_id = 0;  // committed with the state; another run's is refused on resume

  // Pinned host bytes (Note [one budget]); 0: chosen from the machine (ChooseHostBudget,
  // less `other_bytes`, the caller's estimate of its own memory: activations, buffers).
  std::uint64_t host_budget_bytes = 0;
  std::uint64_t other_bytes = 0;
  // Size of a new volume file; 0: DefaultVolumeBytes (Note [volume room]).
  std::uint64_t volume_bytes = 0;

  // A volume holding a committed state: continue it (resume) or start over, that state
  // lost (overwrite); neither refuses it. With no committed state, both start anew.
  bool resume = false;
  bool overwrite = false;
  // A new state's fp32 weights of group g (its elements), called once per group by Open.
  std::function<absl::Status(std::size_t group, std::span<float> weights)> initial_weights;
  // Or (not both) elements [begin, begin + weights.size()) of group g, called for each
  // stored part (Note [parts] in training_state.h) in order: no group is ever whole in
  // memory (a 128256 x 4096 embedding is 2 GiB of fp32).
  std::function<absl::Status(std::size_t group, std::size_t begin, std::span<float> weights)>
      initial_weights_part;

  int threads = 0;  // CPU threads of the update, in [0, 1024]; 0: every core
};

class OffloadedTraining {
 public:
  // Note [open checks]. A new state is initialized from options.initial_weights and
  // committed as step 0 (durable) before Open returns.
  static absl::StatusOr<std::unique_ptr<OffloadedTraining>> Open(
      const OffloadedTrainingOptions& options);
  // Settles the commit in progress and closes what it owns (errors go to stderr, as the
  // store's destructor does: call Close() to get them).
  ~OffloadedTraining();
  OffloadedTraining(const OffloadedTraining&) = delete;
  OffloadedTraining& operator=(const OffloadedTraining&) = delete;

  // The layout options describe (groups, dtypes, parts), checked.
  static absl::StatusOr<StateLayout> LayoutOf(const OffloadedTrainingOptions& options);
  // Note [volume room]: the data bytes a volume needs for the layout, and the size of a
  // new volume file that has them.
  static std::uint64_t RequiredVolumeBytes(const StateLayout& layout);
  static std::uint64_t DefaultVolumeBytes(const StateLayout& layout);

  // ---- a step (OffloadedAdam's, with whole groups)
  // Group g's current parameters into `out` (its elements, any dtype).
  absl::Status LoadParameters(std::size_t group, MutableTensorView out);
  // Starts a step's gradients.
  void BeginStep();
  // Group g's whole gradient (its elements, any dtype), as the backward pass made it (times
  // loss_scale() only with loss scaling opted in), stored part by part.
  absl::Status SetGradient(std::size_t group, TensorView gradient);
  // The overflow check, the clip and the update of every group; `lr_factor` scales the lr
  // (a schedule). A skipped step (an inf or NaN gradient) changes no weight.
  absl::StatusOr<StepPlan> Step(double lr_factor = 1.0);
  // OffloadedAdam Note [commit durability]: Commit returns once `step` is durable;
  // CommitAsync returns at once with a ticket.
  absl::Status Commit(std::uint64_t step, std::string_view user = {});
  absl::StatusOr<CommitTicket> CommitAsync(std::uint64_t step, std::string_view user = {});
  absl::Status Settle();  // the commit in progress durable, or its error

  // Settles, then closes the state, the store (writing back) and the volume, returning the
  // first error. Afterwards only the destructor and the figures below may be called.
  absl::Status Close();

  // ---- what Open found and chose
  // The record resumed from; nullopt for a new state.
  const std::optional<CommitRecord>& resumed() const noexcept { return resumed_; }
  // The last step committed (started, for CommitAsync): the resumed one, 0 for a new state.
  std::uint64_t step() const noexcept { return step_; }
  const StateLayout& layout() const noexcept { return layout_; }
  // The budget in use and why (its `warning`, when not empty, is the memlock advice for the
  // caller to print: Open prints nothing).
  const HostBudget& host_budget() const noexcept { return budget_; }
  std::size_t read_ahead_bytes() const noexcept { return read_ahead_; }
  float loss_scale() const noexcept { return adam_ ? adam_->loss_scale() : 1.0f; }

  // ---- the parts, for advanced use (owned: valid until Close() or destruction)
  OffloadedAdam* optimizer() const noexcept { return adam_.get(); }
  VersionedTrainingState* state() const noexcept { return state_.get(); }
  TensorStore* store() const noexcept { return store_.get(); }
  Volume* volume() const noexcept { return volume_.get(); }

 private:
  OffloadedTraining() = default;
  absl::Status Start(const OffloadedTrainingOptions& options);

  StateLayout layout_;
  HostBudget budget_;
  std::size_t read_ahead_ = 0;
  std::optional<CommitRecord> resumed_;
  std::uint64_t step_ = 0;
  // Destroyed bottom up: the optimizer, the state (it settles), the store (it writes
  // back), the threads, then the volume.
  std::unique_ptr<Volume> volume_;
  std::unique_ptr<KernelThreads> threads_;
  std::unique_ptr<TensorStore> store_;
  std::unique_ptr<VersionedTrainingState> state_;
  std::unique_ptr<OffloadedAdam> adam_;
};

}  // namespace memascend

#endif  // MEMASCEND_OFFLOADED_TRAINING_H_
