// memascend bench io | tune: direct-I/O throughput of a target (file or block device).
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "args.h"
#include "commands.h"
#include "io_bench.h"
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
    {"json", false, "print one JSON object"},
    {"help", false, "show this help"},
};

constexpr std::string_view kTuneSummary =
    "sweep block size and queue depth for reads and writes; print the best settings";
constexpr OptionSpec kTuneOptions[] = {
    {"target", true, "file or block device"},
    {"size", true, "bytes per measurement (default 1G, or the target's size)"},
    {"backend", true, "uring | threads"},
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
    for (std::size_t block : {std::size_t{128} << 10, std::size_t{1} << 20, std::size_t{8} << 20}) {
      for (unsigned qd : {8u, 32u, 128u}) {
        IoBenchConfig c{args->Get("target"), op, block, qd, *size, *backend};
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

}  // namespace

int RunBench(std::span<char* const> argv) {
  const std::string_view sub = argv.empty() ? std::string_view() : std::string_view(argv[0]);
  if (sub == "io") return RunIo(argv.subspan(1));
  if (sub == "tune") return RunTune(argv.subspan(1));
  fmt::print(sub == "--help" ? stdout : stderr,
             "usage: memascend bench io|tune [options]\n  io    {}\n  tune  {}\n", kIoSummary,
             kTuneSummary);
  return sub == "--help" ? kExitOk : kExitUsage;
}

}  // namespace memascend::cli
