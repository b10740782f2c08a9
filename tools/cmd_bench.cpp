// memascend bench io | tune: direct-I/O throughput of a target (file or block device).
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "args.h"
#include "commands.h"
#include "io_bench.h"
#include "kernel_bench.h"
#include "store_bench.h"
#include "util/json_writer.h"
#include "util/units.h"

namespace memascend::cli {
namespace {

constexpr std::string_view kIoSummary =
    "sequential direct I/O over a target: throughput of the MemAscend I/O engine";
constexpr OptionSpec kIoOptions[] = {
    {"target", true, "file or block device (a file is created and preallocated)"},
    {"rw", true, "read | write (default read)"},
    {"block", true, "bytes per request (default 1M)"},
    {"qd", true, "requests in flight (default 32)"},
    {"size", true, "bytes to move (default: the target's size)"},
    {"backend", true, "uring | threads (default: what the probe picks)"},
    {"destroy-data", false,
     "write over a target that holds data, a file system or a volume (never a locked one)"},
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

constexpr std::string_view kTuneSummary =
    "sweep block size and queue depth for reads and writes; print the best settings";
constexpr OptionSpec kTuneOptions[] = {
    {"target", true, "file or block device"},
    {"size", true, "bytes per measurement (default 1G, or the target's size)"},
    {"backend", true, "uring | threads"},
    {"destroy-data", false,
     "write over a target that holds data, a file system or a volume (never a locked one)"},
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

constexpr std::string_view kKernelsSummary =
    "fused overflow check and Adam vs unfused baselines and memory-bandwidth ceilings";
constexpr OptionSpec kKernelsOptions[] = {
    {"elements", true, "elements per tensor (default 64M)"},
    {"device", true, "cpu (default) or cuda: the CUDA kernels on device 0, in device memory"},
    {"threads", true, "CPU threads (default: all online CPUs)"},
    {"reps", true, "repetitions; the best is reported (default 5)"},
    {"part-elements", true,
     "elements per call of the per-part Adam row (default 1M: memascend.torch's parts)"},
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

absl::StatusOr<IoBackendChoice> ParseBackend(const Args& args) {
  const std::string b = args.Get("backend", "auto");
  if (b == "auto") return IoBackendChoice::kAuto;
  if (b == "uring" || b == "io_uring") return IoBackendChoice::kIoUring;
  if (b == "threads") return IoBackendChoice::kThreadPool;
  return absl::InvalidArgumentError(fmt::format("--backend must be uring or threads, not '{}'", b));
}

void WriteResult(util::JsonWriter& w, const IoBenchConfig& c, const IoBenchResult& r) {
  w.Field("rw", ToString(c.op));
  w.Field("block", c.block);
  w.Field("qd", c.queue_depth);
  w.Field("bytes", r.bytes);
  w.Field("seconds", r.seconds);
  w.Field("gib_per_s", r.gib_per_s());
  w.Field("iops", r.iops());
  w.Field("backend", ToString(r.backend));
}

int Fail(std::string_view command, const absl::Status& s, bool usage) {
  fmt::print(stderr, "memascend bench {}: {}\n", command, Message(s));
  return usage ? kExitUsage : kExitFailure;
}

int RunIo(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kIoOptions);
  if (!args.ok()) return Fail("io", args.status(), true);
  if (args->Has("help") || !args->Has("target")) {
    fmt::print(args->Has("help") ? stdout : stderr, "{}",
               Usage("bench io", kIoSummary, kIoOptions));
    return args->Has("help") ? kExitOk : kExitUsage;
  }
  IoBenchConfig c;
  c.target = args->Get("target");
  const std::string rw = args->Get("rw", "read");
  if (rw != "read" && rw != "write")
    return Fail("io", absl::InvalidArgumentError("--rw must be read or write"), true);
  c.op = rw == "read" ? IoOp::kRead : IoOp::kWrite;
  auto block = args->GetBytes("block", 1 << 20);
  auto qd = args->GetInt("qd", 32);
  auto size = args->GetBytes("size", 0);
  auto backend = ParseBackend(*args);
  for (const absl::Status& s : {block.status(), qd.status(), size.status(), backend.status()}) {
    if (!s.ok()) return Fail("io", s, true);
  }
  if (*qd < 1 || *qd > 1024)
    return Fail("io", absl::InvalidArgumentError("--qd must be in 1..1024"), true);
  c.block = *block;
  c.queue_depth = static_cast<unsigned>(*qd);
  c.size = *size;
  c.backend = *backend;
  c.destroy = args->Has("destroy-data");
  auto r = RunIoBench(c);
  if (!r.ok())
    return Fail("io", r.status(), r.status().code() == absl::StatusCode::kInvalidArgument);
  if (args->Has("json")) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("target", c.target);
    WriteResult(w, c, *r);
    w.EndObject();
    fmt::print("{}\n", w.str());
  } else {
    fmt::print("{} {} in {:.3f} s: {:.3f} GiB/s, {:.0f} IOPS ({}, block {}, qd {}){}\n", rw,
               util::FormatBytes(r->bytes), r->seconds, r->gib_per_s(), r->iops(),
               ToString(r->backend), util::FormatBytes(c.block), c.queue_depth,
               r->filled ? "; the file was written first" : "");
  }
  return kExitOk;
}

int RunTune(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kTuneOptions);
  if (!args.ok()) return Fail("tune", args.status(), true);
  if (args->Has("help") || !args->Has("target")) {
    fmt::print(args->Has("help") ? stdout : stderr, "{}",
               Usage("bench tune", kTuneSummary, kTuneOptions));
    return args->Has("help") ? kExitOk : kExitUsage;
  }
  auto size = args->GetBytes("size", std::uint64_t{1} << 30);
  auto backend = ParseBackend(*args);
  if (!size.ok()) return Fail("tune", size.status(), true);
  if (!backend.ok()) return Fail("tune", backend.status(), true);
  // Every measurement moves --size bytes in blocks of up to kTuneLargestBlock: a smaller
  // size is refused before the first sweep, not after two of them.
  constexpr std::uint64_t kTuneLargestBlock = std::uint64_t{8} << 20;
  if (*size < kTuneLargestBlock) {
    return Fail("tune",
                absl::InvalidArgumentError(fmt::format(
                    "--size {} is smaller than the sweep's largest block (8M): give --size 8M "
                    "or more",
                    *size)),
                true);
  }
  const bool json = args->Has("json");
  util::JsonWriter w;
  w.BeginObject();
  w.Field("target", args->Get("target"));
  w.Key("runs").BeginArray();
  if (!json) fmt::print("{:<6} {:>8} {:>5} {:>10} {:>10}\n", "rw", "block", "qd", "GiB/s", "IOPS");
  struct Best {
    IoBenchConfig config;
    double gib = 0;
  };
  Best best[2];
  // Writes first: they lay the file out for the reads.
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    for (std::size_t block : {std::size_t{128} << 10, std::size_t{1} << 20,
                              static_cast<std::size_t>(kTuneLargestBlock)}) {
      for (unsigned qd : {8u, 32u, 128u}) {
        IoBenchConfig c{args->Get("target"),      op, block, qd, *size, *backend,
                        args->Has("destroy-data")};
        auto r = RunIoBench(c);
        if (!r.ok()) return Fail("tune", r.status(), false);
        w.BeginObject();
        WriteResult(w, c, *r);
        w.EndObject();
        if (!json) {
          fmt::print("{:<6} {:>8} {:>5} {:>10.3f} {:>10.0f}\n", ToString(op),
                     util::FormatBytes(block), qd, r->gib_per_s(), r->iops());
        }
        Best& b = best[op == IoOp::kRead ? 0 : 1];
        if (r->gib_per_s() > b.gib) b = {c, r->gib_per_s()};
      }
    }
  }
  w.EndArray();
  for (int i = 0; i < 2; ++i) {
    const Best& b = best[i];
    const char* name = i == 0 ? "best_read" : "best_write";
    w.Key(name).BeginObject();
    w.Field("block", b.config.block);
    w.Field("qd", b.config.queue_depth);
    w.Field("gib_per_s", b.gib);
    w.EndObject();
    if (!json) {
      fmt::print("{}: block {} qd {} -> {:.3f} GiB/s\n", name, util::FormatBytes(b.config.block),
                 b.config.queue_depth, b.gib);
    }
  }
  w.EndObject();
  if (json) fmt::print("{}\n", w.str());
  return kExitOk;
}

int RunKernels(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kKernelsOptions);
  if (!args.ok()) return Fail("kernels", args.status(), true);
  if (args->Has("help")) {
    fmt::print("{}", Usage("bench kernels", kKernelsSummary, kKernelsOptions));
    return kExitOk;
  }
  auto elements = args->GetBytes("elements", std::uint64_t{1} << 26);
  auto threads =
      args->GetInt("threads", static_cast<std::int64_t>(std::thread::hardware_concurrency()));
  auto reps = args->GetInt("reps", 5);
  auto part = args->GetBytes("part-elements", std::uint64_t{1} << 20);
  for (const absl::Status& s :
       {elements.status(), threads.status(), reps.status(), part.status()}) {
    if (!s.ok()) return Fail("kernels", s, true);
  }
  if (*threads < 1 || *threads > 1024 || *reps < 1 || *reps > 1000 || *part < 4096) {
    return Fail("kernels",
                absl::InvalidArgumentError(
                    "--threads and --reps must be positive (threads <= 1024, reps <= 1000), "
                    "--part-elements at least 4096"),
                true);
  }
  const std::string device = args->Get("device", "cpu");
  if (device == "cuda" && args->Has("part-elements")) {
    return Fail(
        "kernels",
        absl::InvalidArgumentError("--part-elements is a CPU measurement (no --device cuda)"),
        true);
  }
  if (device != "cpu" && device != "cuda") {
    return Fail(
        "kernels",
        absl::InvalidArgumentError(fmt::format("--device must be cpu or cuda, not '{}'", device)),
        true);
  }
  auto r = device == "cuda"
               ? RunCudaKernelBench(*elements, static_cast<int>(*reps))
               : RunKernelBench(*elements, static_cast<int>(*threads), static_cast<int>(*reps),
                                static_cast<std::size_t>(*part));
  if (!r.ok())
    return Fail("kernels", r.status(), r.status().code() == absl::StatusCode::kInvalidArgument);
  const double n = static_cast<double>(r->elements);
  if (args->Has("json")) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("device", r->device);
    w.Field("elements", r->elements);
    w.Field("threads", r->threads);
    w.Field("simd", r->simd);
    w.Field("read_ceiling_gbps", r->read_ceiling_gbps);
    w.Field("copy_ceiling_gbps", r->copy_ceiling_gbps);
    w.Field("overflow_fused_gbps", r->overflow_fused_gbps);
    w.Field("overflow_fused_bf16_gbps", r->overflow_fused_bf16_gbps);
    w.Field("overflow_baseline_gbps", r->overflow_baseline_gbps);
    w.Field("overflow_fused_extra_bytes", r->overflow_fused_extra_bytes);
    w.Field("overflow_baseline_extra_bytes", r->overflow_baseline_extra_bytes);
    w.Field("overflow_fused_over_read_ceiling", r->overflow_fused_gbps / r->read_ceiling_gbps);
    w.Field("overflow_fused_over_baseline", r->overflow_fused_gbps / r->overflow_baseline_gbps);
    w.Field("adam_fused_gbps", r->adam_fused_gbps);
    w.Field("adam_unfused_gbps", r->adam_unfused_gbps);
    w.Field("adam_fused_bytes_per_element", r->adam_fused_bytes_per_element);
    w.Field("adam_unfused_bytes_per_element", r->adam_unfused_bytes_per_element);
    w.Field("adam_unfused_extra_bytes", r->adam_unfused_extra_bytes);
    w.Field("adam_fused_over_copy_ceiling", r->adam_fused_gbps / r->copy_ceiling_gbps);
    w.Field("adam_fused_speedup", r->adam_unfused_seconds / r->adam_fused_seconds);
    if (r->device == "cpu") {
      w.Field("adam_part_elements", r->adam_part_elements);
      w.Field("adam_parts_gbps", r->adam_parts_gbps);
      w.Field("adam_parts_over_fused", r->adam_parts_gbps / r->adam_fused_gbps);
    }
    w.EndObject();
    fmt::print("{}\n", w.str());
    return kExitOk;
  }
  if (r->device == "cuda") {
    fmt::print("{} elements on {} ({} SMs), device memory (GB/s = 1e9 bytes/s)\n", r->elements,
               r->simd, r->threads);
  } else {
    fmt::print("{} elements, {} threads, {} kernels (GB/s = 1e9 bytes/s)\n", r->elements,
               r->threads, r->simd);
  }
  fmt::print("  {:<34} {:>9.2f} GB/s\n", "read ceiling (vectorised read)", r->read_ceiling_gbps);
  fmt::print("  {:<34} {:>9.2f} GB/s (read + write)\n", "copy ceiling (best copy)",
             r->copy_ceiling_gbps);
  fmt::print("  {:<34} {:>9.2f} GB/s  {:.2f} x read ceiling, {} bytes allocated\n",
             "overflow check, fused (fp32)", r->overflow_fused_gbps,
             r->overflow_fused_gbps / r->read_ceiling_gbps, r->overflow_fused_extra_bytes);
  fmt::print("  {:<34} {:>9.2f} GB/s\n", "overflow check, fused (bf16)",
             r->overflow_fused_bf16_gbps);
  fmt::print("  {:<34} {:>9.2f} GB/s  {} bytes allocated ({:.2f} N)\n",
             "overflow check, ZeRO (2 bool temps)", r->overflow_baseline_gbps,
             r->overflow_baseline_extra_bytes,
             static_cast<double>(r->overflow_baseline_extra_bytes) / n);
  fmt::print("  {:<34} {:>9.2f} GB/s  {:.0f} B/element, {:.2f} x copy ceiling\n",
             "adam, fused (bf16 in/out)", r->adam_fused_gbps, r->adam_fused_bytes_per_element,
             r->adam_fused_gbps / r->copy_ceiling_gbps);
  if (r->device == "cpu") {
    fmt::print("  {:<34} {:>9.2f} GB/s  {:.2f} x one call over the whole\n",
               fmt::format("adam, fused, parts of {}", r->adam_part_elements), r->adam_parts_gbps,
               r->adam_parts_gbps / r->adam_fused_gbps);
  }
  fmt::print(
      "  {:<34} {:>9.2f} GB/s  {:.0f} B/element, {} bytes allocated; fused is {:.2f}x faster\n",
      "adam, unfused (5 passes)", r->adam_unfused_gbps, r->adam_unfused_bytes_per_element,
      r->adam_unfused_extra_bytes, r->adam_unfused_seconds / r->adam_fused_seconds);
  return kExitOk;
}

