#include "options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memascend/safetensors.h>
#include <memascend/status.h>

#include "blas.h"
#include "hf_config.h"
#include "util/units.h"

namespace offload_train {
namespace {

// A number of the option's type, strictly: a whole number for an integer (digits only:
// no sign, fraction, exponent or overflow of the type; 0 or 1 for a flag), a finite
// number >= 0 for a real. On failure `*why` says what was expected.
template <typename T>
bool ParseNumber(const std::string& v, T* out, std::string* why) {
  if constexpr (std::is_same_v<T, bool>) {
    *why = "0 or 1";
    if (v != "0" && v != "1") return false;
    *out = v == "1";
    return true;
  } else if constexpr (std::is_integral_v<T>) {
    *why = fmt::format("a whole number from 0 to {}", std::numeric_limits<T>::max());
    if (v.empty() || v.size() > 20 ||
        !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return false;
    errno = 0;
    const unsigned long long x = std::strtoull(v.c_str(), nullptr, 10);
    if (errno == ERANGE || x > static_cast<unsigned long long>(std::numeric_limits<T>::max()))
      return false;
    *out = static_cast<T>(x);
    return true;
  } else {
    *why = "a finite number >= 0";
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(d) || d < 0 ||
        d > static_cast<double>(std::numeric_limits<T>::max()))
      return false;
    *out = static_cast<T>(d);
    return true;
  }
}

// The one byte-size grammar of every MemAscend binary (util/units.h).
bool ParseBytes(const std::string& s, std::uint64_t* out) {
  auto v = memascend::util::ParseByteSize(s);
  if (!v.ok()) return false;
  *out = *v;
  return true;
}

// One option: its name, the form of its value (empty: a switch, which takes none), its
// default as --help shows it (empty: none shown), its help, and how a value is stored.
// `set` returns false for a bad value, with `*why` saying what was expected (empty:
// "missing or bad value").
struct Option {
  const char* name;
  std::string value;
  std::string fallback;
  const char* help;
  std::function<bool(CommandLine&, const std::string&, std::string* why)> set;
  // The default read from a default CommandLine, where `fallback` is empty and it is set.
  std::function<std::string(CommandLine&)> shown = nullptr;
};

// Option kinds. `get` returns where the value goes. A number's default is the one its
// field holds (TrainOptions' initialisers), unless `fallback` spells it otherwise.
template <typename Get>
Option Number(const char* name, const char* value, const char* help, Get get,
              std::string fallback = "") {
  return {name,
          value,
          std::move(fallback),
          help,
          [get](CommandLine& c, const std::string& v, std::string* why) {
            return ParseNumber(v, get(c), why);
          },
          [get](CommandLine& c) {
            const auto v = *get(c);
            if constexpr (std::is_same_v<decltype(v), const bool>)
              return std::string(v ? "1" : "0");
            return fmt::format("{}", v);
          }};
}

template <typename Get>
Option Bytes(const char* name, std::string fallback, const char* help, Get get) {
  return {name, "B", std::move(fallback), help,
          [get](CommandLine& c, const std::string& v, std::string*) {
            std::uint64_t bytes = 0;
            const bool ok = ParseBytes(v, &bytes);
            *get(c) = bytes;
            return ok;
          }};
}

template <typename Get>
Option Path(const char* name, const char* value, std::string fallback, const char* help, Get get) {
  return {name, value, std::move(fallback), help,
          [get](CommandLine& c, const std::string& v, std::string*) {
            *get(c) = v;
            return true;
          }};
}

Option Switch(const char* name, const char* help, std::function<void(CommandLine&)> on) {
  return {name, "", "", help,
          [on = std::move(on)](CommandLine& c, const std::string&, std::string*) {
            on(c);
            return true;
          }};
}

// One of `words`; `set(c, i)` with the index of the word given.
Option Choice(const char* name, std::vector<const char*> words, std::string fallback,
              const char* help, std::function<void(CommandLine&, std::size_t)> set) {
  std::string value;
  for (const char* w : words) value += (value.empty() ? "" : "|") + std::string(w);
  return {name, value, std::move(fallback), help,
          [words = std::move(words), set = std::move(set)](CommandLine& c, const std::string& v,
                                                           std::string* why) {
            *why = "";
            for (std::size_t i = 0; i < words.size(); ++i) {
              *why += fmt::format("{}{}",
                                  i == 0                  ? ""
                                  : i + 1 == words.size() ? " or "
                                                          : ", ",
                                  words[i]);
            }
            for (std::size_t i = 0; i < words.size(); ++i) {
              if (v == words[i]) {
                set(c, i);
                return true;
              }
            }
            return false;
          }};
}

// --host-budget: bytes, Fx (F times the minimum) or P% (of the training state).
bool SetHostBudget(CommandLine& c, const std::string& v, std::string* why) {
  if (!v.empty() && (v.back() == 'x' || v.back() == '%')) {
    const bool share = v.back() == '%';
    double f = 0;
    bool ok = ParseNumber(v.substr(0, v.size() - 1), &f, why);
    if (share) f /= 100;
    ok = ok && (share ? f > 0 && f <= 1 : f >= 1.0);
    c.budget_factor = f;
    c.budget_of_state = share;
    *why = "Fx with F a factor >= 1 of the minimum, P% with 0 < P <= 100, or bytes";
    return ok;
  }
  std::uint64_t bytes = 0;
  const bool ok = ParseBytes(v, &bytes) && bytes > 0;
  c.train.host_budget = bytes;
  return ok;
}

// A section of --help, and its options.
struct Section {
  const char* title;
  std::vector<Option> options;
};

// The table: every option of memascend-train, in the order --help lists them.
const std::vector<Section>& Table() {
  static const std::vector<Section>* table = new std::vector<Section>{
      {"the model and the run",
       {
           Number("--steps", "N",
                  "total steps (a resumed run continues to N; 0: only --eval and --export)",
                  [](CommandLine& c) { return &c.train.steps; }),
           Number("--seq", "N", "tokens per sequence",
                  [](CommandLine& c) { return &c.train.model.seq; }),
           Number("--batch", "N",
                  "sequences per step (under mpirun: the global batch, divided among the ranks)",
                  [](CommandLine& c) { return &c.train.model.batch; }),
           Number("--layers", "N", "the demo GPT's layers",
                  [](CommandLine& c) { return &c.train.model.layers; }),
           Number("--channels", "N", "the demo GPT's channels",
                  [](CommandLine& c) { return &c.train.model.channels; }),
           Number("--heads", "N", "the demo GPT's attention heads",
                  [](CommandLine& c) { return &c.train.model.heads; }),
           Number("--vocab", "N", "256: bytes; more: words of the corpus with byte fallback",
                  [](CommandLine& c) { return &c.train.model.vocab; }),
           Choice("--dtype", {"fp16", "bf16"}, "fp16", "working parameters and gradients",
                  [](CommandLine& c, std::size_t i) {
                    c.train.dtype = i == 1 ? memascend::DType::kBF16 : memascend::DType::kF16;
                  }),
           Switch("--checkpoint-activations",
                  "keep each block's input only (through the tensor store) and recompute the "
                  "block in the backward pass",
                  [](CommandLine& c) { c.train.checkpoint_activations = true; }),
           Choice("--matmul", {"blas", "exact"}, "blas when built with it",
                  "matrix products through OpenBLAS, or the exact loops (the same bits at any "
                  "--threads)",
                  [](CommandLine& c, std::size_t i) { c.matmul = i == 0 ? "blas" : "exact"; }),
       }},
      {"Hugging Face models",
       {
           Path("--config", "FILE", "",
                "a Hugging Face config.json (model_type llama or gpt2): that model, random weights",
                [](CommandLine& c) { return &c.config_path; }),
           Path("--init-from", "DIR", "",
                "a Hugging Face model directory (config.json, model.safetensors or "
                "model.safetensors.index.json and its shards; F32, F16, BF16): its weights",
                [](CommandLine& c) { return &c.train.init_from; }),
           Path("--export", "DIR", "", "after the last step, the model as a Hugging Face directory",
                [](CommandLine& c) { return &c.train.export_dir; }),
           Choice("--export-dtype", {"F32", "F16", "BF16"},
                  "the imported weights', else the config's", "the exported weights' dtype",
                  [](CommandLine& c, std::size_t i) {
                    c.export_dtype = std::vector<std::string>{"F32", "F16", "BF16"}[i];
                  }),
           {"--export-shard", "B", "5000000000", "bytes per file, more files with an index",
            [](CommandLine& c, const std::string& v, std::string*) {
              std::uint64_t bytes = 0;
              const bool ok = ParseBytes(v, &bytes) && bytes > 0;
              c.train.export_options.shard_bytes = bytes;
              return ok;
            }},
           Switch("--export-overwrite", "replace a model already in --export's directory",
                  [](CommandLine& c) { c.train.export_options.overwrite = true; }),
       }},
      {"data",
       {
           Path("--data", "FILE", "/usr/share/common-licenses/*", "training text",
                [](CommandLine& c) { return &c.data_path; }),
           Path("--tokens", "FILE", "",
                "training data: raw little-endian uint32 token ids (a Hugging Face model's; "
                "not needed with --steps 0)",
                [](CommandLine& c) { return &c.tokens_path; }),
           Path("--eval", "FILE", "",
                "token ids: mean next-token loss over windows of --seq + 1, after the last "
                "step (with --steps 0: of the imported model)",
                [](CommandLine& c) { return &c.eval_path; }),
       }},
      {"optimization",
       {
           Number("--lr", "X", "peak learning rate", [](CommandLine& c) { return &c.train.lr; }),
           Number("--warmup", "N", "steps of linear learning-rate warm-up",
                  [](CommandLine& c) { return &c.train.warmup; }),
           Number("--clip", "X", "global gradient norm; 0: no clipping",
                  [](CommandLine& c) { return &c.train.clip; }),
           Number("--weight-decay", "X", "AdamW's decoupled weight decay",
                  [](CommandLine& c) { return &c.train.weight_decay; }),
           Number("--seed", "N", "initialisation, batches and samples",
                  [](CommandLine& c) { return &c.train.seed; }),
           Number("--threads", "N", "compute threads; 0: all cores",
                  [](CommandLine& c) { return &c.train.threads; }),
           {"--loss-scale", "X", "65536 for fp16, 1 for bf16", "initial dynamic loss scale",
            [](CommandLine& c, const std::string& v, std::string* why) {
              c.loss_scale_given = true;
              return ParseNumber(v, &c.train.initial_loss_scale, why);
            }},
       }},
      {"offloading (MemAscend's policy)",
       {
           Choice("--mode", {"offload", "reference"}, "offload",
                  "state on a volume, or in ordinary memory",
                  [](CommandLine& c,
                     std::size_t i) { c.train.mode = i == 1 ? Mode::kReference : Mode::kOffload; }),
           Path("--volume", "PATH", MEMASCEND_TRAIN_DEFAULT_VOLUME,
                "volume file or block device; under mpirun it may hold {rank}",
                [](CommandLine& c) { return &c.train.volume_path; }),
           Bytes("--volume-size", "what the run needs",
                 "size of a file volume (the state, 256 MiB in flight, the journal and a margin of "
                 "1/64)",
                 [](CommandLine& c) { return &c.train.volume_bytes; }),
           Switch("--force",
                  "format a device or file that holds other data, or start over on an existing "
                  "volume (losing what it holds); without it an existing volume is refused: "
                  "continue it with --resume",
                  [](CommandLine& c) { c.train.force = true; }),
           Switch("--resume", "continue from the volume's last committed step",
                  [](CommandLine& c) { c.train.resume = true; }),
           {"--host-budget", "B",
            "what the memory cgroup or MemAvailable leaves, less an eighth and the run's own needs",
            "pinned host bytes; Fx: F times the minimum; P%: P percent of the training state "
            "(printed with its reason; unlocked with a warning when RLIMIT_MEMLOCK is below it)",
            SetHostBudget},
           Number("--window", "N", "layers prefetched ahead",
                  [](CommandLine& c) { return &c.train.window; }),
           Number("--optimizer-chunk", "N", "elements per stored part of every tensor",
                  [](CommandLine& c) { return &c.train.optimizer_chunk; }),
           Bytes("--read-ahead", "what the budget leaves beyond the minimum and --keep",
                 "optimizer state read ahead of the update",
                 [](CommandLine& c) { return &c.train.read_ahead_bytes; }),
           Bytes("--keep", "0", "optimizer state kept in memory across steps",
                 [](CommandLine& c) { return &c.train.keep_bytes; }),
           Number("--overlap-optimizer", "0|1",
                  "run a step's update interleaved with the next step's forward pass",
                  [](CommandLine& c) { return &c.train.overlap_optimizer; }),
           Number("--io-threads", "N", "the store's prefetch threads, reads in flight",
                  [](CommandLine& c) { return &c.train.io_threads; }),
           Number("--write-behind", "0|1", "write new versions back as soon as they are released",
                  [](CommandLine& c) { return &c.train.write_behind; }),
           Choice("--pool", {"adaptive", "pow2"}, "adaptive",
                  "the store's pinned pool: adaptive classes, or powers of two as PyTorch's "
                  "caching host allocator (an ablation)",
                  [](CommandLine& c, std::size_t i) { c.train.pow2_pool = i == 1; }),
           Choice("--overflow-check", {"fused", "temporaries"}, "fused",
                  "the gradients' inf/NaN check: one fused pass, or PyTorch's isinf/isnan "
                  "temporaries (an ablation)",
                  [](CommandLine& c, std::size_t i) { c.train.unfused_overflow_check = i == 1; }),
           Choice("--storage", {"volume", "files"}, "volume",
                  "the state on a volume, or in a directory (--volume names it) with a file per "
                  "tensor as ZeRO-Infinity's (an ablation)",
                  [](CommandLine& c, std::size_t i) { c.train.file_per_tensor = i == 1; }),
           Choice("--state-versions", {"1", "2"}, "1",
                  "the state once, updated in place, or in two versions (an ablation; "
                  "data-parallel ranks keep two)",
                  [](CommandLine& c, std::size_t i) { c.train.two_versions = i == 1; }),
           Choice("--staging", {"bounded", "step"}, "bounded",
                  "a step's writes on the volume before its commit: 256 MiB in flight beyond the "
                  "state, committed in batches with the gradients as redo record (the state's "
                  "disk footprint), or the whole step, committed once (a file volume a version "
                  "larger; the update's writes overlap the next forward and backward passes)",
                  [](CommandLine& c, std::size_t i) { c.train.stage_whole_step = i == 1; }),
           Number("--commit-every", "N",
                  "make every N-th step durable, from 1 to 1000000 (the steps between stay in "
                  "memory: a crash resumes up to N-1 steps back; a file volume is made a "
                  "version larger; --write-behind is off)",
                  [](CommandLine& c) { return &c.train.commit_every; }),
       }},
      {"the ZeRO-Infinity baseline (zero_infinity.h)",
       {
           Choice(
               "--policy", {"memascend", "zero-infinity"}, "memascend",
               "the SDK, or ZeRO-Infinity's rules",
               [](CommandLine& c,
                  std::size_t
                      i) { c.train.policy = i == 1 ? Policy::kZeroInfinity : Policy::kMemAscend; }),
           Choice("--zero-release", {"0.16.5", "0.19.5"}, "0.16.5",
                  "whose rules: 0.19.5 pins swap buffers at their size, pin_memory on",
                  [](CommandLine& c, std::size_t i) {
                    c.train.zero.release = i == 1 ? ZeroRelease::k0_19_5 : ZeroRelease::k0_16_5;
                  }),
           Path("--nvme-path", "DIR", "<volume>.zero", "swap directory, one file per tensor",
                [](CommandLine& c) { return &c.train.zero.nvme_path; }),
           Number("--zero-param-buffers", "N", "offload_param.buffer_count",
                  [](CommandLine& c) { return &c.train.zero.param_buffer_count; }),
           Number("--zero-param-buffer-size", "ELEMS", "offload_param.buffer_size",
                  [](CommandLine& c) { return &c.train.zero.param_buffer_size; }),
           Number("--zero-optimizer-buffers", "N", "offload_optimizer.buffer_count",
                  [](CommandLine& c) { return &c.train.zero.optimizer_buffer_count; }),
           Number("--zero-sub-group-size", "ELEMS", "sub_group_size",
                  [](CommandLine& c) { return &c.train.zero.sub_group_size; }),
           Number("--zero-queue-depth", "N", "aio.queue_depth",
                  [](CommandLine& c) { return &c.train.zero.aio_queue_depth; }),
           {"--zero-block", "B", "1M", "aio.block_size",
            [](CommandLine& c, const std::string& v, std::string* why) {
              std::uint64_t bytes = 0;
              const bool ok = ParseBytes(v, &bytes) && bytes >= 4096 && bytes % 4096 == 0 &&
                              bytes <= (1u << 30);
              *why = "a multiple of 4096 bytes (O_DIRECT) up to 1G";
              c.train.zero.aio_block_bytes = bytes;
              return ok;
            }},
           Bytes("--zero-min-swap", "1M", "smaller tensors stay in memory",
                 [](CommandLine& c) { return &c.train.zero.min_swap_bytes; }),
           Number("--zero-max-in-cpu", "ELEMS", "offload_param.max_in_cpu",
                  [](CommandLine& c) { return &c.train.zero.max_in_cpu; }),
           {"--zero-pin-optimizer", "0|1", "the release's", "offload_optimizer.pin_memory",
            [](CommandLine& c, const std::string& v, std::string* why) {
              c.zero_pin_optimizer_given = true;
              return ParseNumber(v, &c.train.zero.optimizer_pin_memory, why);
            }},
           {"--zero-pin-param", "0|1", "the release's", "offload_param.pin_memory",
            [](CommandLine& c, const std::string& v, std::string* why) {
              c.zero_pin_param_given = true;
              return ParseNumber(v, &c.train.zero.param_pin_memory, why);
            }},
           Number("--zero-reduce-bucket", "ELEMS", "reduce_bucket_size",
                  [](CommandLine& c) { return &c.train.zero.reduce_bucket_size; }),
           Number("--zero-pipeline-read", "0|1",
                  "offload_optimizer.pipeline_read (needs 4 more optimizer buffers)",
                  [](CommandLine& c) { return &c.train.zero.pipeline_read; }),
           Number("--zero-pipeline-write", "0|1",
                  "offload_optimizer.pipeline_write (needs 4 more optimizer buffers)",
                  [](CommandLine& c) { return &c.train.zero.pipeline_write; }),
       }},
      {"output",
       {
           Number("--sample", "N", "tokens generated at the end (at most 100000)",
                  [](CommandLine& c) { return &c.train.sample_tokens; }),
           Path("--timeline", "FILE", "", "CSV memory timeline (the ledger, sampled per layer)",
                [](CommandLine& c) { return &c.timeline_path; }),
           Switch("--json", "one JSON summary object on stdout instead of the report",
                  [](CommandLine& c) { c.json = true; }),
           Switch("--quiet", "no progress lines", [](CommandLine& c) { c.quiet = true; }),
       }},
  };
  return *table;
}

const Option* Find(std::string_view name) {
  for (const Section& s : Table()) {
    for (const Option& o : s.options) {
      if (name == o.name) return &o;
    }
  }
  return nullptr;
}

// The command line before any option: TrainOptions' defaults and the program's own.
CommandLine Defaults() {
  CommandLine c;
  c.train.volume_path = MEMASCEND_TRAIN_DEFAULT_VOLUME;
  c.train.sample_tokens = 120;
  c.matmul = blas::Available() ? "blas" : "exact";
  return c;
}

// `text` wrapped to lines of at most `width` columns, each after `indent` spaces but the
// first.
std::string Wrap(const std::string& text, std::size_t indent, std::size_t width) {
  std::string out, line;
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find(' ', at);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(at, end - at);
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + "\n" + std::string(indent, ' ');
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    at = end + 1;
  }
  return out + line;
}

}  // namespace

