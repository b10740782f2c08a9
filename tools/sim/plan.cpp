#include "sim/plan.h"

#include <algorithm>
#include <bit>
#include <vector>

#include <fmt/format.h>

#include <memascend/host_budget.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/status.h>
#include <memascend/training_state.h>
#include <memascend/workload.h>

#include "util/json_reader.h"
#include "util/json_writer.h"

namespace memascend {
namespace {

using Tensors = std::vector<std::uint64_t>;  // element counts of a group's tensors

// The model's tensors group by group, as memascend-train lays them out (model.cpp's
// GroupLayout, llama.cpp's LlamaGroupLayout): group 0 the embeddings, one group per block,
// the last the head (its own matrix unless tied).
std::vector<Tensors> GroupTensors(const PlanModel& m, std::uint64_t seq) {
  std::vector<Tensors> g;
  const std::uint64_t h = m.hidden;
  if (m.arch == PlanArch::kParams) {
    const std::uint64_t n = std::max<std::uint64_t>(m.layers, 1);
    for (std::uint64_t i = 0; i < n; ++i)
      g.push_back({m.params / n + (i + 1 == n ? m.params % n : 0)});
    return g;
  }
  const bool llama = m.arch == PlanArch::kLlama;
  if (llama) {
    g.push_back({m.vocab * h});
  } else {
    g.push_back({m.vocab * h, (m.arch == PlanArch::kGpt ? seq : m.max_positions) * h});
  }
  const std::uint64_t qw = m.heads * m.head_dim, kw = m.kv_heads * m.head_dim, in = m.intermediate;
  for (std::uint64_t l = 0; l < m.layers; ++l) {
    if (llama) {
      g.push_back({h, qw * h, kw * h, kw * h, h * qw, h, in * h, in * h, h * in});
    } else {
      g.push_back({h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h});
    }
  }
  Tensors head = llama ? Tensors{h} : Tensors{h, h};
  if (!m.tie_embeddings) head.push_back(m.vocab * h);
  g.push_back(head);
  return g;
}

std::uint64_t Sum(const Tensors& t) {
  std::uint64_t n = 0;
  for (std::uint64_t x : t) n += x;
  return n;
}

// memascend-train's WorkingMemoryBytes (host_budget.cpp) without its heap allowance: the
// working buffers (the largest group's parameters in fp32, a tied head's embeddings in 16
// bits and 16 MiB of them widened, a block's gradient in fp32) and the activations of the
// batch. Returns {buffers, activations} in floats.
std::pair<std::uint64_t, std::uint64_t> WorkingFloats(const PlanRequest& r,
                                                      const std::vector<std::uint64_t>& groups) {
  const PlanModel& m = r.model;
  const bool tied = m.tie_embeddings && m.arch != PlanArch::kParams;
  std::uint64_t work = 0, scratch = 0;
  for (std::size_t g = tied ? 1 : 0; g < groups.size(); ++g) work = std::max(work, groups[g]);
  for (std::size_t g = 1; g + 1 < groups.size(); ++g) scratch = std::max(scratch, groups[g]);
  if (m.arch == PlanArch::kParams) scratch = work;
  // The tied embeddings: 16 bits (half a float) each, and a chunk of rows widened
  // (kTiedChunkBytes in the trainer).
  const std::uint64_t embed_rows = groups[0] / std::max<std::uint64_t>(m.hidden, 1);
  const std::uint64_t chunk =
      std::clamp<std::uint64_t>(
          (std::uint64_t{16} << 20) / (4 * std::max<std::uint64_t>(m.hidden, 1)), 1,
          std::max<std::uint64_t>(embed_rows, 1)) *
      m.hidden;
  const std::uint64_t buffers = work + (tied ? groups[0] / 2 + chunk : 0) + scratch;
  const std::uint64_t rows = r.batch * r.seq;
  const std::uint64_t kept = r.checkpoint_activations ? 1 : m.layers;
  const std::uint64_t ch = m.hidden, attention = r.batch * m.heads * r.seq * r.seq;
  std::uint64_t acts = 0;
  if (m.arch == PlanArch::kLlama) {
    const std::uint64_t qw = m.heads * m.head_dim, kw = m.kv_heads * m.head_dim,
                        in = m.intermediate;
    acts = kept * (rows * (4 * ch + 2 * qw + 2 * kw + 3 * in + 2) + attention) +
           rows * (2 * ch + m.vocab + 4 * std::max({in, qw, ch}));
  } else {
    acts = kept * (rows * (15 * ch + 4) + attention) + rows * (2 * ch + m.vocab + 9 * ch);
  }
  return {buffers, acts};
}

// Note [plan model]: a host of `bytes` with nothing else on it and no memlock limit.
std::pair<MemoryLimit, MemoryInfo> HostOf(std::uint64_t bytes) {
  MemoryLimit limit;
  limit.total_bytes = bytes;
  limit.available_bytes = bytes;
  MemoryInfo memory;
  memory.page_size = 4096;
  memory.total_bytes = memory.available_bytes = bytes;
  memory.memlock_soft_bytes = memory.memlock_hard_bytes = kUnlimited;
  return {limit, memory};
}

// Note [plan bounds]: every input is bounded, generously, so that no product below wraps
// a 64-bit integer and no per-part loop runs for hours (a state of 2^63 parameters is
// 2^43 parts): the flag and the config key are named, and rc 1 says why, instead of a
// wrapped figure with rc 0 or a hang.
absl::Status Bound(std::string_view what, std::uint64_t value, std::uint64_t most) {
  if (value <= most) return absl::OkStatus();
  return absl::InvalidArgumentError(
      fmt::format("plan: {} is {}, beyond the {} the plan models", what, value, most));
}

absl::Status Check(const PlanRequest& r) {
  const PlanModel& m = r.model;
  if (r.dtype != DType::kF16 && r.dtype != DType::kBF16)
    return absl::InvalidArgumentError("plan: the dtype is fp16 or bf16");
  if (r.seq == 0 || r.batch == 0 || r.part_elements == 0)
    return absl::InvalidArgumentError("plan: seq, batch and the part size must be positive");
  constexpr std::uint64_t kMostBytes = std::uint64_t{1} << 60;  // 1 EiB
  MEMASCEND_RETURN_IF_ERROR(Bound("--seq", r.seq, std::uint64_t{1} << 24));
  MEMASCEND_RETURN_IF_ERROR(Bound("--batch", r.batch, std::uint64_t{1} << 20));
  MEMASCEND_RETURN_IF_ERROR(Bound("--optimizer-chunk", r.part_elements, std::uint64_t{1} << 32));
  MEMASCEND_RETURN_IF_ERROR(Bound("--host-limit", r.host_limit_bytes, kMostBytes));
  MEMASCEND_RETURN_IF_ERROR(Bound("--host-budget", r.host_budget_bytes, kMostBytes));
  MEMASCEND_RETURN_IF_ERROR(Bound("--gpu-memory", r.gpu_memory_bytes, kMostBytes));
  MEMASCEND_RETURN_IF_ERROR(Bound("--base-rss", r.base_rss_bytes, kMostBytes));
  if (m.arch == PlanArch::kParams) {
    if (m.params == 0) return absl::InvalidArgumentError("plan: a positive parameter count");
    MEMASCEND_RETURN_IF_ERROR(Bound("--params", m.params, std::uint64_t{1} << 44));
    MEMASCEND_RETURN_IF_ERROR(Bound("--layers", m.layers, 100'000));
    MEMASCEND_RETURN_IF_ERROR(Bound("--hidden", m.hidden, 1u << 20));
    MEMASCEND_RETURN_IF_ERROR(Bound("--heads", m.heads, 1u << 16));
    MEMASCEND_RETURN_IF_ERROR(Bound("--vocab", m.vocab, 1u << 24));
  } else {
    if (m.vocab == 0 || m.hidden == 0 || m.layers == 0 || m.heads == 0 || m.head_dim == 0 ||
        m.kv_heads == 0 || m.intermediate == 0)
      return absl::InvalidArgumentError("plan: every size of the model must be positive");
    MEMASCEND_RETURN_IF_ERROR(
        Bound("the layers (--layers, n_layer, num_hidden_layers)", m.layers, 100'000));
    MEMASCEND_RETURN_IF_ERROR(
        Bound("the hidden size (--hidden, n_embd, hidden_size)", m.hidden, 1u << 20));
    MEMASCEND_RETURN_IF_ERROR(Bound("the vocabulary (--vocab, vocab_size)", m.vocab, 1u << 24));
    MEMASCEND_RETURN_IF_ERROR(
        Bound("the heads (--heads, n_head, num_attention_heads)", m.heads, 1u << 16));
    MEMASCEND_RETURN_IF_ERROR(Bound("the kv heads (num_key_value_heads)", m.kv_heads, 1u << 16));
    MEMASCEND_RETURN_IF_ERROR(Bound("the head size (head_dim)", m.head_dim, 1u << 16));
    MEMASCEND_RETURN_IF_ERROR(
        Bound("the intermediate size (intermediate_size)", m.intermediate, 1u << 24));
    MEMASCEND_RETURN_IF_ERROR(
        Bound("the positions (n_positions, max_position_embeddings)", m.max_positions, 1u << 24));
  }
  // Each input in range, their products may still be beyond 64 bits (a long --seq with a
  // wide model): the largest figures are estimated in floating point first.
  const double seq = static_cast<double>(r.seq), rows = static_cast<double>(r.batch) * seq;
  const double h = static_cast<double>(m.hidden), heads = static_cast<double>(m.heads),
               width = std::max({h, heads * static_cast<double>(m.head_dim),
                                 static_cast<double>(m.intermediate)});
  double params = static_cast<double>(m.params);
  if (m.arch != PlanArch::kParams) {
    params = static_cast<double>(m.layers) * 12 * h * width +
             2 * h * static_cast<double>(std::max(m.vocab, std::max(m.max_positions, r.seq)));
  }
  const double acts = static_cast<double>(m.layers) * (rows * 20 * width + rows * heads * seq) +
                      rows * 2 * static_cast<double>(m.vocab);
  if (params * 32 > static_cast<double>(kMostBytes) || acts * 4 > static_cast<double>(kMostBytes)) {
    return absl::InvalidArgumentError(
        fmt::format("plan: the model and batch need about {:.3g} bytes of state (two versions) and "
                    "{:.3g} of activations, "
                    "beyond the 1 EiB the plan models: give a smaller model, --seq or --batch",
                    params * 32, acts * 4));
  }
  // The state is counted part by part (VersionedTrainingState::StoredBytes).
  constexpr double kMostParts = double(std::uint64_t{1} << 26);
  if (params / static_cast<double>(r.part_elements) > kMostParts) {
    return absl::InvalidArgumentError(fmt::format(
        "plan: about {:.3g} parameters in parts of --optimizer-chunk {} are more than {:.0f} "
        "parts: give a larger --optimizer-chunk",
        params, r.part_elements, kMostParts));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view ToString(PlanArch a) noexcept {
  switch (a) {
    case PlanArch::kGpt:
      return "gpt";
    case PlanArch::kGpt2:
      return "gpt2";
    case PlanArch::kLlama:
      return "llama";
    case PlanArch::kParams:
      return "params";
  }
  return "?";
}

absl::StatusOr<PlanModel> ParsePlanConfig(std::string_view json, std::string_view source) {
  auto parsed = util::ParseJson(json);
  if (!parsed.ok() || !parsed->is_object()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: {}", source, parsed.ok() ? "not an object" : std::string(parsed.status().message())));
  }
  const util::JsonValue& v = *parsed;
  // The first of `keys` present, as a positive count; `fallback` (0: required) if none is.
  auto count = [&](std::initializer_list<std::string_view> keys,
                   std::uint64_t fallback) -> absl::StatusOr<std::uint64_t> {
    for (std::string_view k : keys) {
      const util::JsonValue* x = v.Find(k);
      if (x == nullptr || x->is_null()) continue;
      auto n = x->AsInt();
      if (!n.ok() || *n <= 0)
        return absl::InvalidArgumentError(
            fmt::format("{}: {} is not a positive integer", source, k));
      return static_cast<std::uint64_t>(*n);
    }
    if (fallback != 0) return fallback;
    return absl::InvalidArgumentError(fmt::format("{}: no {}", source, *keys.begin()));
  };
  auto flag = [&](std::string_view key, bool fallback) {
    const util::JsonValue* x = v.Find(key);
    auto b = x != nullptr ? x->AsBool() : absl::StatusOr<bool>(fallback);
    return b.ok() ? *b : fallback;
  };
  const absl::StatusOr<std::string> model_type = v.GetString("model_type");
  const std::string type = model_type.ok() ? *model_type : std::string();
  PlanModel m;
  if (type == "gpt2") {
    m.arch = PlanArch::kGpt2;
    MEMASCEND_ASSIGN_OR_RETURN(m.vocab, count({"vocab_size"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.hidden, count({"n_embd", "hidden_size"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.layers, count({"n_layer", "num_hidden_layers"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.heads, count({"n_head", "num_attention_heads"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.max_positions, count({"n_positions", "n_ctx"}, 0));
    m.kv_heads = m.heads;
    m.head_dim = m.hidden / m.heads;
    m.intermediate = 4 * m.hidden;  // the trainer's GPT-2 block
    m.tie_embeddings = flag("tie_word_embeddings", true);
  } else if (type == "llama") {
    m.arch = PlanArch::kLlama;
    MEMASCEND_ASSIGN_OR_RETURN(m.vocab, count({"vocab_size"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.hidden, count({"hidden_size"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.layers, count({"num_hidden_layers"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.heads, count({"num_attention_heads"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.kv_heads, count({"num_key_value_heads"}, m.heads));
    MEMASCEND_ASSIGN_OR_RETURN(m.head_dim,
                               count({"head_dim"}, std::max<std::uint64_t>(m.hidden / m.heads, 1)));
    MEMASCEND_ASSIGN_OR_RETURN(m.intermediate, count({"intermediate_size"}, 0));
    MEMASCEND_ASSIGN_OR_RETURN(m.max_positions, count({"max_position_embeddings"}, 2048));
    m.tie_embeddings = flag("tie_word_embeddings", false);
  } else {
    return absl::InvalidArgumentError(fmt::format(
        "{}: model_type '{}': the plan knows gpt2 and llama (give --params N otherwise)", source,
        type));
  }
  return m;
}

absl::StatusOr<Plan> MakePlan(const PlanRequest& request) {
  Plan p;
  p.request = request;
  PlanRequest& r = p.request;
  PlanModel& m = r.model;
  if (m.kv_heads == 0) m.kv_heads = m.heads;
  if (m.head_dim == 0 && m.heads != 0) m.head_dim = m.hidden / m.heads;
  if (m.intermediate == 0) m.intermediate = 4 * m.hidden;
  MEMASCEND_RETURN_IF_ERROR(Check(r));

  const std::vector<Tensors> tensors = GroupTensors(m, r.seq);
  std::vector<std::uint64_t> groups;
  Workload workload;
  for (const Tensors& t : tensors) {
    groups.push_back(Sum(t));
    for (std::uint64_t n : t) {
      workload.tensors.push_back({"t", {n}, n, -1});
      p.largest_tensor = std::max(p.largest_tensor, n);
    }
  }
  // memascend-train's layout (state.cpp, MakeStateLayout with MemAscend's policy).
  StateLayout layout;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const bool derived = m.arch != PlanArch::kParams && (g == 0 || g + 1 == groups.size());
    const std::string name = g == 0                   ? "embed"
                             : g + 1 == groups.size() ? "head"
                                                      : fmt::format("block.{}", g - 1);
    layout.groups.push_back({name, static_cast<std::size_t>(groups[g]), !derived});
  }
  layout.param_dtype = layout.grad_dtype = r.dtype;
  layout.part_elements = r.part_elements;
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  p.params = layout.TotalElements();
  p.groups = groups.size();
  const std::uint64_t half = SizeOf(r.dtype);
  p.state_bytes = p.params * (2 * half + 12);

  // MemAscend (Note [plan model]).
  const auto [buffers, acts] = WorkingFloats(r, groups);
  p.activation_bytes = acts * 4;
  const std::uint64_t working = (buffers + acts) * 4;
  HostBudgetRequest want;
  want.minimum_bytes = OffloadedAdam::MinimumHostBudget(layout);
  want.maximum_bytes =  // never below the minimum, as the trainer's (host_budget.cpp)
      std::max<std::uint64_t>(VersionedTrainingState::StoredBytes(layout), want.minimum_bytes);
  want.other_bytes = working + (std::uint64_t{256} << 20);  // the trainer's heap allowance
  want.backing = HostBackingKind::kMlock;
  want.given_bytes = r.host_budget_bytes;
  absl::StatusOr<HostBudget> budget;
  if (r.host_limit_bytes != 0) {
    const auto [limit, memory] = HostOf(r.host_limit_bytes);
    budget = ChooseHostBudget(want, limit, memory);
    p.host_limit_bytes = r.host_limit_bytes;
  } else {
    budget = ChooseHostBudget(want);
    p.host_limit_bytes = ReadMemoryLimit().limit_bytes();
  }
  MEMASCEND_RETURN_IF_ERROR(budget.status());
  p.minimum_pinned_bytes = want.minimum_bytes;
  p.stored_bytes = VersionedTrainingState::StoredBytes(layout);
  p.budget_reason = budget->reason;
  p.memascend.pinned_bytes = budget->bytes;
  p.memascend.pageable_bytes = working;
  p.memascend.peak_rss_bytes = budget->bytes + working + r.base_rss_bytes;
  p.memascend.disk_bytes = VersionedTrainingState::VolumeBytes(layout);
  std::uint64_t version = 0, stored_params = 0;
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    const std::uint64_t n = layout.groups[g].elements;
    if (layout.groups[g].store_parameters) stored_params += n * half;
    version += n * 12;
  }
  version += stored_params;
  const std::uint64_t gradients = p.params * half;
  // Note [plan model]: the state (in place: StoredBytes, the gradients with it) resident:
  // nothing is read; the minimum: everything streams; in between, the traffic beyond the
  // writes in proportion. A state committed in batches (Note [state in place]) writes its
  // gradients each step, the redo record.
  const std::uint64_t resident = p.stored_bytes;
  const bool batched = version > VersionedTrainingStateOptions{}.max_staged_bytes;
  p.budget_holds_state = budget->bytes >= resident;
  p.memascend.io_write_bytes_per_step = version + (batched ? gradients : 0);
  if (!p.budget_holds_state) {
    const std::uint64_t reads = p.params * 12 + gradients + 2 * stored_params;
    const double share =
        resident <= p.minimum_pinned_bytes || budget->bytes <= p.minimum_pinned_bytes
            ? 1.0
            : static_cast<double>(resident - budget->bytes) /
                  static_cast<double>(resident - p.minimum_pinned_bytes);
    p.memascend.io_read_bytes_per_step =
        static_cast<std::uint64_t>(share * static_cast<double>(reads));
    if (!batched) {  // gradients spilled by the backward pass
      p.memascend.io_write_bytes_per_step +=
          static_cast<std::uint64_t>(share * static_cast<double>(gradients));
    }
  }

  // ZeRO-Infinity's rules (zero_swap_buffers.h).
  const std::vector<std::uint64_t> subs = ZeroSubGroups(workload, r.zero.sub_group_size);
  const std::uint64_t largest_sub = *std::max_element(subs.begin(), subs.end());
  const ZeroSwapSizes sizes = ZeroSwapBufferSizes(r.zero, p.largest_tensor, largest_sub);
  p.zero_param_buffer_bytes = sizes.param_buffer_bytes;
  p.zero_optimizer_buffer_bytes = sizes.optimizer_buffer_bytes;
  std::uint64_t in_cpu = 0;  // sub-groups whose 16-bit parameters fit max_in_cpu, in order
  for (std::uint64_t s : subs) {
    if (in_cpu + s > r.zero_max_in_cpu) break;
    in_cpu += s;
  }
  const std::uint64_t on_nvme = p.params - in_cpu;
  std::uint64_t pinned = sizes.pinned_bytes;
  if (in_cpu > 0) pinned += std::bit_ceil(in_cpu * half);
  if (on_nvme > 0) pinned += std::bit_ceil(largest_sub * half);
  // isinf(flat) then isnan(flat), 1 B each, in fp16 only. The fp32 copies of a
  // reduce_bucket_size bucket are made on the GPU: no host bytes (Note [zero rules]).
  p.zero_overflow_temporary_bytes = r.dtype == DType::kF16 ? p.params : 0;
  p.zero.pinned_bytes = pinned;
  p.zero.pageable_bytes = gradients + p.zero_overflow_temporary_bytes + working;
  p.zero.peak_rss_bytes = pinned + p.zero.pageable_bytes + r.base_rss_bytes;
  p.zero.disk_bytes = p.params * 16 + on_nvme * half;
  p.zero.io_read_bytes_per_step = p.params * 16 + 2 * on_nvme * half;
  p.zero.io_write_bytes_per_step = p.params * 16 + on_nvme * half;

  // The GPU (Note [plan model]): two groups of 16-bit parameters and gradients, and the
  // activations in 16 bits.
  const std::uint64_t largest_group = *std::max_element(groups.begin(), groups.end());
  p.gpu_bytes = 2 * 2 * largest_group * half + acts * half;
  return p;
}

std::string PlanJson(const Plan& p) {
  const PlanRequest& r = p.request;
  const PlanModel& m = r.model;
  util::JsonWriter w;
  w.BeginObject();
  w.Key("model")
      .BeginObject()
      .Field("arch", ToString(m.arch))
      .Field("params", p.params)
      .Field("groups", p.groups)
      .Field("layers", m.layers)
      .Field("hidden", m.hidden)
      .Field("vocab", m.vocab)
      .Field("largest_tensor_elements", p.largest_tensor)
      .EndObject();
  w.Field("seq", r.seq)
      .Field("batch", r.batch)
      .Field("dtype", r.dtype == DType::kBF16 ? "bf16" : "fp16")
      .Field("part_elements", static_cast<std::uint64_t>(r.part_elements))
      .Field("host_limit_bytes", p.host_limit_bytes)
      .Field("base_rss_bytes", r.base_rss_bytes)
      .Field("state_bytes", p.state_bytes)
      .Field("activation_bytes", p.activation_bytes);
  auto needs = [&w](const PlanNeeds& n) {
    w.Field("pinned_bytes", n.pinned_bytes)
        .Field("pageable_bytes", n.pageable_bytes)
        .Field("peak_rss_bytes", n.peak_rss_bytes)
        .Field("disk_bytes", n.disk_bytes)
        .Field("io_read_bytes_per_step", n.io_read_bytes_per_step)
        .Field("io_write_bytes_per_step", n.io_write_bytes_per_step)
        .Field("io_bytes_per_step", n.io_read_bytes_per_step + n.io_write_bytes_per_step);
  };
  w.Key("memascend").BeginObject();
  needs(p.memascend);
  w.Field("minimum_pinned_bytes", p.minimum_pinned_bytes)
      .Field("stored_bytes", p.stored_bytes)
      .Field("budget_holds_state", p.budget_holds_state)
      .Field("budget_reason", p.budget_reason)
      .EndObject();
  w.Key("zero_infinity").BeginObject();
  needs(p.zero);
  w.Field("param_buffer_bytes", p.zero_param_buffer_bytes)
      .Field("optimizer_buffer_bytes", p.zero_optimizer_buffer_bytes)
      .Field("overflow_temporary_bytes", p.zero_overflow_temporary_bytes)
      .EndObject();
  w.Key("gpu").BeginObject().Field("bytes", p.gpu_bytes);
  if (r.gpu_memory_bytes != 0) {
    w.Field("memory_bytes", r.gpu_memory_bytes).Field("fits", p.gpu_bytes <= r.gpu_memory_bytes);
  }
  w.EndObject();
  w.EndObject();
  return std::move(w).str();
}

}  // namespace memascend