constexpr std::string_view kPcieSummary =
    "host-to-device and device-to-host copies from MemAscend's CUDA-registered host memory";
constexpr OptionSpec kPcieOptions[] = {
    {"size", true, "bytes per copy (default 1G)"},
    {"reps", true, "timed copies each way; best and median are reported (default 5)"},
    {"chunk", true,
     "also time host to device as copies of this many bytes back to back (a trainer's parts)"},
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

int RunPcie(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kPcieOptions);
  if (!args.ok()) return Fail("pcie", args.status(), true);
  if (args->Has("help")) {
    fmt::print("{}", Usage("bench pcie", kPcieSummary, kPcieOptions));
    return kExitOk;
  }
  auto size = args->GetBytes("size", std::uint64_t{1} << 30);
  auto reps = args->GetInt("reps", 5);
  auto chunk = args->GetBytes("chunk", 0);
  for (const absl::Status& s : {size.status(), reps.status(), chunk.status()}) {
    if (!s.ok()) return Fail("pcie", s, true);
  }
  if (*reps < 1 || *reps > 1000) {
    return Fail("pcie", absl::InvalidArgumentError("--reps must be in 1..1000"), true);
  }
  auto r = RunPcieBench(*size, static_cast<int>(*reps), *chunk);
  if (!r.ok())
    return Fail("pcie", r.status(), r.status().code() == absl::StatusCode::kInvalidArgument);
  if (args->Has("json")) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("device", r->device);
    w.Field("bytes", r->bytes);
    w.Field("reps", r->reps);
    w.Field("host_backing", r->host_backing);
    w.Field("register_seconds", r->register_seconds);
    w.Field("h2d_gib_per_s", r->h2d_gib_per_s);
    w.Field("h2d_gib_per_s_median", r->h2d_gib_per_s_median);
    w.Field("d2h_gib_per_s", r->d2h_gib_per_s);
    w.Field("d2h_gib_per_s_median", r->d2h_gib_per_s_median);
    w.Field("h2d_pageable_gib_per_s", r->h2d_pageable_gib_per_s);
    if (r->chunk_bytes > 0) {
      w.Field("chunk_bytes", r->chunk_bytes);
      w.Field("h2d_chunked_gib_per_s", r->h2d_chunked_gib_per_s);
      w.Field("h2d_chunked_gib_per_s_median", r->h2d_chunked_gib_per_s_median);
    }
    w.Field("verified", r->verified);
    w.EndObject();
    fmt::print("{}\n", w.str());
    return kExitOk;
  }
  fmt::print("{} per copy on {}, host memory {} (mapped and registered in {:.3f} s)\n",
             util::FormatBytes(r->bytes), r->device, r->host_backing, r->register_seconds);
  fmt::print("  host to device   {:>7.2f} GiB/s best, {:.2f} median of {}\n", r->h2d_gib_per_s,
             r->h2d_gib_per_s_median, r->reps);
  fmt::print("  device to host   {:>7.2f} GiB/s best, {:.2f} median of {}\n", r->d2h_gib_per_s,
             r->d2h_gib_per_s_median, r->reps);
  fmt::print("  from pageable    {:>7.2f} GiB/s best (host to device, not registered)\n",
             r->h2d_pageable_gib_per_s);
  if (r->chunk_bytes > 0) {
    fmt::print("  in copies of {}  {:>7.2f} GiB/s best, {:.2f} median (host to device)\n",
               util::FormatBytes(r->chunk_bytes), r->h2d_chunked_gib_per_s,
               r->h2d_chunked_gib_per_s_median);
  }
  return kExitOk;
}

