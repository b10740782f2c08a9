#include "sim/pool_sim.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <variant>

#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>

#include "util/json_writer.h"

namespace memascend::sim {

std::string_view ToString(Phase phase) noexcept {
  switch (phase) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kOptimizer:
      return "optimizer";
  }
  return "unknown";
}

std::string_view ToString(SimPolicy policy) noexcept {
  switch (policy) {
    case SimPolicy::kMemAscend:
      return "memascend";
    case SimPolicy::kPow2:
      return "pow2";
    case SimPolicy::kZero:
      return "zero";
  }
  return "unknown";
}

absl::StatusOr<SimPolicy> ParseSimPolicy(std::string_view name) {
  if (name == "memascend") return SimPolicy::kMemAscend;
  if (name == "pow2") return SimPolicy::kPow2;
  if (name == "zero") return SimPolicy::kZero;
  return absl::InvalidArgumentError(
      fmt::format("unknown policy '{}' (memascend, pow2 or zero)", name));
}

namespace {

class ScheduleBuilder {
 public:
  explicit ScheduleBuilder(StepSchedule* s) : s_(s) {}

  std::uint32_t Alloc(Phase phase, Use use, std::uint64_t bytes) {
    const std::uint32_t id = s_->requests++;
    s_->events.push_back({ScheduleEvent::Kind::kAlloc, phase, use, id, bytes});
    sizes_.push_back(bytes);
    if (bytes_.size() <= id) bytes_.resize(id + 1);
    bytes_[id] = bytes;
    live_ += bytes;
    s_->live_peak_bytes = std::max(s_->live_peak_bytes, live_);
    auto& phase_peak = s_->phase_live_peak_bytes[static_cast<int>(phase)];
    phase_peak = std::max(phase_peak, live_);
    return id;
  }
  void Free(Phase phase, Use use, std::uint32_t id) {
    s_->events.push_back({ScheduleEvent::Kind::kFree, phase, use, id, bytes_[id]});
    live_ -= bytes_[id];
  }
  void Finish() {
    std::sort(sizes_.begin(), sizes_.end());
    sizes_.erase(std::unique(sizes_.begin(), sizes_.end()), sizes_.end());
    s_->request_sizes.assign(sizes_.begin(), sizes_.end());
  }

 private:
  StepSchedule* s_;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::uint64_t> bytes_;
  std::uint64_t live_ = 0;
};

}  // namespace

absl::StatusOr<StepSchedule> BuildStepSchedule(const Workload& workload,
                                               const ScheduleOptions& options) {
  if (options.optimizer_slice_elements == 0 || options.param_element_bytes == 0 ||
      options.optimizer_element_bytes == 0) {
    return absl::InvalidArgumentError("schedule: slice and element sizes must be positive");
  }
  StepSchedule s;
  ScheduleBuilder b(&s);
  const std::vector<TensorGroup> groups = GroupByLayer(workload);
  const std::size_t n = groups.size();
  const auto stage = [&](std::size_t g, Phase phase, Use use) {
    std::vector<std::uint32_t> ids;
    for (std::size_t t : groups[g].tensors) {
      ids.push_back(b.Alloc(phase, use, workload.tensors[t].numel * options.param_element_bytes));
    }
    return ids;
  };
  const auto release = [&](const std::vector<std::uint32_t>& ids, Phase phase, Use use) {
    for (std::uint32_t id : ids) b.Free(phase, use, id);
  };

  // 1. Forward, next group prefetched.
  std::vector<std::uint32_t> current = stage(0, Phase::kForward, Use::kParameters);
  for (std::size_t g = 0; g < n; ++g) {
    std::vector<std::uint32_t> next;
    if (g + 1 < n) next = stage(g + 1, Phase::kForward, Use::kParameters);
    release(current, Phase::kForward, Use::kParameters);
    current = std::move(next);
  }
  // 2. Backward, previous group prefetched; gradients written back per group.
  current = stage(n - 1, Phase::kBackward, Use::kParameters);
  for (std::size_t g = n; g-- > 0;) {
    std::vector<std::uint32_t> prev;
    if (g > 0) prev = stage(g - 1, Phase::kBackward, Use::kParameters);
    const std::vector<std::uint32_t> grads = stage(g, Phase::kBackward, Use::kGradients);
    release(current, Phase::kBackward, Use::kParameters);
    release(grads, Phase::kBackward, Use::kGradients);
    current = std::move(prev);
  }
  // 3. Optimizer step, streamed in slices.
  const std::uint64_t e = options.optimizer_element_bytes;
  for (const WorkloadTensor& t : workload.tensors) {
    for (std::uint64_t off = 0; off < t.numel; off += options.optimizer_slice_elements) {
      const std::uint64_t bytes = std::min(options.optimizer_slice_elements, t.numel - off) * e;
      const std::uint32_t master = b.Alloc(Phase::kOptimizer, Use::kOptimizerState, bytes);
      const std::uint32_t m = b.Alloc(Phase::kOptimizer, Use::kOptimizerState, bytes);
      const std::uint32_t v = b.Alloc(Phase::kOptimizer, Use::kOptimizerState, bytes);
      const std::uint32_t grad = b.Alloc(Phase::kOptimizer, Use::kGradients, bytes);
      b.Free(Phase::kOptimizer, Use::kOptimizerState, master);
      b.Free(Phase::kOptimizer, Use::kOptimizerState, m);
      b.Free(Phase::kOptimizer, Use::kOptimizerState, v);
      b.Free(Phase::kOptimizer, Use::kGradients, grad);
    }
  }
  b.Finish();
  return s;
}