std::string Usage() {
  constexpr std::size_t kColumn = 30, kWidth = 60;
  CommandLine defaults = Defaults();
  std::string out = "usage: memascend-train [options]\n";
  for (const Section& s : Table()) {
    out += fmt::format("{}:\n", s.title);
    for (const Option& o : s.options) {
      std::string head = fmt::format("  {}{}{}", o.name, o.value.empty() ? "" : " ", o.value);
      head += head.size() + 1 < kColumn ? std::string(kColumn - head.size(), ' ')
                                        : "\n" + std::string(kColumn, ' ');
      std::string help = o.help;
      const std::string fallback = !o.fallback.empty()  ? o.fallback
                                   : o.shown != nullptr ? o.shown(defaults)
                                                        : "";
      if (!fallback.empty()) help += fmt::format(" (default: {})", fallback);
      out += head + Wrap(help, kColumn, kWidth) + "\n";
    }
  }
  out += R"(  --help                      this text
Under mpirun (a build with MPI), each rank trains on its rows of the global --batch
and offloads its shard of the state to its own volume: --volume may hold {rank}, and
must when ranks share a host. Rank 0 reports (--json: every rank's figures inside).
--resume continues from the newest step every rank holds (docs/distributed.md).
Byte sizes are whole numbers with an optional K, M, G or T suffix (powers of 1024).
)";
  return out;
}

