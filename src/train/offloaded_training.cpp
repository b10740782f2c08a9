#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include <absl/cleanup/cleanup.h>
#include <fmt/format.h>

#include <memascend/offloaded_training.h>
#include <memascend/status.h>

#include "prim/file.h"

namespace memascend {
namespace {

using prim::PathExists;
using prim::RemoveQuietly;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

std::string Bytes(std::uint64_t b) {
  if (b >= (std::uint64_t{1} << 30))
    return fmt::format("{} bytes ({:.2f} GiB)", b, static_cast<double>(b) / (1 << 30));
  return fmt::format("{} bytes ({:.1f} MiB)", b, static_cast<double>(b) / kMiB);
}

}  // namespace

absl::StatusOr<StateLayout> OffloadedTraining::LayoutOf(const OffloadedTrainingOptions& o) {
  StateLayout layout = o.layout;
  if (layout.groups.empty()) {
    layout.groups = o.groups;
    layout.param_dtype = layout.grad_dtype = o.dtype;
    layout.part_elements = o.part_elements;
    // fp32 parameters are their master weights: derived, not stored twice.
    if (o.dtype == DType::kF32) {
      for (StateGroup& g : layout.groups) g.store_parameters = false;
    }
  }
  if (layout.groups.empty()) {
    return absl::InvalidArgumentError(
        "offloaded training: no groups (OffloadedTrainingOptions::groups or layout)");
  }
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  return layout;
}

std::uint64_t OffloadedTraining::RequiredVolumeBytes(const StateLayout& layout) {
  return VersionedTrainingState::DataBytes(layout);  // Note [volume size] in training_state.h
}

std::uint64_t OffloadedTraining::DefaultVolumeBytes(const StateLayout& layout) {
  return VersionedTrainingState::VolumeBytes(layout);
}

absl::StatusOr<std::unique_ptr<OffloadedTraining>> OffloadedTraining::Open(
    const OffloadedTrainingOptions& options) {
  auto run = std::unique_ptr<OffloadedTraining>(new OffloadedTraining());
  MEMASCEND_RETURN_IF_ERROR(run->Start(options));
  return run;
}

absl::Status OffloadedTraining::Start(const OffloadedTrainingOptions& o) {
  if (o.resume && o.overwrite) {
    return absl::InvalidArgumentError(
        "offloaded training: resume and overwrite exclude each other (resume continues the "
        "volume's state, overwrite starts over)");
  }
  if (o.volume_path.empty())
    return absl::InvalidArgumentError("offloaded training: no volume_path");
  if (o.threads < 0 || o.threads > 1024) {
    return absl::InvalidArgumentError(fmt::format(
        "offloaded training: threads {} is not in [0, 1024] (0: every core)", o.threads));
  }
  if (o.initial_weights && o.initial_weights_part) {
    return absl::InvalidArgumentError(
        "offloaded training: initial_weights and initial_weights_part exclude each other "
        "(a group whole, or a part at a time)");
  }
  MEMASCEND_ASSIGN_OR_RETURN(layout_, LayoutOf(o));

  // Note [open checks]: the budget first, before anything is opened.
  const std::uint64_t minimum = OffloadedAdam::MinimumHostBudget(layout_);
  const std::uint64_t stored = VersionedTrainingState::StoredBytes(layout_);
  if (o.host_budget_bytes != 0 && o.host_budget_bytes < minimum) {
    return absl::ResourceExhaustedError(fmt::format(
        "offloaded training: host_budget_bytes {} is below the least, {}: twice what the "
        "optimizer holds at once (the gradient, new parameters, master weights and both "
        "moments of a part of {} elements; the second set is room against fragmentation); "
        "give host_budget_bytes {} or more, 0 to choose one from the machine, or a smaller "
        "part_elements",
        Bytes(o.host_budget_bytes), Bytes(minimum), layout_.MaxPartElements(), minimum));
  }
  HostBudgetRequest want;
  want.minimum_bytes = minimum;
  want.maximum_bytes = std::max(stored, minimum);
  want.other_bytes = o.other_bytes;
  want.backing = HostBackingKind::kMlock;
  want.given_bytes = o.host_budget_bytes;
  MEMASCEND_ASSIGN_OR_RETURN(budget_, ChooseHostBudget(want));

  // The volume: created when missing (and removed again if Open fails), then checked.
  const bool existed = PathExists(o.volume_path);
  VolumeFormatOptions format;
  format.size = o.volume_bytes != 0 ? o.volume_bytes : DefaultVolumeBytes(layout_);
  absl::Cleanup remove_created = [&] {
    (void)Close();  // what is open goes first, then the file
    if (!existed) RemoveQuietly(o.volume_path);
  };
  {
    auto volume = Volume::OpenOrCreate(o.volume_path, format);
    if (!volume.ok()) {
      std::move(remove_created).Cancel();  // Format removes a file it failed to make
      return volume.status();
    }
    volume_ = std::move(*volume);
  }
  const std::uint64_t need = RequiredVolumeBytes(layout_);
  const VolumeStats vs = volume_->stats();
  if (vs.data_bytes < need) {
    return absl::ResourceExhaustedError(
        fmt::format("offloaded training: volume '{}' has {} for data; this layout needs {} (both "
                    "versions of every stored part, {}, and what is staged in flight: "
                    "VersionedTrainingState::DataBytes); {}",
                    o.volume_path, Bytes(vs.data_bytes), Bytes(need), stored,
                    existed ? fmt::format("use a larger volume, or a new path (created with "
                                          "volume_bytes, by default {})",
                                          DefaultVolumeBytes(layout_))
                            : fmt::format("give volume_bytes {} or more (0: that size)",
                                          DefaultVolumeBytes(layout_))));
  }

  TensorStoreOptions so;
  so.host_budget_bytes = budget_.bytes;
  so.defer_prefetches = true;
  if (!budget_.locked) so.host_backing = ArenaBacking::kUnlocked;
  MEMASCEND_ASSIGN_OR_RETURN(store_, TensorStore::Open(volume_.get(), so));
  VersionedTrainingStateOptions vo;  // Note [state ownership]
  vo.replace_existing = o.overwrite;
  {
    auto state = VersionedTrainingState::Open(store_.get(), volume_.get(), layout_, vo);
    if (!state.ok()) {
      if (state.status().code() != absl::StatusCode::kFailedPrecondition) return state.status();
      return absl::FailedPreconditionError(
          fmt::format("offloaded training: {} (here: OffloadedTrainingOptions::overwrite)",
                      std::string(state.status().message())));
    }
    state_ = std::move(*state);
  }

  // Note [one budget]: what the update does not hold is read-ahead.
  const std::size_t spare = budget_.bytes > minimum ? budget_.bytes - minimum : 0;
  read_ahead_ = std::max(OffloadedAdam::MinimumReadAhead(layout_), spare);
  OffloadedAdamOptions ao;
  ao.lr = o.lr;
  ao.weight_decay = o.weight_decay;
  ao.groups = o.group_options;
  ao.beta1 = o.beta1;
  ao.beta2 = o.beta2;
  ao.eps = o.eps;
  ao.adamw = true;
  ao.max_grad_norm = o.max_grad_norm;
  ao.scaler = o.loss_scaler;
  ao.fingerprint = o.run_id;
  ao.read_ahead_bytes = read_ahead_;
  ao.keep_bytes = 0;
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = std::make_unique<KernelThreads>(threads);
  MEMASCEND_ASSIGN_OR_RETURN(adam_, OffloadedAdam::Create(state_.get(), ao, threads_.get()));

  // Resume, refuse, or start anew.
  if (!o.overwrite) {
    MEMASCEND_ASSIGN_OR_RETURN(std::optional<CommitRecord> last, adam_->Resume());
    if (last.has_value() && !o.resume) {
      return absl::FailedPreconditionError(fmt::format(
          "offloaded training: volume '{}' holds this model's training state at step {}; set "
          "resume to continue it, or overwrite to start over (that state is then lost)",
          o.volume_path, last->step));
    }
    if (last.has_value()) {
      step_ = last->step;
      resumed_ = std::move(last);
      std::move(remove_created).Cancel();
      return absl::OkStatus();
    }
  }
  if (!o.initial_weights && !o.initial_weights_part) {
    return absl::InvalidArgumentError(fmt::format(
        "offloaded training: volume '{}' holds no committed state to resume, and a new one "
        "needs its weights: set initial_weights (or initial_weights_part)",
        o.volume_path));
  }
  std::vector<float> w;
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    if (o.initial_weights) {
      w.assign(layout_.groups[g].elements, 0.0f);
      MEMASCEND_RETURN_IF_ERROR(o.initial_weights(g, std::span<float>(w)));
      MEMASCEND_RETURN_IF_ERROR(adam_->Initialize(g, w));
      continue;
    }
    for (std::size_t p = 0; p < layout_.Parts(g); ++p) {
      const auto [begin, end] = layout_.PartRange(g, p);
      w.assign(end - begin, 0.0f);
      MEMASCEND_RETURN_IF_ERROR(o.initial_weights_part(g, begin, std::span<float>(w)));
      MEMASCEND_RETURN_IF_ERROR(adam_->InitializePart(g, p, {w.data(), w.size(), DType::kF32}));
    }
  }
  MEMASCEND_RETURN_IF_ERROR(adam_->Commit(0));
  step_ = 0;
  std::move(remove_created).Cancel();
  return absl::OkStatus();
}

