// sim/pool_sim.h (tools/, not in libmemascend): replays the host-buffer schedule of one offloaded
// training step against a pinned-memory policy, with accounting-only backing, so that the allocator
// logic of each policy can be measured on workloads far larger than this machine.
//
// The schedule (docs/host-memory.md) is the same for every policy:
//  1. forward: the layer groups in order, each group's parameters (fp16/bf16) staged
//     while the next group's are prefetched;
//  2. backward: the groups in reverse, each group's parameters and gradients staged
//     while the previous group's parameters are prefetched;
//  3. optimizer step: every tensor streamed in slices of at most
//     `optimizer_slice_elements`, each slice staging its fp32 master weights, Adam
//     moments and fp32 gradients.
#ifndef MEMASCEND_TOOLS_SIM_POOL_SIM_H_
#define MEMASCEND_TOOLS_SIM_POOL_SIM_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/memory_ledger.h>
#include <memascend/workload.h>

#include "sim/zero_swap_buffers.h"

namespace memascend::sim {

enum class Phase : std::uint8_t { kForward, kBackward, kOptimizer };
inline constexpr int kPhaseCount = 3;
std::string_view ToString(Phase phase) noexcept;

struct ScheduleEvent {
  enum class Kind : std::uint8_t { kAlloc, kFree };
  Kind kind;
  Phase phase;
  Use use;
  std::uint32_t id;  // an allocation and its free share the id
  std::uint64_t bytes;
};

struct ScheduleOptions {
  std::size_t param_element_bytes = 2;      // fp16 / bf16 working parameters and gradients
  std::size_t optimizer_element_bytes = 4;  // fp32 master weights, moments, gradients
  std::uint64_t optimizer_slice_elements = std::uint64_t{1} << 24;
};

struct StepSchedule {
  std::vector<ScheduleEvent> events;
  std::vector<std::size_t> request_sizes;  // distinct request sizes, ascending
  std::uint32_t requests = 0;
  std::uint64_t live_peak_bytes = 0;
  std::array<std::uint64_t, kPhaseCount> phase_live_peak_bytes{};
};

// kInvalidArgument for a zero slice or element size.
absl::StatusOr<StepSchedule> BuildStepSchedule(const Workload& workload,
                                               const ScheduleOptions& options);

enum class SimPolicy { kMemAscend, kPow2, kZero };
std::string_view ToString(SimPolicy policy) noexcept;
absl::StatusOr<SimPolicy> ParseSimPolicy(std::string_view name);

struct SimOptions {
  ScheduleOptions schedule;
  ZeroSwapConfig zero;                // the zero policy's configuration (DeepSpeed defaults)
  std::size_t arena_chunk_bytes = 0;  // 0: one region per growth, exactly the request
  int steps = 1;                      // the step's schedule is replayed this many times
  MemoryLedger* ledger = nullptr;     // optional: receives the pinned-tier accounting
};

struct SimResult {
  std::string workload;
  SimPolicy policy = SimPolicy::kMemAscend;
  std::uint64_t tensors = 0;
  std::uint64_t parameters = 0;
  std::uint32_t requests = 0;
  std::uint64_t live_peak_bytes = 0;      // asked for (the same for every policy)
  std::uint64_t reserved_peak_bytes = 0;  // pinned bytes held from the OS, at peak
  std::array<std::uint64_t, kPhaseCount> phase_live_peak_bytes{};
  std::array<std::uint64_t, kPhaseCount> phase_reserved_peak_bytes{};
  int steps = 1;
  std::uint64_t regions_mapped = 0;            // over all steps
  std::uint64_t regions_mapped_last_step = 0;  // steady state, when steps > 1
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::size_t classes_used = 0;
  // zero policy only
  std::size_t param_buffers = 0;
  std::size_t param_buffer_bytes = 0;
  std::size_t optimizer_buffers = 0;
  std::size_t optimizer_buffer_bytes = 0;
};

absl::StatusOr<SimResult> RunPoolSim(const Workload& workload, SimPolicy policy,
                                     const SimOptions& options);

std::string ToJson(const SimResult& result);

}  // namespace memascend::sim

#endif  // MEMASCEND_TOOLS_SIM_POOL_SIM_H_
