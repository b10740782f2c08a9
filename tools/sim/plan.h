// sim/plan.h (tools/, not in libmemascend): what a run needs before it starts: host RSS,
// pinned bytes, disk and I/O per step, for MemAscend (the way memascend-train lays the
// state out) and for ZeRO-Infinity's rules (zero_swap_buffers.h), side by side. The CLI's
// `memascend plan` and Python's `memascend.plan()` both call MakePlan, so they never disagree.
//
//   memascend::PlanRequest r;
//   MEMASCEND_ASSIGN_OR_RETURN(r.model, memascend::ParsePlanConfig(text, "config.json"));
//   r.seq = 256;
//   r.batch = 1;
//   r.dtype = memascend::DType::kBF16;
//   r.host_limit_bytes = std::uint64_t{64} << 30;  // 0: this machine's figures
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::Plan p, memascend::MakePlan(r));
//   std::puts(memascend::PlanJson(p).c_str());
//
// Note [plan model]: MemAscend's figures are the SDK's own functions on the layout that
// memascend-train builds (its groups: the embeddings, one per block, the head; parts of
// part_elements; the embedding's and head's 16-bit parameters derived, not stored):
// - pinned: ChooseHostBudget (Note [default host budget]) with OffloadedAdam's minimum, the
//   state's StoredBytes as the maximum and the trainer's working-memory estimate as the
//   other needs, on the given host limit (or this machine);
// - disk: VersionedTrainingState::VolumeBytes (Note [volume size]);
// - I/O per step: the state (stored 16-bit parameters, fp32 master weights and both
//   moments) is written each step, and the gradients too when the state is committed in
//   batches (more than max_staged_bytes: Note [state in place] in training_state.h). A
//   budget that holds the state and the gradients (StoredBytes) reads nothing. At the
//   minimum budget the state streams: the update reads the master weights, moments and
//   gradients and writes the gradients the backward pass spilled; the forward and backward
//   passes read the stored parameters once each. In between, that traffic in proportion
//   to where the budget lies (an interpolation: the least-recently-used store keeps some);
// - peak host RSS: the budget, the trainer's working buffers and activations (fp32), and a
//   fixed base (base_rss_bytes: the binary, its libraries, the heap; 256 MiB by default,
//   the trainer's own allowance; a measured base makes the figure tighter).
// ZeRO-Infinity's figures follow its rules (zero_swap_buffers.h; ../shared ANCHORS):
// pinned parameter buffers of max(1e8, the largest tensor) 16-bit elements, five in one
// allocation, and four optimizer buffers of the largest sub-group in fp32, each rounded to
// a power of two; the 16-bit parameters kept in one pinned buffer while they total at most
// max_in_cpu (else on NVMe, with a swap buffer of the largest sub-group); a pageable flat
// 16-bit gradient buffer and, in fp16, the overflow check's 1-byte-per-element temporary
// (a reduce bucket's fp32 gradient copies are the GPU's); 0.16.5's rules, whose
// pin_memory defaults are off; on disk one file per tensor: fp32 master weights,
// moments and gradients (16 B/param), and the 16-bit parameters beyond max_in_cpu.
// The GPU figure (with gpu_memory_bytes) is an estimate for either: two groups of 16-bit
// parameters and their gradients in flight, and the activations in 16 bits.
//
// Thread-safety: pure functions, but for MakePlan without a host limit (reads /proc).
#ifndef MEMASCEND_TOOLS_SIM_PLAN_H_
#define MEMASCEND_TOOLS_SIM_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <absl/status/statusor.h>

#include <memascend/types.h>

#include "sim/zero_swap_buffers.h"