absl::Status ParseCommandLine(int argc, char** argv, CommandLine* out, bool* help) {
  CommandLine& c = *out;
  c = Defaults();
  *help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") {
      *help = true;
      return absl::OkStatus();
    }
    const Option* o = Find(name);
    if (o == nullptr)
      return absl::InvalidArgumentError(fmt::format("unknown option '{}' (see --help)", name));
    std::string v, why;
    const bool takes_value = !o->value.empty();
    if (takes_value && i + 1 >= argc)
      return absl::InvalidArgumentError(fmt::format("{}: missing or bad value (see --help)", name));
    if (takes_value) v = argv[++i];
    if (!o->set(c, v, &why)) {
      if (!why.empty())
        return absl::InvalidArgumentError(
            fmt::format("{}: '{}' is not {} (see --help)", name, v, why));
      return absl::InvalidArgumentError(fmt::format("{}: missing or bad value (see --help)", name));
    }
  }
  if (c.train.volume_path == MEMASCEND_TRAIN_DEFAULT_VOLUME &&
      !std::filesystem::is_directory(std::filesystem::path(c.train.volume_path).parent_path())) {
    c.train.volume_path = "memascend-train.vol";  // an installed binary away from its build tree
  }
  c.train.blas = c.matmul == "blas";
  return absl::OkStatus();
}

