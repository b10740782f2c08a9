// Note [default host budget] (memascend/host_budget.h).
#include <algorithm>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <memascend/host_budget.h>

#include "prim/os.h"
#include "util/units.h"

namespace memascend {
namespace {

std::string Show(std::uint64_t bytes) {
  return bytes == kUnlimited ? std::string("unlimited") : util::FormatBytes(bytes);
}

// RLIMIT_MEMLOCK binds this budget: held with mlock, by a process without CAP_IPC_LOCK.
bool MemlockBinds(const HostBudgetRequest& r, const MemoryInfo& memory, std::uint64_t bytes) {
  return r.backing == HostBackingKind::kMlock && memory.lockable_bytes() < bytes;
}

std::string RaiseMemlock() {
  return "`ulimit -l unlimited` (or a memlock line in /etc/security/limits.conf), "
         "LimitMEMLOCK=infinity for a systemd unit, --ulimit memlock=-1 for a docker container";
}

std::string UnlockedWarning(std::uint64_t bytes, const MemoryInfo& memory) {
  return fmt::format(
      "memascend: warning: RLIMIT_MEMLOCK ({}) is below the host budget of {}: the budget is "
      "ordinary unlocked memory, which the kernel may swap out; for page-locked memory "
      "raise the limit: {}",
      Show(memory.memlock_soft_bytes), Show(bytes), RaiseMemlock());
}

std::string TooMuchToLock(std::uint64_t bytes, const MemoryInfo& memory, std::string_view instead) {
  return fmt::format(
      "host budget of {} ({} bytes) is more than this process may page-lock "
      "(RLIMIT_MEMLOCK {} bytes, no CAP_IPC_LOCK): {}, or raise the limit: {}",
      Show(bytes), bytes, memory.memlock_soft_bytes, instead, RaiseMemlock());
}

}  // namespace

absl::StatusOr<HostBudget> ChooseHostBudget(const HostBudgetRequest& r, const MemoryLimit& limit,
                                            const MemoryInfo& memory) {
  if (r.maximum_bytes < r.minimum_bytes) {
    return absl::InvalidArgumentError(
        fmt::format("host budget: the most the state can hold ({} bytes) is below the least the "
                    "run needs ({} bytes)",
                    r.maximum_bytes, r.minimum_bytes));
  }
  HostBudget b;
  if (r.given_bytes != 0) {
    // A given budget: capped at what the state can hold, refused past the limits.
    b.given = true;
    b.bytes = std::min(r.given_bytes, r.maximum_bytes);
    b.reason = b.bytes < r.given_bytes
                   ? fmt::format("given ({}), capped at the {} the training state can hold",
                                 Show(r.given_bytes), Show(b.bytes))
                   : fmt::format("given ({})", Show(b.bytes));
    if (b.bytes > limit.limit_bytes()) {
      return absl::ResourceExhaustedError(fmt::format(
          "host budget of {} ({} bytes) is more than the memory limit, {} ({} bytes): give a "
          "smaller budget, or none (the default fits the limit)",
          Show(b.bytes), b.bytes, limit.limit_source(), limit.limit_bytes()));
    }
    if (MemlockBinds(r, memory, b.bytes)) {
      return absl::ResourceExhaustedError(TooMuchToLock(
          b.bytes, memory, "give a smaller budget, none (the default then uses unlocked memory)"));
    }
    return b;
  }

  // Note [default host budget]
  const std::uint64_t page = std::max<std::uint64_t>(memory.page_size, 4096);
  const std::uint64_t headroom = limit.headroom_bytes();
  const std::uint64_t margin = headroom == kUnlimited ? 0 : headroom / 8;
  const std::uint64_t after_margin = headroom == kUnlimited ? kUnlimited : headroom - margin;
  const std::uint64_t spare = after_margin == kUnlimited
                                  ? kUnlimited
                                  : after_margin - std::min(after_margin, r.other_bytes);
  const std::string source = limit.headroom_source();
  if (spare < r.minimum_bytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "the least host budget this run trains with, {} ({} bytes), does not fit: {} leaves "
        "{}, less an eighth kept free ({}) and the run's other needs ({}: activations, "
        "working buffers, heap): {} left; raise the limit or free memory, train a smaller part at "
        "once (part size, batch or sequence), or give a budget explicitly",
        Show(r.minimum_bytes), r.minimum_bytes, source, Show(headroom), Show(margin),
        Show(r.other_bytes), Show(spare)));
  }
  if (spare >= r.maximum_bytes) {
    b.bytes = r.maximum_bytes;
    b.reason = fmt::format(
        "all the training state can hold ({}), which fits: {} leaves {} after an eighth kept "
        "free and the run's other needs of {}",
        Show(r.maximum_bytes), source, Show(spare), Show(r.other_bytes));
  } else {
    b.bytes = std::max(spare / page * page, r.minimum_bytes);
    b.reason = fmt::format(
        "{}; less an eighth kept free ({}) and the run's other needs ({}: activations, "
        "working buffers, heap)",
        source, Show(margin), Show(r.other_bytes));
  }
  if (MemlockBinds(r, memory, b.bytes)) {
    b.locked = false;
    b.reason +=
        fmt::format("; unlocked memory: RLIMIT_MEMLOCK is {}", Show(memory.memlock_soft_bytes));
    b.warning = UnlockedWarning(b.bytes, memory);
  }
  return b;
}

absl::StatusOr<HostBudget> ChooseHostBudget(const HostBudgetRequest& request) {
  return ChooseHostBudget(request, ReadMemoryLimit(), prim::ProbeMemory());
}

// Note [store backing]
absl::StatusOr<StoreBacking> ChooseStoreBacking(ArenaBacking requested, std::uint64_t budget_bytes,
                                                bool gpu_tier, const MemoryInfo& memory) {
  StoreBacking s;
  s.backing = requested;
  const bool mlock =
      requested == ArenaBacking::kMlock || (requested == ArenaBacking::kAuto && !gpu_tier);
  if (!mlock || memory.lockable_bytes() >= budget_bytes) return s;
  if (requested == ArenaBacking::kMlock) {
    return absl::ResourceExhaustedError(
        TooMuchToLock(budget_bytes, memory,
                      "give a smaller budget, host_backing auto or unlocked (ordinary memory)"));
  }
  s.backing = ArenaBacking::kUnlocked;
  s.warning = UnlockedWarning(budget_bytes, memory);
  return s;
}

absl::StatusOr<StoreBacking> ChooseStoreBacking(ArenaBacking requested, std::uint64_t budget_bytes,
                                                bool gpu_tier) {
  return ChooseStoreBacking(requested, budget_bytes, gpu_tier, prim::ProbeMemory());
}

}  // namespace memascend
