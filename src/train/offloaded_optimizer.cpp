#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include <memascend/offloaded_optimizer.h>
#include <memascend/status.h>

#include "util/timed.h"

namespace memascend {
namespace {

using util::Timed;  // the phases' seconds (Note [step times])

std::size_t RoundPage(std::size_t b) { return (b + 4095) / 4096 * 4096; }

constexpr StateKind kStateKinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};

}  // namespace

DynamicLossScaler::Options NoLossScaling() noexcept {
  DynamicLossScaler::Options o;
  o.initial_scale = 1.0f;
  o.min_scale = 1.0f;
  o.growth_factor = 1.0f;
  o.growth_interval = INT64_MAX;
  return o;
}

absl::Status CommitTicket::Wait() {
  return storage_ == nullptr ? absl::OkStatus() : storage_->Settle();
}

std::size_t OffloadedAdam::MinimumHostBudget(const StateLayout& layout) {
  const std::size_t part = layout.MaxPartElements();
  const std::size_t held = RoundPage(part * layout.ElementBytes(StateKind::kGradient)) +
                           RoundPage(part * layout.ElementBytes(StateKind::kParameters)) +
                           3 * RoundPage(part * 4);
  // Twice what is held at once: the blocks the update leases (at most four while it asks
  // for the fifth) split the free memory into at most five extents, and with the room of a
  // second set they cannot all be smaller than the largest block; with the set alone, an
  // update of fp32 parts of 2^18 or bf16 ones failed at its first step for want of one
  // block (the pool "fragmented") with the budget this allowed.
  return 2 * held;
}

std::size_t OffloadedAdam::MinimumReadAhead(const StateLayout& layout) {
  return 3 * layout.MaxPartElements() * (12 + layout.ElementBytes(StateKind::kGradient));
}

OffloadedAdam::OffloadedAdam(TrainingStateStorage* storage, const OffloadedAdamOptions& options,
                             KernelThreads* threads)
    : storage_(storage), o_(options), threads_(threads), scaler_(options.scaler) {}

absl::StatusOr<std::unique_ptr<OffloadedAdam>> OffloadedAdam::Create(
    TrainingStateStorage* storage, const OffloadedAdamOptions& options, KernelThreads* threads) {
  if (storage == nullptr) return absl::InvalidArgumentError("offloaded adam: null storage");
  const StateLayout& layout = storage->layout();
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  const std::size_t groups = layout.groups.size();
  if (!options.groups.empty() && options.groups.size() != groups) {
    return absl::InvalidArgumentError(
        fmt::format("offloaded adam: {} group options for a layout of {} groups",
                    options.groups.size(), groups));
  }
  if (!(options.max_grad_norm >= 0) || !std::isfinite(options.max_grad_norm))
    return absl::InvalidArgumentError(fmt::format(
        "offloaded adam: max_grad_norm {} is not a finite value >= 0", options.max_grad_norm));
  auto adam = std::unique_ptr<OffloadedAdam>(new OffloadedAdam(storage, options, threads));
  adam->groups_ = options.groups.empty()
                      ? std::vector<AdamGroupOptions>(groups, {options.lr, options.weight_decay})
                      : options.groups;
  for (std::size_t g = 0; g < groups; ++g)
    MEMASCEND_RETURN_IF_ERROR(adam->SetGroupOptions(g, adam->groups_[g]));
  {
    AdamConfig probe;
    probe.beta1 = options.beta1;
    probe.beta2 = options.beta2;
    probe.eps = options.eps;
    if (!(probe.beta1 >= 0 && probe.beta1 < 1) || !(probe.beta2 >= 0 && probe.beta2 < 1) ||
        !(probe.eps > 0) || !std::isfinite(probe.eps)) {
      return absl::InvalidArgumentError(
          fmt::format("offloaded adam: betas ({}, {}) must be in [0, 1) and eps {} finite and > 0",
                      probe.beta1, probe.beta2, probe.eps));
    }
  }
  // Note [gradient room]: the gradients' bytes in update order, and how much of the
  // read-ahead they may claim.
  const std::size_t grad_bytes = layout.ElementBytes(StateKind::kGradient);
  adam->grad_before_.push_back(0);
  for (std::size_t g = 0; g < groups; ++g) {
    adam->part_base_.push_back(adam->grad_before_.size() - 1);
    for (std::size_t part = 0; part < layout.Parts(g); ++part) {
      const auto [begin, end] = layout.PartRange(g, part);
      adam->grad_before_.push_back(adam->grad_before_.back() + (end - begin) * grad_bytes);
    }
  }
  const std::size_t floor = MinimumReadAhead(layout);
  adam->read_ahead_ = std::max(options.read_ahead_bytes, floor);
  adam->grad_room_ =
      options.gradient_room && adam->read_ahead_ > floor ? adam->read_ahead_ - floor : 0;
  std::size_t derived = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    if (!layout.Stored(StateKind::kParameters, g))
      derived = std::max(derived, std::min(layout.part_elements, layout.groups[g].elements));
  }
  adam->derived_.resize(derived * layout.ElementBytes(StateKind::kParameters));
  MEMASCEND_RETURN_IF_ERROR(adam->KeepState());
  return adam;
}