absl::Status ResolveModel(CommandLine* cl) {
  TrainOptions& o = cl->train;
  // A Hugging Face model: its config (the import's, or --config's) gives the sizes.
  if (!cl->config_path.empty() && !o.init_from.empty())
    return absl::InvalidArgumentError(
        "--config and --init-from: give one (the directory holds its config.json)");
  if (!o.init_from.empty()) cl->config_path = o.init_from + "/config.json";
  if (!cl->config_path.empty()) {
    MEMASCEND_ASSIGN_OR_RETURN(const HfConfig hf, ReadHfConfig(cl->config_path));
    o.model = ForHf(hf, o.model.batch, o.model.seq);
    // The export's dtype: the imported weights' (their embeddings'), else the config's.
    if (cl->export_dtype.empty() && !o.init_from.empty() && !o.export_dir.empty()) {
      MEMASCEND_ASSIGN_OR_RETURN(auto ckpt, memascend::SafetensorsCheckpoint::Open(o.init_from));
      MEMASCEND_ASSIGN_OR_RETURN(const memascend::DType dtype, HfGroupDType(*ckpt, o.model, 0));
      cl->export_dtype = memascend::SafetensorsName(dtype);
    }
    if (cl->export_dtype.empty()) {
      cl->export_dtype = hf.torch_dtype == "bfloat16"  ? "BF16"
                         : hf.torch_dtype == "float16" ? "F16"
                                                       : "F32";
    }
    o.export_options.dtype = cl->export_dtype;
  } else if (!o.export_dir.empty()) {
    return absl::InvalidArgumentError(
        "--export: only a Hugging Face model (--config or --init-from) exports");
  }
  // Sizes are checked before anything is built from them (the tokenizer, the model).
  MEMASCEND_RETURN_IF_ERROR(Validate(o.model));
  if (o.sample_tokens > 100000)
    return absl::InvalidArgumentError(
        fmt::format("--sample {}: at most 100000 tokens", o.sample_tokens));
  if (cl->budget_factor > 0) {
    const std::uint64_t base = cl->budget_of_state
                                   ? ModelStateBytes(o.model, o.dtype)
                                   : MinimumHostBudget(o.model, o.dtype, o.optimizer_chunk);
    const double bytes = cl->budget_factor * static_cast<double>(base);
    if (!(bytes < 0x1p62)) {  // a size_t of it would be undefined (1e19x became "default")
      return absl::InvalidArgumentError(fmt::format(
          "--host-budget {}x: {:.3g} bytes, past what any host holds", cl->budget_factor, bytes));
    }
    o.host_budget = static_cast<std::size_t>(bytes) / 4096 * 4096;
  }
  if (o.dtype == memascend::DType::kBF16 && !cl->loss_scale_given) o.initial_loss_scale = 1.0f;
  const ZeroOptions release = ZeroDefaults(o.zero.release);
  if (!cl->zero_pin_optimizer_given) o.zero.optimizer_pin_memory = release.optimizer_pin_memory;
  if (!cl->zero_pin_param_given) o.zero.param_pin_memory = release.param_pin_memory;
  return absl::OkStatus();
}

