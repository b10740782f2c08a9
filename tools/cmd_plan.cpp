// memascend plan: what a MemAscend run needs before it starts (host RSS, pinned bytes, disk,
// I/O per step), beside what ZeRO-Infinity's rules would need for the same run (sim/plan.h).
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include <memascend/status.h>

#include "args.h"
#include "commands.h"
#include "sim/plan.h"

namespace memascend::cli {
namespace {

constexpr std::string_view kSummary =
    "what a run needs: host RSS, pinned, disk and I/O per step, beside ZeRO-Infinity's rules";

constexpr OptionSpec kOptions[] = {
    {"config", true, "a Hugging Face config.json (model_type gpt2 or llama)"},
    {"params", true, "or a parameter count (with --layers, --hidden, --vocab, --heads if known)"},
    {"layers", true, "the demo GPT's layers (4), or the --params model's"},
    {"hidden", true, "the demo GPT's channels (128), or the --params model's"},
    {"heads", true, "the demo GPT's heads (4)"},
    {"vocab", true, "the demo GPT's vocabulary (256)"},
    {"seq", true, "tokens per sequence (default 64)"},
    {"batch", true, "sequences per step (default 8)"},
    {"dtype", true, "fp16 | bf16: working parameters and gradients (default fp16)"},
    {"optimizer-chunk", true, "elements per stored part, as memascend-train's (default 1048576)"},
    {"checkpoint-activations", false, "keep each block's input only (memascend-train's flag)"},
    {"host-limit", true, "host memory to plan for, bytes (default: this machine's limit)"},
    {"host-budget", true, "a given pinned budget, bytes (default: the one the run would choose)"},
    {"gpu-memory", true, "GPU memory, bytes: says whether the GPU estimate fits"},
    {"base-rss", true, "the process's fixed memory, bytes (default 256M)"},
    {"json", false, "one JSON object, every figure in bytes"},
    {"help", false, "show this help"},
};

constexpr std::string_view kMore =
    "\nWithout --config or --params: the demo GPT of memascend-train (--layers, --hidden, "
    "--heads,\n"
    "--vocab). Byte sizes take a K, M, G or T suffix. The model of each figure: tools/sim/plan.h,\n"
    "Note [plan model]; docs/training.md.\n"
    "Ranges (Note [plan bounds] in tools/sim/plan.cpp): --params up to 2^44, --seq up to 2^24,\n"
    "--batch up to 2^20, --layers up to 100000, --hidden up to 2^20, --heads up to 2^16,\n"
    "--vocab up to 2^24, byte sizes up to 1 EiB, and the state and activations within 1 EiB.\n";

std::string Gib(std::uint64_t bytes) {
  return fmt::format("{:.3f} GiB", static_cast<double>(bytes) / static_cast<double>(1u << 30));
}

void PrintTable(const Plan& p) {
  const PlanRequest& r = p.request;
  const double params = static_cast<double>(p.params);
  fmt::print("model: {}, {:.3f} M parameters in {} groups; seq {}, batch {}, {}\n",
             ToString(r.model.arch), params / 1e6, p.groups, r.seq, r.batch,
             r.dtype == DType::kBF16 ? "bf16" : "fp16");
  fmt::print("host limit: {}\n\n",
             p.host_limit_bytes == kUnlimited ? std::string("unlimited") : Gib(p.host_limit_bytes));
  fmt::print("{:<26} {:>16} {:>16}\n", "", "MemAscend", "ZeRO-Infinity");
  auto row = [](std::string_view name, std::uint64_t a, std::uint64_t b) {
    fmt::print("{:<26} {:>16} {:>16}\n", name, Gib(a), Gib(b));
  };
  row("pinned host memory", p.memascend.pinned_bytes, p.zero.pinned_bytes);
  row("pageable host memory", p.memascend.pageable_bytes, p.zero.pageable_bytes);
  row("peak host RSS", p.memascend.peak_rss_bytes, p.zero.peak_rss_bytes);
  row("disk", p.memascend.disk_bytes, p.zero.disk_bytes);
  row("I/O read per step", p.memascend.io_read_bytes_per_step, p.zero.io_read_bytes_per_step);
  row("I/O written per step", p.memascend.io_write_bytes_per_step, p.zero.io_write_bytes_per_step);
  auto per = [params](std::uint64_t b) { return static_cast<double>(b) / params; };
  fmt::print("{:<26} {:>16} {:>16}\n", "disk per parameter",
             fmt::format("{:.1f} B", per(p.memascend.disk_bytes)),
             fmt::format("{:.1f} B", per(p.zero.disk_bytes)));
  fmt::print("{:<26} {:>16} {:>16}\n", "peak RSS per parameter",
             fmt::format("{:.1f} B", per(p.memascend.peak_rss_bytes)),
             fmt::format("{:.1f} B", per(p.zero.peak_rss_bytes)));
  fmt::print("\npinned budget: {}\n", p.budget_holds_state
                                          ? "holds the state and the gradients: only writes"
                                          : "below the state and the gradients: it streams");
  fmt::print("  {}\n", p.budget_reason);
  fmt::print("peak RSS counts a fixed base of {} (--base-rss)\n", Gib(r.base_rss_bytes));
  fmt::print("GPU estimate (two groups and the activations in 16 bits): {}", Gib(p.gpu_bytes));
  if (r.gpu_memory_bytes != 0) {
    fmt::print(", {} the {} given", p.gpu_bytes <= r.gpu_memory_bytes ? "fits" : "does NOT fit",
               Gib(r.gpu_memory_bytes));
  }
  fmt::print("\n");
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(fmt::format("{}: cannot open it", path));
  std::string text;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && text.size() < (16u << 20))
    text.append(buf, n);
  std::fclose(f);
  return text;
}

absl::StatusOr<PlanRequest> Request(const Args& a) {
  PlanRequest r;
  auto count = [&a](std::string_view name,
                    std::uint64_t fallback) -> absl::StatusOr<std::uint64_t> {
    auto v = a.GetInt(name, static_cast<std::int64_t>(fallback));
    if (!v.ok()) return v.status();
    if (*v <= 0) return absl::InvalidArgumentError(fmt::format("--{} must be positive", name));
    return static_cast<std::uint64_t>(*v);
  };
  if (a.Has("config") && a.Has("params"))
    return absl::InvalidArgumentError("give --config or --params, not both");
  if (a.Has("config")) {
    MEMASCEND_ASSIGN_OR_RETURN(const std::string text, ReadFile(a.Get("config")));
    MEMASCEND_ASSIGN_OR_RETURN(r.model, ParsePlanConfig(text, a.Get("config")));
  } else {
    if (a.Has("params")) {
      r.model.arch = PlanArch::kParams;
      MEMASCEND_ASSIGN_OR_RETURN(r.model.params, count("params", 1));
      r.model.layers = 1;
      r.model.vocab = 0;
    }
    MEMASCEND_ASSIGN_OR_RETURN(r.model.layers, count("layers", r.model.layers));
    MEMASCEND_ASSIGN_OR_RETURN(r.model.hidden, count("hidden", r.model.hidden));
    MEMASCEND_ASSIGN_OR_RETURN(r.model.heads, count("heads", r.model.heads));
    if (a.Has("vocab")) {
      MEMASCEND_ASSIGN_OR_RETURN(r.model.vocab, count("vocab", 1));
    }
  }
  MEMASCEND_ASSIGN_OR_RETURN(r.seq, count("seq", r.seq));
  MEMASCEND_ASSIGN_OR_RETURN(r.batch, count("batch", r.batch));
  MEMASCEND_ASSIGN_OR_RETURN(const std::uint64_t chunk, count("optimizer-chunk", r.part_elements));
  r.part_elements = static_cast<std::size_t>(chunk);
  const std::string dtype = a.Get("dtype", "fp16");
  if (dtype != "fp16" && dtype != "bf16")
    return absl::InvalidArgumentError(fmt::format("--dtype {}: fp16 or bf16", dtype));
  r.dtype = dtype == "bf16" ? DType::kBF16 : DType::kF16;
  r.checkpoint_activations = a.Has("checkpoint-activations");
  MEMASCEND_ASSIGN_OR_RETURN(r.host_limit_bytes, a.GetBytes("host-limit", 0));
  MEMASCEND_ASSIGN_OR_RETURN(r.host_budget_bytes, a.GetBytes("host-budget", 0));
  MEMASCEND_ASSIGN_OR_RETURN(r.gpu_memory_bytes, a.GetBytes("gpu-memory", 0));
  MEMASCEND_ASSIGN_OR_RETURN(r.base_rss_bytes, a.GetBytes("base-rss", r.base_rss_bytes));
  return r;
}

}  // namespace

int RunPlan(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kOptions);
  if (!args.ok()) {
    fmt::print(stderr, "memascend plan: {}\n{}", Message(args.status()),
               Usage("plan", kSummary, kOptions));
    return kExitUsage;
  }
  if (args->Has("help")) {
    fmt::print("{}{}", Usage("plan", kSummary, kOptions), kMore);
    return kExitOk;
  }
  auto request = Request(*args);
  if (!request.ok()) {
    fmt::print(stderr, "memascend plan: {}\n", Message(request.status()));
    return request.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage
                                                                         : kExitFailure;
  }
  auto plan = MakePlan(*request);
  if (!plan.ok()) {
    fmt::print(stderr, "memascend plan: {}\n", Message(plan.status()));
    return kExitFailure;
  }
  if (args->Has("json")) {
    fmt::print("{}\n", PlanJson(*plan));
  } else {
    PrintTable(*plan);
  }
  return kExitOk;
}

}  // namespace memascend::cli