absl::Status OffloadedAdam::SetGroupOptions(std::size_t group, const AdamGroupOptions& options) {
  if (group >= groups_.size())
    return absl::OutOfRangeError(fmt::format("adam: no group {}", group));
  if (!(options.lr >= 0) || !std::isfinite(options.lr) || !(options.weight_decay >= 0) ||
      !std::isfinite(options.weight_decay)) {
    return absl::InvalidArgumentError(
        fmt::format("adam: group {}'s lr {} and weight decay {} must be finite and >= 0", group,
                    options.lr, options.weight_decay));
  }
  groups_[group] = options;
  return absl::OkStatus();
}

// Note [kept state]: the first parts in update order, up to keep_bytes.
absl::Status OffloadedAdam::KeepState() {
  std::size_t kept = 0;
  const StateLayout& l = layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t part = 0; part < l.Parts(g); ++part) {
      if (kept + PartStateBytes(g, part) > o_.keep_bytes) return absl::OkStatus();
      kept += PartStateBytes(g, part);
      for (StateKind k : kStateKinds) MEMASCEND_RETURN_IF_ERROR(storage_->Keep(k, g, part));
      keep_end_ = {g, part + 1};
    }
  }
  return absl::OkStatus();
}

bool OffloadedAdam::Kept(std::size_t g, std::size_t part) const {
  return g < keep_end_.first || (g == keep_end_.first && part < keep_end_.second);
}
std::size_t OffloadedAdam::GradBytesBefore(std::size_t g, std::size_t part) const {
  return grad_before_[part_base_[g] + part];
}
std::size_t OffloadedAdam::PartStateBytes(std::size_t g, std::size_t part) const {
  const auto [begin, end] = layout().PartRange(g, part);
  return 3 * (end - begin) * 4;
}

// ---- the state --------------------------------------------------------------------------

absl::Status OffloadedAdam::Initialize(std::size_t g, std::span<const float> weights) {
  return InitializeFrom(g, TensorView{weights.data(), weights.size(), DType::kF32});
}

absl::Status OffloadedAdam::InitializeFrom(std::size_t g, TensorView weights) {
  const StateLayout& l = layout();
  if (g >= l.groups.size()) return absl::OutOfRangeError(fmt::format("adam: no group {}", g));
  if (weights.elements != l.groups[g].elements) {
    return absl::InvalidArgumentError(fmt::format("adam: group '{}' has {} elements, not {}",
                                                  l.groups[g].name, l.groups[g].elements,
                                                  weights.elements));
  }
  const std::size_t in_bytes = SizeOf(weights.dtype);
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const auto [begin, end] = l.PartRange(g, part);
    MEMASCEND_RETURN_IF_ERROR(
        InitializePart(g, part,
                       {static_cast<const std::byte*>(weights.data) + begin * in_bytes, end - begin,
                        weights.dtype}));
  }
  return absl::OkStatus();
}