constexpr std::string_view kStoreSummary =
    "stream a (scaled) workload through the tensor store vs the raw engine on the same volume";
constexpr OptionSpec kStoreOptions[] = {
    {"workload", true, "workload file (required)"},
    {"host-budget", true, "pinned host bytes for the store (default 256M)"},
    {"scale", true, "divide every tensor's element count by this (default 16)"},
    {"window", true, "tensors prefetched ahead (default 4)"},
    {"volume", true,
     "volume file to create (default: $TMPDIR/memascend_store_bench.vol, removed after); "
     "one that holds anything needs --destroy-data"},
    {"destroy-data", false,
     "format the --volume over what it holds: a volume and its objects, a file system, data"},
    {"reps", true, "pairs of a raw and a store pass; the ratio is their median (default 2)"},
    {"no-verify", false, "skip the volume's data checksum on reads"},
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

int RunStore(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kStoreOptions);
  if (!args.ok()) return Fail("store", args.status(), true);
  if (args->Has("help") || !args->Has("workload")) {
    fmt::print(args->Has("help") ? stdout : stderr, "{}",
               Usage("bench store", kStoreSummary, kStoreOptions));
    return args->Has("help") ? kExitOk : kExitUsage;
  }
  StoreBenchConfig c;
  c.workload = args->Get("workload");
  c.volume = args->Get("volume", c.volume);
  auto budget = args->GetBytes("host-budget", c.host_budget);
  auto scale = args->GetInt("scale", static_cast<std::int64_t>(c.scale));
  auto window = args->GetInt("window", static_cast<std::int64_t>(c.window));
  auto reps = args->GetInt("reps", c.reps);
  for (const absl::Status& s : {budget.status(), scale.status(), window.status(), reps.status()}) {
    if (!s.ok()) return Fail("store", s, true);
  }
  if (*scale < 1 || *window < 0 || *reps < 1) {
    return Fail("store", absl::InvalidArgumentError("--scale and --reps must be positive"), true);
  }
  c.host_budget = *budget;
  c.scale = static_cast<std::uint64_t>(*scale);
  c.window = static_cast<std::size_t>(*window);
  c.reps = static_cast<int>(*reps);
  c.verify_checksums = !args->Has("no-verify");
  c.destroy = args->Has("destroy-data");
  auto r = RunStoreBench(c);
  if (!r.ok())
    return Fail("store", r.status(), r.status().code() == absl::StatusCode::kInvalidArgument);
  // The target's figure: the median of back-to-back pairs (StoreBenchResult).
  const double ratio = r->read_ratio_median;
  const double best_ratio =
      r->raw_read_gib_per_s > 0 ? r->store_read_gib_per_s / r->raw_read_gib_per_s : 0;
  if (args->Has("json")) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("workload", r->workload);
    w.Field("tensors", r->tensors);
    w.Field("bytes", r->bytes);
    w.Field("host_budget_bytes", c.host_budget);
    w.Field("scale", c.scale);
    w.Field("window", c.window);
    w.Field("io_backend", r->io_backend);
    w.Field("store_read_gib_per_s", r->store_read_gib_per_s);
    w.Field("raw_read_gib_per_s", r->raw_read_gib_per_s);
    w.Field("read_ratio", ratio);
    w.Field("read_ratio_of_bests", best_ratio);
    w.Key("read_ratios").BeginArray();
    for (double x : r->read_ratios) w.Double(x);
    w.EndArray();
    w.Field("write_gib_per_s", r->write_gib_per_s);
    w.Field("stall_seconds", r->stall_seconds);
    w.Field("prefetch_hits", r->prefetch_hits);
    w.Field("prefetch_misses", r->prefetch_misses);
    w.Field("prefetch_dropped", r->prefetch_dropped);
    w.Field("peak_pinned_bytes", r->peak_pinned_bytes);
    w.Field("peak_rss_bytes", r->peak_rss_bytes);
    w.EndObject();
    fmt::print("{}\n", w.str());
    return kExitOk;
  }
  fmt::print("{}: {} tensors, {} per pass (scale 1/{}), host budget {}, {} I/O\n", r->workload,
             r->tensors, util::FormatBytes(r->bytes), c.scale, util::FormatBytes(c.host_budget),
             r->io_backend);
  std::string ratios;
  for (double x : r->read_ratios) ratios += fmt::format("{}{:.2f}", ratios.empty() ? "" : " ", x);
  fmt::print(
      "  streaming read   {:.3f} GiB/s best (raw engine {:.3f} GiB/s best), stalls {:.3f} s\n",
      r->store_read_gib_per_s, r->raw_read_gib_per_s, r->stall_seconds);
  fmt::print("  read ratio       {:.2f} x: median of back-to-back pairs ({})\n", ratio, ratios);
  fmt::print("  write-back       {:.3f} GiB/s\n", r->write_gib_per_s);
  fmt::print("  prefetch         {} hits, {} misses, {} dropped\n", r->prefetch_hits,
             r->prefetch_misses, r->prefetch_dropped);
  fmt::print("  peak pinned      {} (budget {}), peak RSS {}\n",
             util::FormatBytes(r->peak_pinned_bytes), util::FormatBytes(c.host_budget),
             util::FormatBytes(r->peak_rss_bytes));
  return kExitOk;
}

}  // namespace

int RunBench(std::span<char* const> argv) {
  const std::string_view sub = argv.empty() ? std::string_view() : std::string_view(argv[0]);
  if (sub == "io") return RunIo(argv.subspan(1));
  if (sub == "tune") return RunTune(argv.subspan(1));
  if (sub == "kernels") return RunKernels(argv.subspan(1));
  if (sub == "store") return RunStore(argv.subspan(1));
  if (sub == "pcie") return RunPcie(argv.subspan(1));
  fmt::print(
      sub == "--help" ? stdout : stderr,
      "usage: memascend bench io|tune|kernels|store|pcie [options]\n  io       {}\n  tune     "
      "{}\n  kernels  {}\n  store    {}\n  pcie     {}\n",
      kIoSummary, kTuneSummary, kKernelsSummary, kStoreSummary, kPcieSummary);
  return sub == "--help" ? kExitOk : kExitUsage;
}

}  // namespace memascend::cli
