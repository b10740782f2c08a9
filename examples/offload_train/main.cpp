// memascend-train: trains a GPT (the demo's, or a Hugging Face Llama: --config,
// --init-from) with its parameters, gradients and optimizer states offloaded to a
// MemAscend volume (or, --mode reference, in ordinary memory).
// `memascend-train --help` lists the options.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include <memascend/io_engine.h>
#include <memascend/memory_ledger.h>
#include <memascend/safetensors.h>
#include <memascend/system.h>

#include "blas.h"
#include "data.h"
#include "hf_config.h"
#include "trainer.h"
#include "util/json_writer.h"
#include "util/units.h"
#include "zero_backend.h"

namespace {

using offload_train::Mode;

constexpr const char* kUsage = R"(usage: memascend-train [options]
  --steps N          total steps (default 200; a resumed run continues to N; 0: only
                     --eval and --export)
  --seq N --batch N  tokens per sequence and sequences per step (64/8)
  --layers N --channels N --heads N   the demo's GPT (4/128/4)
  --vocab N          256: bytes (default); more: words of the corpus with byte fallback
  --config FILE      a Hugging Face config.json (model_type llama): that model, random weights
  --init-from DIR    a Hugging Face model directory (config.json, model.safetensors or
                     model.safetensors.index.json and its shards; F32, F16, BF16): its weights
  --export DIR       after the last step, the model as a Hugging Face directory
    --export-dtype F32|F16|BF16   (default: the imported weights', else the config's)
    --export-shard B  bytes per file, more files with an index (default 5000000000)
    --export-overwrite  replace a model already in DIR
  --tokens FILE      training data: raw little-endian uint32 token ids
  --eval FILE        token ids: mean next-token loss over windows of --seq + 1, after
                     the last step (with --steps 0: of the imported model)
  --checkpoint-activations  keep each block's input only (through the tensor store) and
                     recompute the block in the backward pass
  --matmul blas|exact  matrix products through OpenBLAS (default when built with it) or
                     the exact loops (the same bits at any --threads)
  --dtype fp16|bf16  working parameters and gradients (default fp16)
  --mode offload|reference   state on a volume (default) or in ordinary memory
  --volume PATH      volume file or block device (default: )" MEMASCEND_TRAIN_DEFAULT_VOLUME R"()
  --volume-size B    size of a file volume (default: what the run needs: the state, 256 MiB
                     in flight, the journal and a margin of 1/64)
  --force            format a device or file that holds other data, or start over on an
                     existing volume (losing what it holds); without it an existing
                     volume is refused: continue it with --resume
  --resume           continue from the volume's last committed step
  --host-budget B    pinned host bytes; Fx: F times the minimum; P%: P percent of the
                     training state (default: what the memory cgroup or MemAvailable
                     leaves, less an eighth and the run's own needs; printed with its
                     reason; unlocked with a warning when RLIMIT_MEMLOCK is below it)
  --window N         layers prefetched ahead (default 1)
  --optimizer-chunk N  elements per stored part of every tensor (default 1048576)
  --read-ahead B      optimizer state read ahead of the update (default: what the
                     budget leaves beyond the minimum and --keep)
  --keep B           optimizer state kept in memory across steps (default 0)
  --overlap-optimizer 0|1  run a step's update interleaved with the next step's forward
                     pass (default 1)
  --io-threads N     the store's prefetch threads, reads in flight (default 8)
  --write-behind 0|1 write new versions back as soon as they are released (default 1)
  --pool adaptive|pow2  the store's pinned pool: adaptive classes (default) or powers of
                     two as PyTorch's caching host allocator (an ablation)
  --overflow-check fused|temporaries  the gradients' inf/NaN check: one fused pass
                     (default), or PyTorch's isinf/isnan temporaries (an ablation)
  --storage volume|files  the state on a volume (default), or in a directory (--volume
                     names it) with a file per tensor as ZeRO-Infinity's (an ablation)
  --policy memascend|zero-infinity   the SDK (default), or ZeRO-Infinity's rules:
    --nvme-path DIR  swap directory, one file per tensor (default: <volume>.zero)
    --zero-param-buffers N (5) --zero-param-buffer-size ELEMS (1e8)
    --zero-optimizer-buffers N (4) --zero-sub-group-size ELEMS (1e9)
    --zero-queue-depth N (8) --zero-block BYTES (1M) --zero-min-swap BYTES (1M)
    --zero-max-in-cpu ELEMS (1e9) --zero-pin-optimizer 0|1 (0) --zero-reduce-bucket ELEMS (5e8)
    --zero-pipeline-read 0|1 (0) --zero-pipeline-write 0|1 (0)  (each needs 4 more buffers)
  --lr X --warmup N --clip X --weight-decay X --seed N --threads N
  --loss-scale X     initial dynamic loss scale (default 65536 for fp16, 1 for bf16)
  --data FILE        training text (default: /usr/share/common-licenses/*)
  --sample N         tokens generated at the end (default 120)
  --timeline FILE    CSV memory timeline (the ledger, sampled per layer)
  --json             one JSON summary object on stdout instead of the report
  --quiet            no progress lines
Under mpirun (a build with MPI), each rank trains on its rows of the global --batch
and offloads its shard of the state to its own volume: --volume may hold {rank}, and
must when ranks share a host. Rank 0 reports (--json: every rank's figures inside).
--resume continues from the newest step every rank holds (docs/distributed.md).
Byte sizes are whole numbers with an optional K, M, G or T suffix (powers of 1024).
)";

// The one byte-size grammar of every MemAscend binary (util/units.h): an integer with an
// optional K, M, G or T suffix (powers of 1024), "iB" or "B" allowed after it.
bool ParseBytes(const std::string& s, std::uint64_t* out) {
  auto v = memascend::util::ParseByteSize(s);
  if (!v.ok()) return false;
  *out = *v;
  return true;
}

std::string Gib(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", bytes / (1 << 30));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  return fmt::format("{:.1f} KiB", bytes / 1024);
}

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

// fn(tier, use, peak reserved bytes) for every tier and use the run touched.
template <typename F>
void ForEachLedgerPeak(const memascend::LedgerSnapshot& ledger, F&& fn) {
  for (int t = 0; t < memascend::kTierCount; ++t) {
    for (int u = 0; u < memascend::kUseCount; ++u) {
      const auto& c = ledger.uses[static_cast<std::size_t>(t)][static_cast<std::size_t>(u)];
      if (c.reserved_peak != 0) {
        fn(memascend::ToString(static_cast<memascend::Tier>(t)),
           memascend::ToString(static_cast<memascend::Use>(u)), c.reserved_peak);
      }
    }
  }
}

// Under mpirun (Note [data parallel] in trainer.h): MPI_COMM_WORLD; null for one process.
std::unique_ptr<offload_train::Communicator> g_comm;

bool Root() { return g_comm == nullptr || g_comm->rank() == 0; }

// The error, named by rank under mpirun; there, every rank then stops (no rank waits in a
// collective for this one).
int Fail(const std::string& message) {
  if (g_comm != nullptr) {
    std::fprintf(stderr, "memascend-train: rank %d of %d: %s\n", g_comm->rank(), g_comm->size(),
                 message.c_str());
    std::fflush(stderr);
    g_comm->Abort(1);
  }
  std::fprintf(stderr, "memascend-train: %s\n", message.c_str());
  return 1;
}

int Main(int argc, char** argv);

}  // namespace

// No input ends in an uncaught exception: an allocation the machine cannot satisfy (a
// model or batch too large) is reported like any other error.
int main(int argc, char** argv) {
  if (offload_train::LaunchedAsMpiRanks()) {
    auto comm = offload_train::MakeMpiCommunicator(&argc, &argv);
    if (!comm.ok()) return Fail(std::string(comm.status().message()));
    g_comm = std::move(*comm);
  }
  try {
    const int rc = Main(argc, argv);
    g_comm.reset();  // MPI_Finalize
    return rc;
  } catch (const std::bad_alloc&) {
    return Fail("out of memory: the model, batch or budget is too large for this machine");
  } catch (const std::exception& e) {
    return Fail(fmt::format("internal error: {}", e.what()));
  }
}

namespace {

int Main(int argc, char** argv) {
  offload_train::TrainOptions o;
  o.volume_path = MEMASCEND_TRAIN_DEFAULT_VOLUME;
  o.sample_tokens = 120;
  std::string data_path, timeline_path, config_path, tokens_path, eval_path, export_dtype;
  std::string matmul = offload_train::blas::Available() ? "blas" : "exact";
  bool json = false, quiet = false, scale_given = false;
  // --host-budget Fx or P%: a factor of the minimum or of the training state, applied
  // once the model is known.
  double budget_factor = 0;
  bool budget_of_state = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    std::string v;
    std::string why;  // what a bad value should have been
    auto number = [&](auto* out) {
      if (!value(&v)) return false;
      return ParseNumber(v, out, &why);
    };
    bool ok = true;
    std::uint64_t bytes = 0;
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--steps")
      ok = number(&o.steps);
    else if (a == "--layers")
      ok = number(&o.model.layers);
    else if (a == "--channels")
      ok = number(&o.model.channels);
    else if (a == "--heads")
      ok = number(&o.model.heads);
    else if (a == "--seq")
      ok = number(&o.model.seq);
    else if (a == "--batch")
      ok = number(&o.model.batch);
    else if (a == "--vocab")
      ok = number(&o.model.vocab);
    else if (a == "--lr")
      ok = number(&o.lr);
    else if (a == "--warmup")
      ok = number(&o.warmup);
    else if (a == "--clip")
      ok = number(&o.clip);
    else if (a == "--weight-decay")
      ok = number(&o.weight_decay);
    else if (a == "--seed")
      ok = number(&o.seed);
    else if (a == "--loss-scale")
      ok = number(&o.initial_loss_scale), scale_given = true;
    else if (a == "--threads")
      ok = number(&o.threads);
    else if (a == "--window")
      ok = number(&o.window);
    else if (a == "--read-ahead") {
      ok = value(&v) && ParseBytes(v, &bytes);
      o.read_ahead_bytes = bytes;
    } else if (a == "--keep") {
      ok = value(&v) && ParseBytes(v, &bytes);
      o.keep_bytes = bytes;
    } else if (a == "--overlap-optimizer")
      ok = number(&o.overlap_optimizer);
    else if (a == "--io-threads")
      ok = number(&o.io_threads);
    else if (a == "--write-behind")
      ok = number(&o.write_behind);
    else if (a == "--optimizer-chunk")
      ok = number(&o.optimizer_chunk);
    else if (a == "--zero-param-buffers")
      ok = number(&o.zero.param_buffer_count);
    else if (a == "--zero-param-buffer-size")
      ok = number(&o.zero.param_buffer_size);
    else if (a == "--zero-optimizer-buffers")
      ok = number(&o.zero.optimizer_buffer_count);
    else if (a == "--zero-sub-group-size")
      ok = number(&o.zero.sub_group_size);
    else if (a == "--zero-queue-depth")
      ok = number(&o.zero.aio_queue_depth);
    else if (a == "--zero-block") {
      ok = value(&v) && ParseBytes(v, &bytes) && bytes >= 4096 && bytes % 4096 == 0 &&
           bytes <= (1u << 30);
      why = "a multiple of 4096 bytes (O_DIRECT) up to 1G";
      o.zero.aio_block_bytes = bytes;
    } else if (a == "--zero-max-in-cpu")
      ok = number(&o.zero.max_in_cpu);
    else if (a == "--zero-pin-optimizer")
      ok = number(&o.zero.optimizer_pin_memory);
    else if (a == "--zero-pipeline-read")
      ok = number(&o.zero.pipeline_read);
    else if (a == "--zero-pipeline-write")
      ok = number(&o.zero.pipeline_write);
    else if (a == "--zero-reduce-bucket")
      ok = number(&o.zero.reduce_bucket_size);
    else if (a == "--nvme-path")
      ok = value(&o.zero.nvme_path);
    else if (a == "--zero-min-swap") {
      ok = value(&v) && ParseBytes(v, &bytes);
      o.zero.min_swap_bytes = bytes;
    } else if (a == "--pool") {
      ok = value(&v) && (v == "adaptive" || v == "pow2");
      why = "adaptive or pow2";
      o.pow2_pool = v == "pow2";
    } else if (a == "--storage") {
      ok = value(&v) && (v == "volume" || v == "files");
      why = "volume or files";
      o.file_per_tensor = v == "files";
    } else if (a == "--overflow-check") {
      ok = value(&v) && (v == "fused" || v == "temporaries");
      why = "fused or temporaries";
      o.unfused_overflow_check = v == "temporaries";
    } else if (a == "--policy") {
      ok = value(&v) && (v == "memascend" || v == "zero-infinity");
      o.policy = v == "zero-infinity" ? offload_train::Policy::kZeroInfinity
                                      : offload_train::Policy::kMemAscend;
    } else if (a == "--sample")
      ok = number(&o.sample_tokens);
    else if (a == "--volume")
      ok = value(&o.volume_path);
    else if (a == "--data")
      ok = value(&data_path);
    else if (a == "--config")
      ok = value(&config_path);
    else if (a == "--init-from")
      ok = value(&o.init_from);
    else if (a == "--export")
      ok = value(&o.export_dir);
    else if (a == "--export-dtype") {
      ok = value(&v) && (v == "F32" || v == "F16" || v == "BF16");
      export_dtype = v;
      why = "F32, F16 or BF16";
    } else if (a == "--export-shard") {
      ok = value(&v) && ParseBytes(v, &bytes) && bytes > 0;
      o.export_options.shard_bytes = bytes;
    } else if (a == "--export-overwrite")
      o.export_options.overwrite = true;
    else if (a == "--tokens")
      ok = value(&tokens_path);
    else if (a == "--eval")
      ok = value(&eval_path);
    else if (a == "--checkpoint-activations")
      o.checkpoint_activations = true;
    else if (a == "--matmul") {
      ok = value(&v) && (v == "blas" || v == "exact");
      matmul = v;
      why = "blas or exact";
    } else if (a == "--timeline")
      ok = value(&timeline_path);
    else if (a == "--force")
      o.force = true;
    else if (a == "--resume")
      o.resume = true;
    else if (a == "--json")
      json = true;
    else if (a == "--quiet")
      quiet = true;
    else if (a == "--host-budget") {
      ok = value(&v);
      if (ok && !v.empty() && v.back() == 'x') {  // a multiple of the minimum
        ok = ParseNumber(v.substr(0, v.size() - 1), &budget_factor, &why) && budget_factor >= 1.0;
        why = "Fx with F a factor >= 1 of the minimum, P% with 0 < P <= 100, or bytes";
      } else if (ok && !v.empty() && v.back() == '%') {  // a share of the training state
        ok = ParseNumber(v.substr(0, v.size() - 1), &budget_factor, &why);
        budget_factor /= 100;
        budget_of_state = true;
        ok = ok && budget_factor > 0 && budget_factor <= 1;
        why = "Fx with F a factor >= 1 of the minimum, P% with 0 < P <= 100, or bytes";
      } else {
        ok = ok && ParseBytes(v, &bytes) && bytes > 0;
        o.host_budget = bytes;
      }
    } else if (a == "--volume-size") {
      ok = value(&v) && ParseBytes(v, &bytes);
      o.volume_bytes = bytes;
    } else if (a == "--dtype") {
      ok = value(&v) && (v == "fp16" || v == "bf16");
      o.dtype = v == "bf16" ? memascend::DType::kBF16 : memascend::DType::kF16;
    } else if (a == "--mode") {
      ok = value(&v) && (v == "offload" || v == "reference");
      o.mode = v == "reference" ? Mode::kReference : Mode::kOffload;
    } else {
      return Fail(fmt::format("unknown option '{}' (see --help)", a));
    }
    if (!ok) {
      if (!why.empty()) return Fail(fmt::format("{}: '{}' is not {} (see --help)", a, v, why));
      return Fail(fmt::format("{}: missing or bad value (see --help)", a));
    }
  }
  if (o.volume_path == MEMASCEND_TRAIN_DEFAULT_VOLUME &&
      !std::filesystem::is_directory(std::filesystem::path(o.volume_path).parent_path())) {
    o.volume_path = "memascend-train.vol";  // an installed binary away from its build tree
  }
  o.blas = matmul == "blas";
  // A Hugging Face model: its config (the import's, or --config's) gives the sizes.
  if (!config_path.empty() && !o.init_from.empty())
    return Fail("--config and --init-from: give one (the directory holds its config.json)");
  if (!o.init_from.empty()) config_path = o.init_from + "/config.json";
  if (!config_path.empty()) {
    auto hf = offload_train::ReadHfConfig(config_path);
    if (!hf.ok()) return Fail(std::string(hf.status().message()));
    o.model = offload_train::ForHf(*hf, o.model.batch, o.model.seq);
    // The export's dtype: the imported weights' (their embeddings'), else the config's.
    if (export_dtype.empty() && !o.init_from.empty() && !o.export_dir.empty()) {
      auto ckpt = memascend::SafetensorsCheckpoint::Open(o.init_from);
      if (!ckpt.ok()) return Fail(std::string(ckpt.status().message()));
      auto dtype = offload_train::HfGroupDType(**ckpt, o.model, 0);
      if (!dtype.ok()) return Fail(std::string(dtype.status().message()));
      export_dtype = memascend::SafetensorsName(*dtype);
    }
    if (export_dtype.empty()) {
      export_dtype = hf->torch_dtype == "bfloat16"  ? "BF16"
                     : hf->torch_dtype == "float16" ? "F16"
                                                    : "F32";
    }
    o.export_options.dtype = export_dtype;
  } else if (!o.export_dir.empty()) {
    return Fail("--export: only a Hugging Face model (--config or --init-from) exports");
  }
  // Sizes are checked before anything is built from them (the tokenizer, the model).
  if (absl::Status s = offload_train::Validate(o.model); !s.ok())
    return Fail(std::string(s.message()));
  if (o.sample_tokens > 100000)
    return Fail(fmt::format("--sample {}: at most 100000 tokens", o.sample_tokens));
  // A command never writes its output over its own input: the timeline is not the volume
  // or the training text, and the volume is not the training text.
  {
    namespace fs = std::filesystem;
    std::error_code ec;
    const auto same = [&](const std::string& a, const std::string& b) {
      return !a.empty() && !b.empty() && fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
    };
    if (same(timeline_path, o.volume_path) || same(timeline_path, data_path))
      return Fail(fmt::format("--timeline {} is the volume or the training text: give another file",
                              timeline_path));
    if (same(timeline_path, tokens_path) || same(timeline_path, eval_path))
      return Fail(
          fmt::format("--timeline {} is a token file of this run (--tokens or --eval): "
                      "give another file",
                      timeline_path));
    for (const std::string* input : {&data_path, &tokens_path, &eval_path}) {
      if (same(o.volume_path, *input)) {
        return Fail(fmt::format("--volume {} is the training or evaluation data: give another file",
                                o.volume_path));
      }
    }
    // Nothing is written into the checkpoint being imported: neither the timeline nor the
    // volume (which --force would format) may be a file of --init-from's directory.
    if (!o.init_from.empty()) {
      for (const auto& [flag, path] :
           {std::pair{"--timeline", &timeline_path}, std::pair{"--volume", &o.volume_path}}) {
        if (!path->empty() && fs::exists(*path, ec) &&
            same(fs::path(*path).parent_path().string().empty()
                     ? std::string(".")
                     : fs::path(*path).parent_path().string(),
                 o.init_from)) {
          return Fail(
              fmt::format("{} {} is a file of the checkpoint --init-from {} imports: give "
                          "another file",
                          flag, *path, o.init_from));
        }
      }
    }
    // Every output's place checked before the first step, not after the last.
    if (!timeline_path.empty()) {
      const fs::path parent = fs::path(timeline_path).parent_path();
      if (!parent.empty() && !fs::is_directory(parent, ec)) {
        return Fail(fmt::format("--timeline {}: its folder {} does not exist", timeline_path,
                                parent.string()));
      }
      if (fs::exists(timeline_path, ec) && !fs::is_regular_file(timeline_path, ec))
        return Fail(fmt::format("--timeline {} is not a regular file", timeline_path));
    }
    if (!o.export_dir.empty() && !o.export_options.overwrite &&
        fs::is_directory(o.export_dir, ec)) {
      for (const fs::directory_entry& e : fs::directory_iterator(o.export_dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name == "config.json" ||
            (name.rfind("model", 0) == 0 && name.find(".safetensors") != std::string::npos)) {
          return Fail(
              fmt::format("--export: directory {} already holds a model ({}): give another "
                          "directory, or --export-overwrite to replace it",
                          o.export_dir, e.path().string()));
        }
      }
    }
  }
  if (budget_factor > 0) {
    const std::uint64_t base =
        budget_of_state ? offload_train::ModelStateBytes(o.model, o.dtype)
                        : offload_train::MinimumHostBudget(o.model, o.dtype, o.optimizer_chunk);
    o.host_budget =
        static_cast<std::size_t>(budget_factor * static_cast<double>(base)) / 4096 * 4096;
  }
  if (o.dtype == memascend::DType::kBF16 && !scale_given) o.initial_loss_scale = 1.0f;

  // The data: token ids (--tokens), or a text and the tokenizer built from it.
  std::optional<offload_train::Tokenizer> tokenizer;
  std::vector<std::int32_t> tokens;
  if (!tokens_path.empty()) {
    if (!data_path.empty()) return Fail("--tokens and --data: give one");
    auto ids = offload_train::ReadTokenFile(tokens_path, o.model.vocab);
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    tokens = std::move(*ids);
  } else {
    if (o.model.hf.has_value()) {
      return Fail(
          "a Hugging Face model trains on token ids from its own tokenizer: give --tokens FILE");
    }
    auto corpus = data_path.empty() ? offload_train::ReadLicenceCorpus()
                                    : offload_train::ReadTextFile(data_path);
    if (!corpus.ok()) return Fail(std::string(corpus.status().message()));
    auto built = offload_train::Tokenizer::Build(*corpus, o.model.vocab);
    if (!built.ok()) return Fail(std::string(built.status().message()));
    tokenizer = std::move(*built);
    tokens = tokenizer->Encode(*corpus);
  }
  if (!eval_path.empty()) {
    auto ids = offload_train::ReadTokenFile(eval_path, o.model.vocab);
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    o.eval_tokens = std::make_shared<const std::vector<std::int32_t>>(std::move(*ids));
  }

  memascend::MemoryLedger ledger;
  o.ledger = &ledger;
  o.comm = g_comm.get();
  const int world = g_comm != nullptr ? g_comm->size() : 1;
  const std::uint64_t state = offload_train::ModelStateBytes(o.model, o.dtype);
  // The pinned host budget: given, or chosen from what the machine leaves (memascend
  // Note [default host budget]); chosen here to be printed, and used by Train() as is.
  const bool memascend_offload =
      o.mode == Mode::kOffload && o.policy == offload_train::Policy::kMemAscend;
  if (memascend_offload && o.optimizer_chunk != 0 &&
      o.optimizer_chunk % offload_train::kOptimizerChunkQuantum == 0) {
    auto chosen =
        offload_train::ChooseTrainHostBudget(o, world, g_comm != nullptr ? g_comm->rank() : 0);
    if (!chosen.ok()) return Fail(std::string(chosen.status().message()));
    o.host_budget_choice = *chosen;
    // One warning per run (rank 0's): the memlock limit and what to raise.
    if (!chosen->warning.empty() && Root()) std::fprintf(stderr, "%s\n", chosen->warning.c_str());
  }
  if (!json && Root()) {
    const std::size_t budget = o.host_budget_choice ? o.host_budget_choice->bytes : o.host_budget;
    fmt::print(
        "memascend-train: {} {} layers x {} channels, {} heads, vocab {}, {:.2f} M parameters{}; "
        "{} tokens of {}\n",
        offload_train::ArchName(o.model), o.model.layers, o.model.channels, o.model.heads,
        o.model.vocab, static_cast<double>(offload_train::TotalParams(o.model)) / 1e6,
        o.init_from.empty() ? "" : fmt::format(" from {}", o.init_from), tokens.size(),
        tokenizer ? "text" : "token ids");
    if (o.mode == Mode::kOffload && o.policy == offload_train::Policy::kZeroInfinity) {
      fmt::print(
          "  training state {} offloaded under ZeRO-Infinity's rules to {}/zero_stage_3 "
          "({} pinned for swap buffers and gradients)\n",
          Gib(static_cast<double>(state)),
          o.zero.nvme_path.empty() ? o.volume_path + ".zero" : o.zero.nvme_path,
          Gib(static_cast<double>(offload_train::ZeroPinnedBytes(o))));
    } else if (o.mode == Mode::kOffload && world > 1) {
      fmt::print(
          "  data-parallel over {} ranks (MPI): {} sequences per rank of the global batch of {}; "
          "each rank offloads its shard of the {} training state to {} through a pinned host "
          "budget of {}\n",
          world, o.model.batch / static_cast<std::size_t>(world), o.model.batch,
          Gib(static_cast<double>(state)), o.volume_path, Gib(static_cast<double>(budget)));
    } else if (o.mode == Mode::kOffload) {
      fmt::print(
          "  training state {} offloaded to {} through a pinned host budget of {} ({:.0f}%)\n",
          Gib(static_cast<double>(state)), o.volume_path, Gib(static_cast<double>(budget)),
          100.0 * static_cast<double>(budget) / static_cast<double>(state));
    } else {
      fmt::print("  reference mode: training state {} in ordinary memory\n",
                 Gib(static_cast<double>(state)));
    }
    if (o.host_budget_choice.has_value()) {
      fmt::print("  host budget {}{}: {}\n", Gib(static_cast<double>(o.host_budget_choice->bytes)),
                 o.host_budget_choice->locked ? "" : " (unlocked)", o.host_budget_choice->reason);
    }
    std::fflush(stdout);
  }
  if (!Root()) {
    // Rank 0 reports; the others print only their errors.
  } else if (!quiet && !json) {
    o.on_step = [](const offload_train::StepReport& r) {
      fmt::print(
          "step {:4}/{} | loss {:.4f} | scale {:g}{} | {:7.0f} tok/s | io {:.3f} GiB/s | "
          "pinned {}\n",
          r.step, r.steps, r.loss, r.loss_scale, r.skipped ? " (skipped: overflow)" : "",
          r.tokens_per_second, r.io_gib_per_second, Gib(static_cast<double>(r.pinned_bytes)));
      std::fflush(stdout);
    };
  } else if (json) {
    o.on_step = [](const offload_train::StepReport& r) {  // progress for a watching test
      std::fprintf(stderr, "step %zu loss %.6f\n", r.step, r.loss);
    };
  }
  auto summary =
      tokenizer ? offload_train::Train(o, tokens, *tokenizer) : offload_train::Train(o, tokens);
  if (!summary.ok()) return Fail(std::string(summary.status().message()));
  if (!Root()) return 0;
  if (!timeline_path.empty()) {
    if (absl::Status s = ledger.WriteCsv(timeline_path); !s.ok())
      return Fail(std::string(s.message()));
  }
  const auto& s = *summary;
  if (o.mode == Mode::kOffload && o.policy == offload_train::Policy::kMemAscend &&
      o.host_budget != 0 && s.host_budget < o.host_budget) {
    std::fprintf(stderr,
                 "memascend-train: --host-budget %s is more than the %s the training state can "
                 "ever hold in memory: capped to it\n",
                 Gib(static_cast<double>(o.host_budget)).c_str(),
                 Gib(static_cast<double>(s.host_budget)).c_str());
  }
  if (json) {
    memascend::util::JsonWriter w;
    w.BeginObject()
        .Field("policy",
               o.policy == offload_train::Policy::kZeroInfinity ? "zero-infinity" : "memascend")
        .Field("mode", o.mode == Mode::kOffload ? "offload" : "reference")
        .Field("steps", s.last_step)
        .Field("first_step", s.first_step)
        .Field("final_loss", s.final_loss);
    {
      // The I/O engine's backend, as the volume's automatic choice made it, and why.
      memascend::ProbeOptions probe = memascend::ProbeOptions::FromEnvironment();
      probe.disable_cuda = true;
      const memascend::IoBackendDecision io = memascend::DecideIoBackend(
          memascend::IoBackendChoice::kAuto, memascend::ProbeSystem(probe));
      w.Field("io_backend", memascend::ToString(io.backend)).Field("io_backend_reason", io.reason);
    }
    w.Key("losses").BeginArray();
    for (double l : s.losses) w.Double(l);
    w.EndArray().Key("step_seconds").BeginArray();
    for (double t : s.step_seconds) w.Double(t);
    w.EndArray().Key("step_skipped").BeginArray();
    for (bool k : s.step_skipped) w.Bool(k);
    w.EndArray().Key("step_io_bytes").BeginArray();
    for (std::uint64_t b : s.step_io_bytes) w.Uint(b);
    w.EndArray().Field("world", s.world);
    if (s.world > 1) {
      w.Key("step_comm_bytes").BeginArray();
      for (std::uint64_t b : s.step_comm_bytes) w.Uint(b);
      w.EndArray().Key("ranks").BeginArray();
      for (const auto& r : s.ranks) {
        w.BeginObject()
            .Field("peak_rss_bytes", r.peak_rss_bytes)
            .Field("peak_pinned_bytes", r.peak_pinned_bytes)
            .Field("mean_step_seconds", r.mean_step_seconds)
            .Field("comm_bytes_per_step", r.comm_bytes_per_step)
            .Field("io_bytes_per_step", r.io_bytes_per_step)
            .Field("state_elements", r.state_elements)
            .EndObject();
      }
      w.EndArray();
    }
    w.Field("params", s.params)
        .Field("model_state_bytes", s.model_state_bytes)
        .Field("host_budget_bytes", s.host_budget)
        .Field("host_budget_default", o.host_budget_choice && !o.host_budget_choice->given)
        .Field("host_budget_locked", !o.host_budget_choice || o.host_budget_choice->locked)
        .Field("host_budget_reason", o.host_budget_choice ? o.host_budget_choice->reason : "")
        .Field("peak_pinned_bytes", s.peak_pinned_bytes)
        .Field("peak_rss_bytes", s.peak_rss_bytes)
        .Field("activation_bytes", s.activation_bytes)
        .Field("io_read_bytes", s.io_read_bytes)
        .Field("io_write_bytes", s.io_write_bytes)
        .Field("skipped_steps", s.skipped_steps)
        .Field("seconds", s.seconds);
    w.Key("phase_seconds")
        .BeginObject()
        .Field("forward", s.phases.forward)
        .Field("backward", s.phases.backward)
        .Field("optimizer", s.phases.optimizer)
        .Field("commit", s.phases.commit)
        .EndObject();
    w.Key("ledger").BeginArray();
    ForEachLedgerPeak(s.ledger, [&w](std::string_view tier, std::string_view use,
                                     std::int64_t peak) {
      w.BeginObject().Field("tier", tier).Field("use", use).Field("peak_bytes", peak).EndObject();
    });
    w.EndArray().Key("store");
    if (s.store.has_value()) {
      const memascend::TensorStoreStats& t = *s.store;
      w.BeginObject()
          .Field("prefetch_hits", t.prefetch_hits)
          .Field("prefetch_misses", t.prefetch_misses)
          .Field("prefetch_dropped", t.prefetch_dropped)
          .Field("prefetch_deferred", t.prefetch_deferred)
          .Field("stall_seconds", t.stall_seconds)
          .Field("read_seconds", t.read_seconds)
          .Field("write_seconds", t.write_seconds)
          .Field("evictions", t.evictions)
          .Field("write_backs", t.write_backs)
          .EndObject();
    } else {
      w.Null();
    }
    w.Field("model", offload_train::ArchName(o.model)).Field("matmul", matmul);
    w.Field("checkpoint_activations", o.checkpoint_activations);
    if (s.eval_loss.has_value()) {
      w.Field("eval_loss", *s.eval_loss).Field("eval_tokens", s.eval_tokens);
    }
    if (!o.export_dir.empty())
      w.Field("export_dir", o.export_dir).Field("export_bytes", s.export_bytes);
    w.Field("sample", s.sample).EndObject();
    fmt::print("{}\n", w.str());
    return 0;
  }
  fmt::print(
      "\ndone: steps {}..{} in {:.1f} s, final loss {:.4f} (ln vocab = {:.2f}), {} skipped\n",
      s.first_step, s.last_step, s.seconds, s.final_loss,
      std::log(static_cast<double>(o.model.vocab)), s.skipped_steps);
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& f = s.ranks[r];
    fmt::print(
        "  rank {}: {:.2f} M elements of state, peak RSS {}, pinned peak {}, {:.2f} s/step, sent "
        "{}/step, volume I/O {}/step\n",
        r, static_cast<double>(f.state_elements) / 1e6, Gib(static_cast<double>(f.peak_rss_bytes)),
        Gib(static_cast<double>(f.peak_pinned_bytes)), f.mean_step_seconds,
        Gib(f.comm_bytes_per_step), Gib(f.io_bytes_per_step));
  }
  fmt::print("  training state {}, pinned host peak {} (budget {}), peak RSS {}\n",
             Gib(static_cast<double>(s.model_state_bytes)),
             Gib(static_cast<double>(s.peak_pinned_bytes)), Gib(static_cast<double>(s.host_budget)),
             Gib(static_cast<double>(s.peak_rss_bytes)));
  fmt::print("  volume I/O: {} read, {} written; activations {} (ordinary memory)\n",
             Gib(static_cast<double>(s.io_read_bytes)), Gib(static_cast<double>(s.io_write_bytes)),
             Gib(static_cast<double>(s.activation_bytes)));
  if (s.store.has_value()) {
    const memascend::TensorStoreStats& t = *s.store;
    const std::uint64_t uses = t.prefetch_hits + t.prefetch_misses;
    fmt::print(
        "  tensor store: {} of {} uses found their tensor read ahead ({} prefetches waited for "
        "room); waited {:.2f} s for tensors\n",
        t.prefetch_hits, uses, t.prefetch_deferred + t.prefetch_dropped, t.stall_seconds);
  }
  fmt::print("  ledger peaks by tier and use:\n");
  ForEachLedgerPeak(s.ledger, [](std::string_view tier, std::string_view use, std::int64_t peak) {
    fmt::print("    {:<12} {:<16} {}\n", tier, use, Gib(static_cast<double>(peak)));
  });
  if (s.eval_loss.has_value()) {
    fmt::print("  eval: mean next-token loss {:.4f} over {} positions\n", *s.eval_loss,
               s.eval_tokens);
  }
  if (!o.export_dir.empty()) {
    fmt::print("  exported to {} ({}, {})\n", o.export_dir,
               Gib(static_cast<double>(s.export_bytes)), o.export_options.dtype);
  }
  if (!s.sample.empty()) fmt::print("\nsample:\n{}\n", s.sample);
  return 0;
}

}  // namespace