namespace memascend {

enum class PlanArch { kGpt, kGpt2, kLlama, kParams };
std::string_view ToString(PlanArch a) noexcept;  // "gpt", "gpt2", "llama", "params"

// The model's shapes. kGpt: memascend-train's demo GPT (positions = the sequence length,
// untied head); kGpt2 and kLlama: a Hugging Face config; kParams: only a parameter count
// (with layers and hidden, if given, for the activations), in `layers` equal groups.
struct PlanModel {
  PlanArch arch = PlanArch::kGpt;
  std::uint64_t vocab = 256;
  std::uint64_t hidden = 128;
  std::uint64_t layers = 4;
  std::uint64_t heads = 4;
  std::uint64_t kv_heads = 0;       // 0: heads
  std::uint64_t head_dim = 0;       // 0: hidden / heads
  std::uint64_t intermediate = 0;   // 0: 4 x hidden
  std::uint64_t max_positions = 0;  // GPT-2's learned positions; kGpt: the sequence length
  bool tie_embeddings = false;
  std::uint64_t params = 0;  // kParams only
};

// The keys of a Hugging Face config.json that the plan needs (model_type gpt2 or llama).
// kInvalidArgument naming `source` and the key for another model type or a missing size.
absl::StatusOr<PlanModel> ParsePlanConfig(std::string_view json, std::string_view source);

struct PlanRequest {
  PlanModel model;
  std::uint64_t seq = 64;
  std::uint64_t batch = 8;
  DType dtype = DType::kF16;  // working parameters and gradients: kF16 or kBF16
  std::size_t part_elements = std::size_t{1} << 20;  // memascend-train's --optimizer-chunk
  bool checkpoint_activations = false;
  std::uint64_t host_limit_bytes = 0;   // 0: this machine's limit (Note [memory limit])
  std::uint64_t host_budget_bytes = 0;  // a given budget; 0: the default one
  std::uint64_t gpu_memory_bytes = 0;   // 0: no GPU figure's verdict
  std::uint64_t base_rss_bytes = std::uint64_t{256} << 20;  // Note [plan model]
  ZeroSwapConfig zero;
  std::uint64_t zero_max_in_cpu = 1'000'000'000;  // offload_param.max_in_cpu
};

// One system's needs, in bytes.
struct PlanNeeds {
  std::uint64_t pinned_bytes = 0;
  std::uint64_t pageable_bytes = 0;  // ordinary memory beyond the base: buffers, activations
  std::uint64_t peak_rss_bytes = 0;  // pinned + pageable + base
  std::uint64_t disk_bytes = 0;
  std::uint64_t io_read_bytes_per_step = 0;
  std::uint64_t io_write_bytes_per_step = 0;
};

struct Plan {
  PlanRequest request;
  std::uint64_t params = 0;
  std::uint64_t groups = 0;
  std::uint64_t largest_tensor = 0;    // elements
  std::uint64_t state_bytes = 0;       // 16-bit parameters and gradients, fp32 master and moments
  std::uint64_t host_limit_bytes = 0;  // what the budget was chosen against (kUnlimited: none)
  std::uint64_t activation_bytes = 0;  // of the pageable bytes, the activations (fp32)
  std::uint64_t gpu_bytes = 0;         // Note [plan model]: an estimate
  PlanNeeds memascend;
  std::uint64_t minimum_pinned_bytes = 0;  // OffloadedAdam::MinimumHostBudget
  std::uint64_t stored_bytes = 0;          // VersionedTrainingState::StoredBytes
  bool budget_holds_state = false;         // one version and the gradients fit (Note [plan model])
  std::string budget_reason;
  PlanNeeds zero;
  std::uint64_t zero_param_buffer_bytes = 0;      // each, before pow2 rounding
  std::uint64_t zero_optimizer_buffer_bytes = 0;  // each, before pow2 rounding
  std::uint64_t zero_overflow_temporary_bytes = 0;
};

// kInvalidArgument for sizes out of range; kResourceExhausted when the least budget the
// run trains with does not fit the host limit (ChooseHostBudget's refusal).
absl::StatusOr<Plan> MakePlan(const PlanRequest& request);
// One JSON object, every figure in bytes.
std::string PlanJson(const Plan& plan);

}  // namespace memascend

#endif  // MEMASCEND_TOOLS_SIM_PLAN_H_