OffloadedTraining::~OffloadedTraining() {
  if (store_ == nullptr && volume_ == nullptr) return;
  const absl::Status s = Close();
  if (!s.ok()) std::fprintf(stderr, "memascend: offloaded training: %s\n", s.ToString().c_str());
}

absl::Status OffloadedTraining::LoadParameters(std::size_t group, MutableTensorView out) {
  if (adam_ == nullptr) return absl::FailedPreconditionError("offloaded training: closed");
  return adam_->LoadParameters(group, out);
}

absl::Status OffloadedTraining::SetGradient(std::size_t group, TensorView gradient) {
  if (adam_ == nullptr) return absl::FailedPreconditionError("offloaded training: closed");
  if (group >= layout_.groups.size())
    return absl::OutOfRangeError(fmt::format("offloaded training: no group {}", group));
  if (gradient.elements != layout_.groups[group].elements) {
    return absl::InvalidArgumentError(
        fmt::format("offloaded training: group '{}' has {} elements, the gradient {}",
                    layout_.groups[group].name, layout_.groups[group].elements, gradient.elements));
  }
  const std::size_t element = SizeOf(gradient.dtype);
  for (std::size_t p = 0; p < layout_.Parts(group); ++p) {
    const auto [begin, end] = layout_.PartRange(group, p);
    MEMASCEND_RETURN_IF_ERROR(
        adam_->SetGradient(group, p,
                           {static_cast<const std::byte*>(gradient.data) + begin * element,
                            end - begin, gradient.dtype}));
  }
  return absl::OkStatus();
}