namespace {

// The peak number of simultaneously live requests that satisfy `pred`.
template <typename Pred>
std::size_t PeakConcurrent(const StepSchedule& s, Pred pred) {
  std::size_t live = 0, peak = 0;
  for (const ScheduleEvent& e : s.events) {
    if (!pred(e)) continue;
    if (e.kind == ScheduleEvent::Kind::kAlloc) {
      peak = std::max(peak, ++live);
    } else {
      --live;
    }
  }
  return peak;
}

}  // namespace

absl::StatusOr<SimResult> RunPoolSim(const Workload& workload, SimPolicy policy,
                                     const SimOptions& options) {
  MEMASCEND_ASSIGN_OR_RETURN(const StepSchedule schedule,
                             BuildStepSchedule(workload, options.schedule));
  HostArenaOptions arena_options;
  arena_options.backing = ArenaBacking::kAccounting;
  arena_options.budget_bytes = std::size_t{1} << 50;  // address space only
  arena_options.chunk_bytes = options.arena_chunk_bytes;
  arena_options.ledger = options.ledger;
  MEMASCEND_ASSIGN_OR_RETURN(auto arena, HostArena::Create(arena_options));

  PinnedPoolOptions pool_options;
  pool_options.policy = policy == SimPolicy::kMemAscend ? PoolPolicy::kAdaptive : PoolPolicy::kPow2;
  if (policy == SimPolicy::kMemAscend) pool_options.expected_sizes = schedule.request_sizes;
  MEMASCEND_ASSIGN_OR_RETURN(auto pool, PinnedPool::Create(arena.get(), pool_options));

  SimResult r;
  r.workload = workload.name;
  r.policy = policy;
  r.tensors = workload.tensors.size();
  r.parameters = workload.total_parameters;
  r.requests = schedule.requests;
  r.live_peak_bytes = schedule.live_peak_bytes;
  r.phase_live_peak_bytes = schedule.phase_live_peak_bytes;

  std::unique_ptr<ZeroSwapBuffers> zero;
  const ZeroSwapConfig& zc = options.zero;
  const auto swapped_param = [&](const ScheduleEvent& e) {
    return e.phase != Phase::kOptimizer && e.bytes >= zc.min_swap_bytes;
  };
  if (policy == SimPolicy::kZero) {
    // Enough buffers for this schedule, never fewer than DeepSpeed's configuration.
    ZeroSwapConfig config = zc;
    config.param_buffer_count =
        std::max(zc.param_buffer_count, PeakConcurrent(schedule, swapped_param));
    config.optimizer_buffer_count =
        std::max(zc.optimizer_buffer_count, PeakConcurrent(schedule, [](const ScheduleEvent& e) {
                   return e.phase == Phase::kOptimizer;
                 }));
    const std::vector<std::uint64_t> groups = ZeroSubGroups(workload, zc.sub_group_size);
    MEMASCEND_ASSIGN_OR_RETURN(
        zero, ZeroSwapBuffers::Create(pool.get(), config, workload.largest_numel,
                                      *std::max_element(groups.begin(), groups.end())));
    r.param_buffers = config.param_buffer_count;
    r.param_buffer_bytes = zero->param_buffer_bytes();
    r.optimizer_buffers = config.optimizer_buffer_count;
    r.optimizer_buffer_bytes = zero->optimizer_buffer_bytes();
  }

  if (options.steps < 1) return absl::InvalidArgumentError("pool-sim: steps must be >= 1");
  r.steps = options.steps;
  using Held = std::variant<std::monostate, PinnedBlock, ZeroSwapBuffers::Buffer>;
  std::vector<Held> held(schedule.requests);
  std::uint64_t regions_before_last = 0;
  for (int step = 0; step < options.steps; ++step) {
    if (step + 1 == options.steps) regions_before_last = arena->stats().regions_mapped_total;
    for (const ScheduleEvent& e : schedule.events) {
      Held& slot = held[e.id];
      if (e.kind == ScheduleEvent::Kind::kAlloc) {
        if (zero != nullptr && (e.phase == Phase::kOptimizer || swapped_param(e))) {
          const auto kind = e.phase == Phase::kOptimizer ? ZeroSwapBuffers::Kind::kOptimizer
                                                         : ZeroSwapBuffers::Kind::kParameter;
          MEMASCEND_ASSIGN_OR_RETURN(slot, zero->Acquire(kind, e.bytes));
        } else {
          MEMASCEND_ASSIGN_OR_RETURN(slot, pool->Allocate(e.bytes, e.use));
        }
      } else if (auto* buffer = std::get_if<ZeroSwapBuffers::Buffer>(&slot)) {
        MEMASCEND_RETURN_IF_ERROR(zero->Release(*buffer));
        slot = std::monostate();
      } else {
        slot = std::monostate();  // returns the block to its class
      }
      auto& phase_peak = r.phase_reserved_peak_bytes[static_cast<int>(e.phase)];
      phase_peak = std::max<std::uint64_t>(phase_peak, arena->stats().mapped_bytes);
    }
  }
  const HostArenaStats a = arena->stats();
  const PinnedPoolStats p = pool->stats();
  r.reserved_peak_bytes = a.mapped_peak_bytes;
  r.regions_mapped = a.regions_mapped_total;
  r.regions_mapped_last_step = a.regions_mapped_total - regions_before_last;
  r.hits = p.hits;
  r.misses = p.misses;
  r.classes_used = p.classes.size();
  return r;
}