absl::Status OffloadedAdam::InitializePart(std::size_t g, std::size_t part, TensorView from) {
  const StateLayout& l = layout();
  if (g >= l.groups.size()) return absl::OutOfRangeError(fmt::format("adam: no group {}", g));
  if (part >= l.Parts(g)) {
    return absl::OutOfRangeError(fmt::format("adam: group '{}' has {} parts, not a part {}",
                                             l.groups[g].name, l.Parts(g), part));
  }
  const auto [begin, end] = l.PartRange(g, part);
  const std::size_t n = end - begin;
  if (from.elements != n) {
    return absl::InvalidArgumentError(
        fmt::format("adam: part {} of group '{}' has {} elements, not {}", part, l.groups[g].name,
                    n, from.elements));
  }
  if (l.Stored(StateKind::kParameters, g)) {
    MEMASCEND_ASSIGN_OR_RETURN(StateBuffer param,
                               storage_->Overwrite(StateKind::kParameters, g, part, false));
    MEMASCEND_RETURN_IF_ERROR(Convert(from, {param.data, n, l.param_dtype}, K()));
  }
  MEMASCEND_ASSIGN_OR_RETURN(StateBuffer master,
                             storage_->Overwrite(StateKind::kMaster, g, part, false));
  MEMASCEND_RETURN_IF_ERROR(Convert(from, {master.data, n, DType::kF32}, K()));
  for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    MEMASCEND_ASSIGN_OR_RETURN(StateBuffer st, storage_->Overwrite(k, g, part, false));
    std::memset(st.data, 0, st.bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<CommitRecord>> OffloadedAdam::Resume() {
  return ResumeAtMost(UINT64_MAX);
}

absl::StatusOr<std::optional<CommitRecord>> OffloadedAdam::ResumeAtMost(std::uint64_t step) {
  MEMASCEND_ASSIGN_OR_RETURN(std::optional<CommitRecord> r,
                             step == UINT64_MAX ? storage_->Resume(o_.fingerprint)
                                                : storage_->ResumeAtMost(o_.fingerprint, step));
  if (!r.has_value()) return r;
  MEMASCEND_RETURN_IF_ERROR(scaler_.Restore(r->scaler));
  if (r->adam_step < 0)
    return absl::DataLossError(fmt::format("commit record: adam step {}", r->adam_step));
  adam_step_ = r->adam_step;
  version_ = r->version;
  pending_.reset();
  skipped_ = false;
  ahead_started_ = false;
  if (storage_->Unfinished().has_value()) {
    MEMASCEND_RETURN_IF_ERROR(FinishTornStep());
    return storage_->Resume(o_.fingerprint);
  }
  return r;
}

// ---- Note [state in place]: a torn step's redo ----------------------------------------

namespace {
constexpr char kRedoMagic[8] = {'M', 'A', 'R', 'E', 'D', 'O', '0', '1'};
template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
bool Get(std::string_view* in, T* v) {
  if (in->size() < sizeof(T)) return false;
  std::memcpy(v, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}
}  // namespace

// What the update of any part of the planned step needs: its Adam settings, the lr factor
// and every group's lr and weight decay.
std::string OffloadedAdam::EncodeRedo() const {
  std::string out(kRedoMagic, sizeof(kRedoMagic));
  const AdamConfig& a = pending_->adam;
  Put(&out, a.lr);
  Put(&out, a.beta1);
  Put(&out, a.beta2);
  Put(&out, a.eps);
  Put(&out, a.weight_decay);
  Put(&out, static_cast<std::uint8_t>(a.adamw ? 1 : 0));
  Put(&out, a.step);
  Put(&out, a.grad_multiplier);
  Put(&out, pending_->lr_factor);
  Put(&out, static_cast<std::uint64_t>(pending_->groups.size()));
  for (const AdamGroupOptions& g : pending_->groups) {
    Put(&out, g.lr);
    Put(&out, g.weight_decay);
  }
  return out;
}

// Updates the parts of the torn step not yet durable, with its settings, and commits it.
absl::Status OffloadedAdam::FinishTornStep() {
  const UnfinishedStep torn = *storage_->Unfinished();
  std::string_view in = torn.intent.redo;
  Pending p;
  AdamConfig& a = p.adam;
  std::uint8_t adamw = 0;
  std::uint64_t groups = 0;
  const bool read = in.size() >= sizeof(kRedoMagic) &&
                    std::memcmp(in.data(), kRedoMagic, sizeof(kRedoMagic)) == 0 &&
                    (in.remove_prefix(sizeof(kRedoMagic)), true) && Get(&in, &a.lr) &&
                    Get(&in, &a.beta1) && Get(&in, &a.beta2) && Get(&in, &a.eps) &&
                    Get(&in, &a.weight_decay) && Get(&in, &adamw) && Get(&in, &a.step) &&
                    Get(&in, &a.grad_multiplier) && Get(&in, &p.lr_factor) && Get(&in, &groups);
  if (!read || groups != groups_.size() || in.size() != groups * 2 * sizeof(float)) {
    return absl::DataLossError(fmt::format(
        "the torn step {}'s redo record ({} bytes) does not fit this optimizer's {} groups",
        torn.intent.record.step, torn.intent.redo.size(), groups_.size()));
  }
  a.adamw = adamw != 0;
  p.groups.resize(groups);
  for (AdamGroupOptions& g : p.groups) {
    Get(&in, &g.lr);
    Get(&in, &g.weight_decay);
  }
  MEMASCEND_RETURN_IF_ERROR(scaler_.Restore(torn.intent.record.scaler));
  p.skip_parts = torn.parts_done;
  pending_ = p;
  MEMASCEND_RETURN_IF_ERROR(UpdateAll());
  return Commit(torn.intent.record.step, torn.intent.record.user);
}

absl::Status OffloadedAdam::Commit(std::uint64_t step, std::string_view user) {
  MEMASCEND_ASSIGN_OR_RETURN(CommitTicket ticket, CommitAsync(step, user));
  Timed timed(&times_.commit);
  return ticket.Wait();
}

absl::Status OffloadedAdam::Settle() {
  Timed timed(&times_.commit);
  return storage_->Settle();
}

absl::Status OffloadedAdam::Persist() {
  Timed timed(&times_.commit);
  return storage_->Persist();
}

absl::Status OffloadedAdam::FailedUpdate() const {
  return absl::FailedPreconditionError(fmt::format(
      "adam: the update of this step failed part-way ({}); it is not run again here: reopen "
      "the state and resume (the volume holds the last commit, or the step for Resume to "
      "finish)",
      pending_->failed));
}

absl::StatusOr<CommitTicket> OffloadedAdam::CommitAsync(std::uint64_t step, std::string_view user) {
  Timed timed(&times_.commit);
  if (pending_.has_value() && !pending_->failed.empty()) return FailedUpdate();
  const bool update = pending_.has_value();
  if (update && pending_->next_group < layout().groups.size()) {
    return absl::FailedPreconditionError(fmt::format("adam: commit with {} of {} groups updated",
                                                     pending_->next_group, layout().groups.size()));
  }
  ahead_started_ = false;
  CommitRecord r;
  r.step = step;
  r.version = update ? 1 - version_ : version_;
  r.adam_step = update ? pending_->adam.step : adam_step_;
  r.scaler = scaler_.state();
  r.fingerprint = o_.fingerprint;
  r.user.assign(user.data(), user.size());
  MEMASCEND_RETURN_IF_ERROR(storage_->Commit(r));
  version_ = r.version;
  adam_step_ = r.adam_step;
  pending_.reset();
  skipped_ = false;
  return CommitTicket(storage_, step);
}

// ---- the state, whole ------------------------------------------------------------------

namespace {
absl::Status CheckStateAccess(const StateLayout& l, StateKind kind, std::size_t g,
                              std::size_t elements) {
  if (g >= l.groups.size()) return absl::OutOfRangeError(fmt::format("adam: no group {}", g));
  if (kind == StateKind::kGradient)
    return absl::InvalidArgumentError("adam: gradients are not part of the kept state");
  if (elements != l.groups[g].elements) {
    return absl::InvalidArgumentError(fmt::format("adam: group '{}' has {} elements, not {}",
                                                  l.groups[g].name, l.groups[g].elements,
                                                  elements));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status OffloadedAdam::ReadState(StateKind kind, std::size_t g, MutableTensorView out) {
  const StateLayout& l = layout();
  MEMASCEND_RETURN_IF_ERROR(CheckStateAccess(l, kind, g, out.elements));
  if (kind == StateKind::kParameters) return LoadParameters(g, out);
  return ReadStateRange(kind, g, 0, out);
}

absl::Status OffloadedAdam::ReadStateRange(StateKind kind, std::size_t g, std::size_t first,
                                           MutableTensorView out) {
  const StateLayout& l = layout();
  if (g >= l.groups.size()) return absl::OutOfRangeError(fmt::format("adam: no group {}", g));
  if (kind == StateKind::kGradient)
    return absl::InvalidArgumentError("adam: gradients are not part of the kept state");
  const std::size_t elements = l.groups[g].elements;
  if (first > elements || out.elements > elements - first) {
    return absl::OutOfRangeError(fmt::format("adam: elements [{}, {}) of group '{}', which has {}",
                                             first, first + out.elements, l.groups[g].name,
                                             elements));
  }
  if (kind == StateKind::kParameters) return LoadParameterRange(g, first, out);
  const std::size_t last = first + out.elements;
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const auto [begin, end] = l.PartRange(g, part);
    if (end <= first || begin >= last) continue;
    const std::size_t from = std::max(begin, first), n = std::min(end, last) - from;
    MEMASCEND_ASSIGN_OR_RETURN(StateBuffer s, storage_->Read(kind, g, part, false));
    MEMASCEND_RETURN_IF_ERROR(Convert(
        {s.data + (from - begin) * sizeof(float), n, DType::kF32},
        {static_cast<std::byte*>(out.data) + (from - first) * SizeOf(out.dtype), n, out.dtype},
        K()));
  }
  return absl::OkStatus();
}

absl::Status OffloadedAdam::WriteState(StateKind kind, std::size_t g, TensorView in) {
  const StateLayout& l = layout();
  MEMASCEND_RETURN_IF_ERROR(CheckStateAccess(l, kind, g, in.elements));
  if (pending_.has_value())
    return absl::FailedPreconditionError("adam: the state is written with an update planned");
  if (!l.Stored(kind, g)) return absl::OkStatus();  // derived parameters
  MEMASCEND_RETURN_IF_ERROR(storage_->Settle());    // a commit may be writing this version
  const DType stored = kind == StateKind::kParameters ? l.param_dtype : DType::kF32;
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const auto [begin, end] = l.PartRange(g, part);
    const std::size_t n = end - begin;
    MEMASCEND_ASSIGN_OR_RETURN(StateBuffer s, storage_->Overwrite(kind, g, part, false));
    MEMASCEND_RETURN_IF_ERROR(
        Convert({static_cast<const std::byte*>(in.data) + begin * SizeOf(in.dtype), n, in.dtype},
                {s.data, n, stored}, K()));
  }
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetAdamStep(std::int64_t step) {
  if (step < 0) return absl::InvalidArgumentError(fmt::format("adam: step {} < 0", step));
  if (pending_.has_value())
    return absl::FailedPreconditionError("adam: the step is set with an update planned");
  adam_step_ = step;
  return absl::OkStatus();
}

absl::Status OffloadedAdam::StartOver() {
  if (pending_.has_value())
    return absl::FailedPreconditionError("adam: a start over with an update planned");
  adam_step_ = 0;
  scaler_ = DynamicLossScaler(o_.scaler);
  skipped_ = false;
  return absl::OkStatus();
}

// ---- the gradients ----------------------------------------------------------------------

void OffloadedAdam::BeginBackward(float gradient_scale) {
  in_backward_ = true;
  given_.assign(grad_before_.size() - 1, false);
  overflow_ = false;
  sum_squares_ = 0;
  scale_ = gradient_scale > 0 && std::isfinite(gradient_scale) ? gradient_scale : scaler_.scale();
}

absl::Status OffloadedAdam::FinishGradient(std::size_t g, std::size_t part,
                                           const StateBuffer& grad) {
  const StateLayout& l = layout();
  const auto [begin, end] = l.PartRange(g, part);
  const TensorView view[] = {{grad.data, end - begin, l.grad_dtype}};
  if (overflow_) return absl::OkStatus();  // the step is skipped: nothing more to learn
  const bool checked_later = storage_->ChecksOverflowAfterBackward();
  if (!checked_later && o_.overflow_check == OffloadedAdamOptions::OverflowCheck::kTemporaries &&
      HasOverflowWithTemporaries(view, K())) {
    overflow_ = true;
    return absl::OkStatus();
  }
  // Note [one pass]: the squares are taken and summed in double, where the square of the
  // largest finite fp32 value (about 1.2e77) and any sum of them short of 1e231 terms
  // stay finite, while an inf or a NaN makes the sum inf or NaN. So the sum is the
  // overflow check too: one read of the part, not two, with the sum's bits unchanged.
  const double total = SumOfSquares(view, K(), sum_squares_);
  if (checked_later || std::isfinite(total)) {
    sum_squares_ = total;
  } else {
    overflow_ = true;
  }
  return absl::OkStatus();
}

void OffloadedAdam::SetGradientScale(float gradient_scale) {
  scale_ = gradient_scale > 0 && std::isfinite(gradient_scale) ? gradient_scale : scaler_.scale();
}

absl::StatusOr<StateBuffer> OffloadedAdam::BeginGradient(std::size_t g, std::size_t part) {
  Timed timed(&times_.gradients);  // with the storage's wait for room (a commit's settle)
  const StateLayout& l = layout();
  if (g >= l.groups.size() || part >= l.Parts(g))
    return absl::OutOfRangeError(fmt::format("adam: no group {} part {}", g, part));
  if (!in_backward_) {
    return absl::FailedPreconditionError(fmt::format(
        "adam: a gradient (group {} part {}) outside a backward pass: call BeginBackward() "
        "(OffloadedTraining::BeginStep()) first each step, or its norm, overflow check and "
        "scale would be the last step's",
        g, part));
  }
  if (given_[part_base_[g] + part]) {  // Note [every part once]
    return absl::FailedPreconditionError(fmt::format(
        "adam: group '{}' part {} was given a gradient twice this step: its squares would "
        "count twice in the norm and the first would be lost; sum micro-batches' gradients "
        "before handing each part over once",
        l.groups[g].name, part));
  }
  return storage_->Overwrite(StateKind::kGradient, g, part, false);
}

absl::Status OffloadedAdam::EndGradient(std::size_t g, std::size_t part, StateBuffer gradient) {
  Timed timed(&times_.gradients);
  const StateLayout& l = layout();
  if (g >= l.groups.size() || part >= l.Parts(g))
    return absl::OutOfRangeError(fmt::format("adam: no group {} part {}", g, part));
  if (!in_backward_ || given_[part_base_[g] + part]) {
    return absl::FailedPreconditionError(fmt::format(
        "adam: the gradient of group '{}' part {} ended outside its backward pass or twice",
        l.groups[g].name, part));
  }
  {
    const StateBuffer held = std::move(gradient);  // released at the end of this scope
    MEMASCEND_RETURN_IF_ERROR(FinishGradient(g, part, held));
  }
  given_[part_base_[g] + part] = true;
  // Note [gradient room]: a gradient the budget has room for stays until the update
  // (marked wanted, so neither eviction nor the read-ahead takes it first).
  if (GradBytesBefore(g, part + 1) <= grad_room_) storage_->Prefetch(StateKind::kGradient, g, part);
  // A storage that writes the gradients as the step's redo record starts now, under the
  // rest of the backward pass (Note [gradient write-behind] in training_state.h); not for
  // a step already known to overflow, which is skipped.
  return overflow_ ? absl::OkStatus() : storage_->GradientWritten(g, part);
}

absl::Status OffloadedAdam::WriteGradient(
    std::size_t g, std::size_t part, const std::function<absl::Status(MutableTensorView)>& fill) {
  MEMASCEND_ASSIGN_OR_RETURN(StateBuffer grad, BeginGradient(g, part));
  const auto [begin, end] = layout().PartRange(g, part);
  {
    Timed timed(&times_.gradients);
    MEMASCEND_RETURN_IF_ERROR(fill({grad.data, end - begin, layout().grad_dtype}));
  }
  return EndGradient(g, part, std::move(grad));
}

absl::Status OffloadedAdam::SetGradient(std::size_t g, std::size_t part, TensorView gradient) {
  return WriteGradient(g, part, [&](MutableTensorView to) -> absl::Status {
    if (gradient.elements != to.elements) {
      return absl::InvalidArgumentError(
          fmt::format("adam: group {} part {} has {} elements, the gradient {}", g, part,
                      to.elements, gradient.elements));
    }
    return Convert(gradient, to, K());
  });
}

absl::StatusOr<StepPlan> OffloadedAdam::EndBackward(double lr_factor) {
  Timed timed(&times_.end_backward);
  if (pending_.has_value())
    return absl::FailedPreconditionError("adam: the previous step's update has not run");
  if (!in_backward_) {
    return absl::FailedPreconditionError(
        "adam: EndBackward() without a BeginBackward() this step: its plan would be of the "
        "last step's norm and gradients");
  }
  if (!(lr_factor >= 0) || !std::isfinite(lr_factor))
    return absl::InvalidArgumentError(fmt::format("adam: lr factor {}", lr_factor));
  in_backward_ = false;  // the next step's gradients need a BeginBackward of their own
  if (storage_->ChecksOverflowAfterBackward()) {
    MEMASCEND_ASSIGN_OR_RETURN(overflow_, storage_->CheckOverflow());
  }
  if (o_.reduce_gradient_check) {
    MEMASCEND_ASSIGN_OR_RETURN(const GradientCheck all,
                               o_.reduce_gradient_check({overflow_, sum_squares_}));
    overflow_ = all.overflow;
    sum_squares_ = all.sum_squares;
  }
  // Note [every part once]: a part left out would update from the last step's gradient, or
  // from nothing (an overflowing step is skipped whatever it left out).
  if (!overflow_) {
    const StateLayout& l = layout();
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t part = 0; part < l.Parts(g); ++part) {
        if (given_[part_base_[g] + part]) continue;
        return absl::FailedPreconditionError(fmt::format(
            "adam: group '{}' part {} has no gradient this step (its stored one is the last "
            "step's, or none): give every part one each step, zeros for a parameter without "
            "(as memascend.torch and DeepSpeed do); nothing is planned, begin the step again",
            l.groups[g].name, part));
      }
    }
  }
  StepPlan plan;
  plan.loss_scale = scale_;
  plan.skipped = !scaler_.Update(overflow_);
  if (plan.skipped) {
    const StateLayout& l = layout();
    for (std::size_t g = 0; g < l.groups.size(); ++g) {
      for (std::size_t part = 0; part < l.Parts(g); ++part)
        MEMASCEND_RETURN_IF_ERROR(storage_->Discard(StateKind::kGradient, g, part));
    }
    skipped_ = true;
    return plan;
  }
  plan.grad_norm = std::sqrt(sum_squares_) / static_cast<double>(scale_);
  Pending p;
  p.adam.beta1 = o_.beta1;
  p.adam.beta2 = o_.beta2;
  p.adam.eps = o_.eps;
  p.adam.adamw = o_.adamw;
  p.adam.lr = static_cast<float>(static_cast<double>(groups_[0].lr) * lr_factor);
  p.adam.weight_decay = groups_[0].weight_decay;
  p.groups = groups_;  // the planned step's, whatever SetGroupOptions does before its update
  p.adam.step = adam_step_ + 1;
  p.adam.grad_multiplier = ClipCoefficient(plan.grad_norm, o_.max_grad_norm) / scale_;
  p.lr_factor = lr_factor;
  plan.adam = p.adam;
  pending_ = p;
  return plan;
}

// ---- the read-ahead (Note [read-ahead]) -------------------------------------------------

void OffloadedAdam::ReadAheadForUpdate() { StartReadAhead(/*grads_ready=*/false); }

void OffloadedAdam::StartReadAhead(bool grads_ready) {
  ahead_.clear();
  ahead_bytes_ = 0;
  cursor_g_ = 0;
  cursor_part_ = 0;
  if (pending_.has_value()) {  // a torn step's redo reads from its first part not durable
    while (cursor_g_ + 1 < part_base_.size() && part_base_[cursor_g_ + 1] <= pending_->skip_parts)
      ++cursor_g_;
    cursor_part_ = std::max(pending_->skip_parts, part_base_[cursor_g_]) - part_base_[cursor_g_];
  }
  grads_ready_ = grads_ready;
  ahead_started_ = true;
  if (!grads_ready) Fill();  // part 0 of group 0 included: ReadAhead(0, 0) keeps it
}

void OffloadedAdam::ContinueReadAhead() {
  if (!ahead_started_) {
    StartReadAhead(/*grads_ready=*/true);
    return;
  }
  grads_ready_ = true;
  for (const Ahead& a : ahead_) storage_->Prefetch(StateKind::kGradient, a.g, a.part);
}

void OffloadedAdam::ReadAhead(std::size_t g, std::size_t part) {
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

void OffloadedAdam::Fill() {
  const StateLayout& l = layout();
  for (;;) {
    if (cursor_g_ < l.groups.size() && cursor_part_ >= l.Parts(cursor_g_)) {
      cursor_part_ = 0;
      ++cursor_g_;
    }
    if (cursor_g_ >= l.groups.size()) return;
    // The gradients beyond the cursor keep their room (Note [gradient room]).
    const std::size_t grads_beyond = grad_before_.back() - GradBytesBefore(cursor_g_, cursor_part_);
    if (ahead_bytes_ + std::min(grads_beyond, grad_room_) >= read_ahead_) return;
    const auto [begin, end] = l.PartRange(cursor_g_, cursor_part_);
    // Kept parts hold their share of the budget already.
    const std::size_t bytes =
        (end - begin) * l.ElementBytes(StateKind::kGradient) +
        (Kept(cursor_g_, cursor_part_) ? 0 : PartStateBytes(cursor_g_, cursor_part_));
    if (grads_ready_) storage_->Prefetch(StateKind::kGradient, cursor_g_, cursor_part_);
    for (StateKind k : kStateKinds) storage_->Prefetch(k, cursor_g_, cursor_part_);
    ahead_.push_back({cursor_g_, cursor_part_, bytes});
    ahead_bytes_ += bytes;
    ++cursor_part_;
  }
}

// ---- the update ------------------------------------------------------------------------

absl::Status OffloadedAdam::UpdateGroup(std::size_t g, MutableTensorView params_out) {
  Timed timed(&times_.update);
  const StateLayout& l = layout();
  if (!pending_.has_value())
    return absl::FailedPreconditionError("adam: no update planned (EndBackward first)");
  if (!pending_->failed.empty()) return FailedUpdate();
  if (g != pending_->next_group) {
    return absl::FailedPreconditionError(fmt::format(
        "adam: group {} updated out of order (group {} is next)", g, pending_->next_group));
  }
  if (params_out.data != nullptr && params_out.elements != l.groups[g].elements) {
    return absl::InvalidArgumentError(fmt::format("adam: group '{}' has {} elements, the output {}",
                                                  l.groups[g].name, l.groups[g].elements,
                                                  params_out.elements));
  }
  if (!pending_->begun) {  // Note [state in place]: how to finish the step, before any part
    StepIntent intent;
    intent.record.adam_step = pending_->adam.step;
    intent.record.scaler = scaler_.state();
    intent.record.fingerprint = o_.fingerprint;
    intent.redo = EncodeRedo();
    MEMASCEND_RETURN_IF_ERROR(storage_->BeginUpdate(intent));
    pending_->begun = true;
  }
  if (g == 0) ContinueReadAhead();
  AdamConfig adam = pending_->adam;
  adam.lr = static_cast<float>(static_cast<double>(pending_->groups[g].lr) * pending_->lr_factor);
  adam.weight_decay = pending_->groups[g].weight_decay;
  // Note [failed update]: parts updated in place are not updated twice.
  if (absl::Status s = UpdateParts(g, adam, params_out); !s.ok()) {
    pending_->failed = std::string(s.message());
    return s;
  }
  ++pending_->next_group;
  return absl::OkStatus();
}

absl::Status OffloadedAdam::UpdateParts(std::size_t g, const AdamConfig& adam,
                                        MutableTensorView params_out) {
  const StateLayout& l = layout();
  const bool derived = !l.Stored(StateKind::kParameters, g);
  const bool out = params_out.data != nullptr;
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    if (part_base_[g] + part < pending_->skip_parts) continue;  // durable already
    ReadAhead(g, part);
    const auto [begin, end] = l.PartRange(g, part);
    const std::size_t n = end - begin;
    absl::Status converted;
    {
      MEMASCEND_ASSIGN_OR_RETURN(StateBuffer grad,
                                 storage_->Read(StateKind::kGradient, g, part, false));
      MEMASCEND_ASSIGN_OR_RETURN(StateBuffer master, storage_->Update(StateKind::kMaster, g, part));
      MEMASCEND_ASSIGN_OR_RETURN(StateBuffer m, storage_->Update(StateKind::kExpAvg, g, part));
      MEMASCEND_ASSIGN_OR_RETURN(StateBuffer v, storage_->Update(StateKind::kExpAvgSq, g, part));
      // The parameters last: a block taken for overwrite holds no value until the update.
      // A derived group's new parameters go to the caller's buffer only, if anywhere.
      StateBuffer param;
      if (!derived) {
        MEMASCEND_ASSIGN_OR_RETURN(param,
                                   storage_->Overwrite(StateKind::kParameters, g, part, true));
      } else if (out) {
        param.data = derived_.data();
      }
      {
        Timed kernels(&times_.update_kernels);
        MEMASCEND_RETURN_IF_ERROR(FusedAdam(adam, master.as<float>(), m.as<float>(), v.as<float>(),
                                            {grad.data, n, l.grad_dtype},
                                            {param.data, n, l.param_dtype}, K()));
      }
      if (out) {
        Timed kernels(&times_.update_kernels);
        converted =
            Convert({param.data, n, l.param_dtype},
                    {static_cast<std::byte*>(params_out.data) + begin * SizeOf(params_out.dtype), n,
                     params_out.dtype},
                    K());
      }
    }  // the part's leases go: nothing writes it any more
    // Every kind of the part holds the new step: the storage may commit it now (a copy out
    // that failed too: the part is updated in place, Note [failed update]). Not under its
    // leases: a write-back under a writer leaves the tensor dirty (Note [write-back under a
    // writer] in src/store/residency.cpp), and the part was written twice.
    MEMASCEND_RETURN_IF_ERROR(storage_->PartUpdated(g, part));
    MEMASCEND_RETURN_IF_ERROR(converted);
    MEMASCEND_RETURN_IF_ERROR(storage_->Discard(StateKind::kGradient, g, part));
  }
  return absl::OkStatus();
}

absl::Status OffloadedAdam::UpdateAll(const std::function<void(std::size_t)>& after_group) {
  if (!pending_.has_value())
    return absl::FailedPreconditionError("adam: no update planned (EndBackward first)");
  const std::size_t groups = layout().groups.size();
  if (storage_->OwnsUpdate()) {
    if (pending_->next_group != 0)
      return absl::FailedPreconditionError("adam: the storage's own update runs whole");
    {
      Timed timed(&times_.update);  // its kernels are the storage's, not split out
      MEMASCEND_RETURN_IF_ERROR(storage_->UpdateAll(pending_->adam, threads_));
    }
    pending_->next_group = groups;
    if (after_group) after_group(groups - 1);
    return absl::OkStatus();
  }
  for (std::size_t g = pending_->next_group; g < groups; ++g) {
    MEMASCEND_RETURN_IF_ERROR(UpdateGroup(g));
    if (after_group) after_group(g);
  }
  return absl::OkStatus();
}

// ---- the parameters ---------------------------------------------------------------------

absl::Status OffloadedAdam::LoadParameters(std::size_t g, MutableTensorView out) {
  const StateLayout& l = layout();
  if (g >= l.groups.size()) return absl::OutOfRangeError(fmt::format("adam: no group {}", g));
  if (out.elements != l.groups[g].elements) {
    return absl::InvalidArgumentError(fmt::format("adam: group '{}' has {} elements, the output {}",
                                                  l.groups[g].name, l.groups[g].elements,
                                                  out.elements));
  }
  return LoadParameterRange(g, 0, out);
}

// Elements [first, first + out.elements) of group g's newest parameters (the range checked).
absl::Status OffloadedAdam::LoadParameterRange(std::size_t g, std::size_t first,
                                               MutableTensorView out) {
  const StateLayout& l = layout();
  const bool derived = !l.Stored(StateKind::kParameters, g);
  const bool next = Updated(g);
  const std::size_t last = first + out.elements;
  for (std::size_t part = 0; part < l.Parts(g); ++part) {
    const auto [begin, end] = l.PartRange(g, part);
    if (end <= first || begin >= last) continue;
    const std::size_t from = std::max(begin, first), n = std::min(end, last) - from;
    const MutableTensorView to{
        static_cast<std::byte*>(out.data) + (from - first) * SizeOf(out.dtype), n, out.dtype};
    if (derived) {
      MEMASCEND_ASSIGN_OR_RETURN(StateBuffer m, storage_->Read(StateKind::kMaster, g, part, next));
      const MutableTensorView half{derived_.data(), n, l.param_dtype};
      MEMASCEND_RETURN_IF_ERROR(
          Convert({m.data + (from - begin) * sizeof(float), n, DType::kF32}, half, K()));
      MEMASCEND_RETURN_IF_ERROR(Convert({half.data, n, l.param_dtype}, to, K()));
      continue;
    }
    MEMASCEND_ASSIGN_OR_RETURN(StateBuffer p,
                               storage_->Read(StateKind::kParameters, g, part, next));
    MEMASCEND_RETURN_IF_ERROR(
        Convert({static_cast<const std::byte*>(p.data) + (from - begin) * SizeOf(l.param_dtype), n,
                 l.param_dtype},
                to, K()));
  }
  return absl::OkStatus();
}

absl::StatusOr<StateBuffer> OffloadedAdam::ReadParameters(std::size_t g, std::size_t part) {
  const StateLayout& l = layout();
  if (g >= l.groups.size() || part >= l.Parts(g))
    return absl::OutOfRangeError(fmt::format("adam: no group {} part {}", g, part));
  if (!l.Stored(StateKind::kParameters, g)) {
    return absl::FailedPreconditionError(fmt::format(
        "adam: group '{}' stores no parameters (they are derived from its master weights)",
        l.groups[g].name));
  }
  return storage_->Read(StateKind::kParameters, g, part, Updated(g));
}

void OffloadedAdam::PrefetchParameters(std::size_t g) {
  const StateLayout& l = layout();
  if (g >= l.groups.size()) return;
  const StateKind k =
      l.Stored(StateKind::kParameters, g) ? StateKind::kParameters : StateKind::kMaster;
  for (std::size_t part = 0; part < l.Parts(g); ++part) storage_->Prefetch(k, g, part);
}

// ---- ParameterStream --------------------------------------------------------------------

ParameterStream::ParameterStream(OffloadedAdam* optimizer, std::size_t first, std::size_t last,
                                 std::size_t window)
    : optimizer_(optimizer), first_(first), last_(last), window_(window) {}

void ParameterStream::PrefetchAfter(std::size_t group, Direction direction) {
  for (std::size_t i = 1; i <= window_; ++i) {
    if (direction == Direction::kForward) {
      if (group + i >= last_) return;
      optimizer_->PrefetchParameters(group + i);
    } else {
      if (group < first_ + i) return;
      optimizer_->PrefetchParameters(group - i);
    }
  }
}

absl::Status ParameterStream::Load(std::size_t group, MutableTensorView out, Direction direction) {
  PrefetchAfter(group, direction);
  return optimizer_->LoadParameters(group, out);
}

absl::StatusOr<TensorLease> ParameterStream::AcquireOnDevice(std::size_t group, std::size_t part,
                                                             CudaStreamView stream) {
  return optimizer_->storage()->ReadOnDevice(StateKind::kParameters, group, part, stream);
}

}  // namespace memascend
