// memascend/host_budget.h: the pinned host budget a run takes when none is given, and
// the refusal of a given one the machine cannot hold.
//
//   memascend::HostBudgetRequest want;
//   want.minimum_bytes = memascend::OffloadedAdam::MinimumHostBudget(layout);
//   want.maximum_bytes = memascend::VersionedTrainingState::StoredBytes(layout);
//   want.other_bytes = activations + working_buffers + heap;  // the caller's estimate
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::HostBudget b, memascend::ChooseHostBudget(want));
//   if (!b.warning.empty()) std::fprintf(stderr, "%s\n", b.warning.c_str());
//   store_options.host_budget_bytes = b.bytes;
//   if (!b.locked) store_options.host_backing = memascend::ArenaBacking::kUnlocked;
//
// Note [default host budget]
// With no budget given, the budget is what the machine leaves (Note [memory limit],
// system.h: the cgroup's limit less its usage, or MemAvailable, whichever is less), less
// an eighth of it kept free (the page cache of the volume's reads and writes, the other
// processes), less the run's own needs outside the budget (`other_bytes`: activations,
// working buffers, the ordinary heap), at most what the training state can ever hold
// (`maximum_bytes`), in whole pages. When that is below `minimum_bytes` the run does not
// fit and kResourceExhausted says by how much and which limit. Budgets held with mlock
// count against RLIMIT_MEMLOCK (CUDA-registered ones do not, nor do a process's with
// CAP_IPC_LOCK): when the limit is below the budget, the budget is ordinary unlocked
// memory (`locked` false, ArenaBacking::kUnlocked) rather than a smaller locked one, and
// `warning` says what to raise for page-locked memory. `reason` names the figure that
// decided.
// A budget given (`given_bytes`) is capped at `maximum_bytes` as before, and refused up
// front, kResourceExhausted naming both figures and the limit's source, when it is above
// the memory limit (the cgroup's limit, else MemTotal) or, held with mlock, above
// RLIMIT_MEMLOCK: a given budget is never quietly unlocked nor shrunk.
//
// Note [store backing]
// A TensorStore's budget is always given (TensorStoreOptions::host_budget_bytes); how it is
// held may be left to the store (ArenaBacking::kAuto). On a store without a GPU tier kAuto
// is mlock, and the arena locks its regions as it maps them: a budget above what
// RLIMIT_MEMLOCK lets the process lock (no CAP_IPC_LOCK) would fail at the first
// allocation past the limit, mid-run. ChooseStoreBacking decides up front instead: kAuto
// without a GPU tier becomes ordinary unlocked memory (kUnlocked) with `warning`, the
// advice of Note [default host budget], as the default optimizer budget does; an explicit
// kMlock above the limit is refused (kResourceExhausted naming both figures), as a given
// optimizer budget is. Every other request is kept as asked. The budget is compared with
// the limit alone, not with what other budgets of the process will lock.
//
// Thread-safety: pure functions of their arguments, but for the probing overloads, which
// read /proc and /sys (any thread).
#ifndef MEMASCEND_HOST_BUDGET_H_
#define MEMASCEND_HOST_BUDGET_H_

#include <cstdint>
#include <string>

#include <absl/status/statusor.h>

#include <memascend/host_arena.h>
#include <memascend/system.h>

namespace memascend {

struct HostBudgetRequest {
  std::uint64_t minimum_bytes = 0;           // the least the run trains with
  std::uint64_t maximum_bytes = kUnlimited;  // what the state can ever hold; never more
  std::uint64_t other_bytes = 0;  // the run's needs outside the budget (the caller's estimate)
  // How the budget is to be held: kMlock counts against RLIMIT_MEMLOCK, kCudaRegistered not.
  HostBackingKind backing = HostBackingKind::kMlock;
  std::uint64_t given_bytes = 0;  // a budget the user gave; 0: choose one
};

struct HostBudget {
  std::uint64_t bytes = 0;  // the budget, in whole pages for a chosen one
  bool locked = true;       // false: hold it unlocked (ArenaBacking::kUnlocked)
  bool given = false;       // it is the request's given_bytes (capped at maximum_bytes)
  std::string reason;       // which figure decided, with the figures
  std::string warning;      // non-empty: the memlock advice, for the caller to print once
};

// Note [default host budget], on the figures given (for tests and for callers that probed).
absl::StatusOr<HostBudget> ChooseHostBudget(const HostBudgetRequest& request,
                                            const MemoryLimit& limit, const MemoryInfo& memory);
// The same on this machine's figures, read now (ReadMemoryLimit(), ProbeSystem().memory).
absl::StatusOr<HostBudget> ChooseHostBudget(const HostBudgetRequest& request);

struct StoreBacking {
  ArenaBacking backing = ArenaBacking::kAuto;  // for TensorStoreOptions::host_backing
  std::string warning;  // non-empty: the memlock advice, for the caller to print once
};

// Note [store backing], on the figures given, for a store of `budget_bytes` with a GPU tier
// or not.
absl::StatusOr<StoreBacking> ChooseStoreBacking(ArenaBacking requested, std::uint64_t budget_bytes,
                                                bool gpu_tier, const MemoryInfo& memory);
// The same on this process's limits, read now.
absl::StatusOr<StoreBacking> ChooseStoreBacking(ArenaBacking requested, std::uint64_t budget_bytes,
                                                bool gpu_tier);

}  // namespace memascend

#endif  // MEMASCEND_HOST_BUDGET_H_