std::string ToJson(const SimResult& r) {
  util::JsonWriter w;
  w.BeginObject();
  w.Field("workload", r.workload);
  w.Field("policy", ToString(r.policy));
  w.Field("tensors", r.tensors);
  w.Field("parameters", r.parameters);
  w.Field("requests", r.requests);
  w.Field("live_peak_bytes", r.live_peak_bytes);
  w.Field("reserved_peak_bytes", r.reserved_peak_bytes);
  w.Field("reserved_over_live", r.live_peak_bytes == 0
                                    ? 0.0
                                    : static_cast<double>(r.reserved_peak_bytes) /
                                          static_cast<double>(r.live_peak_bytes));
  w.Key("phases").BeginObject();
  for (int i = 0; i < kPhaseCount; ++i) {
    w.Key(ToString(static_cast<Phase>(i))).BeginObject();
    w.Field("live_peak_bytes", r.phase_live_peak_bytes[i]);
    w.Field("reserved_peak_bytes", r.phase_reserved_peak_bytes[i]);
    w.EndObject();
  }
  w.EndObject();
  w.Field("steps", r.steps);
  w.Field("regions_mapped", r.regions_mapped);
  w.Field("regions_mapped_last_step", r.regions_mapped_last_step);
  w.Field("pool_hits", r.hits);
  w.Field("pool_misses", r.misses);
  w.Field("classes_used", r.classes_used);
  if (r.policy == SimPolicy::kZero) {
    w.Key("zero").BeginObject();
    w.Field("param_buffers", r.param_buffers);
    w.Field("param_buffer_bytes", r.param_buffer_bytes);
    w.Field("optimizer_buffers", r.optimizer_buffers);
    w.Field("optimizer_buffer_bytes", r.optimizer_buffer_bytes);
    w.EndObject();
  }
  w.EndObject();
  return std::move(w).str();
}

}  // namespace memascend::sim