absl::Status CheckOutputs(const CommandLine& cl) {
  namespace fs = std::filesystem;
  const TrainOptions& o = cl.train;
  std::error_code ec;
  const auto same = [&](const std::string& a, const std::string& b) {
    return !a.empty() && !b.empty() && fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
  };
  const std::string& timeline = cl.timeline_path;
  if (same(timeline, o.volume_path) || same(timeline, cl.data_path)) {
    return absl::InvalidArgumentError(fmt::format(
        "--timeline {} is the volume or the training text: give another file", timeline));
  }
  if (same(timeline, cl.tokens_path) || same(timeline, cl.eval_path)) {
    return absl::InvalidArgumentError(
        fmt::format("--timeline {} is a token file of this run (--tokens or --eval): "
                    "give another file",
                    timeline));
  }
  for (const std::string* input : {&cl.data_path, &cl.tokens_path, &cl.eval_path}) {
    if (same(o.volume_path, *input)) {
      return absl::InvalidArgumentError(fmt::format(
          "--volume {} is the training or evaluation data: give another file", o.volume_path));
    }
  }
  // Nothing is written into the checkpoint being imported: neither the timeline nor the
  // volume (which --force would format) may be a file of --init-from's directory.
  if (!o.init_from.empty()) {
    for (const auto& [flag, path] :
         {std::pair{"--timeline", &timeline}, std::pair{"--volume", &o.volume_path}}) {
      const std::string parent = fs::path(*path).parent_path().string();
      if (!path->empty() && fs::exists(*path, ec) &&
          same(parent.empty() ? std::string(".") : parent, o.init_from)) {
        return absl::InvalidArgumentError(
            fmt::format("{} {} is a file of the checkpoint --init-from {} imports: give "
                        "another file",
                        flag, *path, o.init_from));
      }
    }
  }
  // Every output's place checked before the first step, not after the last.
  if (!timeline.empty()) {
    const fs::path parent = fs::path(timeline).parent_path();
    if (!parent.empty() && !fs::is_directory(parent, ec)) {
      return absl::InvalidArgumentError(
          fmt::format("--timeline {}: its folder {} does not exist", timeline, parent.string()));
    }
    if (fs::exists(timeline, ec) && !fs::is_regular_file(timeline, ec))
      return absl::InvalidArgumentError(
          fmt::format("--timeline {} is not a regular file", timeline));
  }
  if (!o.export_dir.empty() && !o.export_options.overwrite && fs::is_directory(o.export_dir, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(o.export_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name == "config.json" ||
          (name.rfind("model", 0) == 0 && name.find(".safetensors") != std::string::npos)) {
        return absl::InvalidArgumentError(
            fmt::format("--export: directory {} already holds a model ({}): give another "
                        "directory, or --export-overwrite to replace it",
                        o.export_dir, e.path().string()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace offload_train
