// memascend info [--json]: the capability probe, for people and for scripts.
#include <fmt/format.h>

#include <memascend/system.h>
#include <memascend/version.h>

#include "args.h"
#include "commands.h"
#include "util/units.h"

namespace memascend::cli {
namespace {

constexpr OptionSpec kOptions[] = {
    {"json", false, "print one JSON object instead of a table"},
    {"help", false, "show this help"},
};

std::string Limit(std::uint64_t bytes) {
  return bytes == kUnlimited ? std::string("unlimited") : util::FormatBytes(bytes);
}

void PrintTable(const SystemInfo& info) {
  fmt::print("MemAscend {}{}\n", VersionString(), BuiltWithCuda() ? " (built with CUDA)" : "");
  fmt::print("  {:<10} Linux {}\n", "kernel", info.kernel_release);
  std::string features;
  for (std::string_view name : FeatureNames(info.cpu)) features += fmt::format(" {}", name);
  fmt::print("  {:<10} {} ({} online);{}\n", "cpu",
             info.cpu.model.empty() ? "unknown" : info.cpu.model, info.cpu.online_cpus, features);
  fmt::print("  {:<10} {} total, {} available; page {}, huge page {} x {}\n", "memory",
             util::FormatBytes(info.memory.total_bytes),
             util::FormatBytes(info.memory.available_bytes),
             util::FormatBytes(info.memory.page_size),
             util::FormatBytes(info.memory.huge_page_size), info.memory.huge_pages_total);
  fmt::print("  {:<10} RLIMIT_MEMLOCK {} soft / {} hard; CAP_IPC_LOCK {}; may lock {}\n", "memlock",
             Limit(info.memory.memlock_soft_bytes), Limit(info.memory.memlock_hard_bytes),
             info.memory.cap_ipc_lock ? "yes" : "no", Limit(info.memory.lockable_bytes()));
  const MemoryLimit& ml = info.memory_limit;
  fmt::print("  {:<10} {}; may take {} ({})\n", "limit",
             ml.cgroup_version == 0
                 ? std::string("no memory cgroup")
                 : fmt::format("cgroup v{} {}, {} in use ({} reclaimable cache)", ml.cgroup_version,
                               ml.cgroup_dir, util::FormatBytes(ml.cgroup_usage_bytes),
                               util::FormatBytes(ml.cgroup_reclaimable_bytes)),
             Limit(ml.headroom_bytes()), ml.headroom_source());
  fmt::print("  {:<10} {}\n", "", ml.limit_source());
  if (!ml.detail.empty()) fmt::print("  {:<10} {}\n", "", ml.detail);
  if (info.io_uring.available) {
    fmt::print(
        "  {:<10} available (features {:#x}; read, write, registered files and buffers, "
        "fixed reads and writes{} all worked)\n",
        "io_uring", info.io_uring.features, info.io_uring.direct_io ? " with O_DIRECT" : "");
  } else {
    fmt::print("  {:<10} unavailable: {}\n", "io_uring", info.io_uring.unavailable_reason);
  }
  for (const IoUringCheck& c : info.io_uring.checks) {
    if (c.ok && info.io_uring.available) continue;
    fmt::print("  {:<10}   {:<18} {}{}\n", "", c.name, c.ok ? "ok" : "FAILED",
               c.detail.empty() ? "" : fmt::format(": {}", c.detail));
  }
  fmt::print("  {:<10} {} device(s): {}\n", "cuda", info.cuda.device_count, info.cuda.status);
  for (const CudaDeviceInfo& dev : info.cuda.devices) {
    fmt::print("  {:<10}   [{}] {} sm_{}{} {} {}\n", "", dev.index, dev.name,
               dev.compute_capability_major, dev.compute_capability_minor,
               util::FormatBytes(dev.total_memory_bytes), dev.pci_bus_id);
  }
  fmt::print("  {:<10} {} node(s){}\n", "numa", info.numa.node_count,
             info.numa.available ? "" : " (no NUMA support in this kernel or sandbox)");
  fmt::print("  {:<10} io backend {}, pinned memory {}, cpu kernels {}\n", "selected",
             ToString(info.io_backend), ToString(info.host_backing), ToString(info.simd));
  fmt::print("  {:<10} {}\n", "why", info.io_backend_reason);
}

}  // namespace

int RunInfo(std::span<char* const> argv) {
  auto args = Args::Parse(argv, kOptions);
  if (!args.ok()) {
    fmt::print(stderr, "memascend info: {}\n{}", Message(args.status()),
               Usage("info", "print the capability probe", kOptions));
    return kExitUsage;
  }
  if (args->Has("help")) {
    fmt::print("{}", Usage("info", "print the capability probe", kOptions));
    return kExitOk;
  }
  const SystemInfo info = ProbeSystem();
  if (args->Has("json")) {
    fmt::print("{}\n", ToJson(info));
  } else {
    PrintTable(info);
  }
  return kExitOk;
}

}  // namespace memascend::cli