void OffloadedTraining::BeginStep() {
  if (adam_ != nullptr) adam_->BeginBackward();
}

absl::Status OffloadedTraining::Settle() {
  return adam_ == nullptr ? absl::OkStatus() : adam_->Settle();
}

absl::StatusOr<StepPlan> OffloadedTraining::Step(double lr_factor) {
  if (adam_ == nullptr) return absl::FailedPreconditionError("offloaded training: closed");
  MEMASCEND_ASSIGN_OR_RETURN(StepPlan plan, adam_->EndBackward(lr_factor));
  if (!plan.skipped) MEMASCEND_RETURN_IF_ERROR(adam_->UpdateAll());
  return plan;
}

absl::Status OffloadedTraining::Commit(std::uint64_t step, std::string_view user) {
  if (adam_ == nullptr) return absl::FailedPreconditionError("offloaded training: closed");
  MEMASCEND_RETURN_IF_ERROR(adam_->Commit(step, user));
  step_ = step;
  return absl::OkStatus();
}

absl::StatusOr<CommitTicket> OffloadedTraining::CommitAsync(std::uint64_t step,
                                                            std::string_view user) {
  if (adam_ == nullptr) return absl::FailedPreconditionError("offloaded training: closed");
  MEMASCEND_ASSIGN_OR_RETURN(CommitTicket ticket, adam_->CommitAsync(step, user));
  step_ = step;
  return ticket;
}

absl::Status OffloadedTraining::Close() {
  absl::Status status;
  if (adam_ != nullptr) status.Update(adam_->Settle());
  adam_.reset();
  state_.reset();  // settles (again: a no-op)
  if (store_ != nullptr) status.Update(store_->Close());
  store_.reset();
  threads_.reset();
  volume_.reset();
  return status;
}

}  // namespace memascend
