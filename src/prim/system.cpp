// The capability probe: composes the prim/ probes and picks the backends.
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include <memascend/system.h>
#include <memascend/version.h>

#include "prim/cuda.h"
#include "prim/numa.h"
#include "prim/os.h"
#include "prim/uring.h"
#include "util/json_writer.h"

namespace memascend {
namespace {

SimdLevel BestSimd(const CpuInfo& cpu) {
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.fma && cpu.f16c) return SimdLevel::kAvx512;
  if (cpu.avx2 && cpu.fma && cpu.f16c) return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
}

}  // namespace

std::string_view ToString(IoBackendKind kind) noexcept {
  switch (kind) {
    case IoBackendKind::kIoUring:
      return "io_uring";
    case IoBackendKind::kThreadPool:
      return "threads";
    case IoBackendKind::kSync:
      return "sync";
  }
  return "unknown";
}

std::string_view ToString(HostBackingKind kind) noexcept {
  switch (kind) {
    case HostBackingKind::kCudaRegistered:
      return "cuda_registered";
    case HostBackingKind::kMlock:
      return "mlock";
  }
  return "unknown";
}

std::string_view ToString(SimdLevel level) noexcept {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

SimdLevel SelectSimd(const CpuInfo& cpu, SimdLevel cap) noexcept {
  const SimdLevel best = BestSimd(cpu);
  return static_cast<int>(best) < static_cast<int>(cap) ? best : cap;
}

std::vector<std::string_view> FeatureNames(const CpuInfo& cpu) {
  const std::pair<std::string_view, bool> all[] = {
      {"sse4.2", cpu.sse42},      {"avx", cpu.avx},           {"avx2", cpu.avx2},
      {"fma", cpu.fma},           {"f16c", cpu.f16c},         {"avx512f", cpu.avx512f},
      {"avx512bw", cpu.avx512bw}, {"avx512vl", cpu.avx512vl}, {"avx512bf16", cpu.avx512bf16}};
  std::vector<std::string_view> names;
  for (const auto& [name, present] : all) {
    if (present) names.push_back(name);
  }
  return names;
}

ProbeOptions ProbeOptions::FromEnvironment() {
  ProbeOptions options;
  options.disable_io_uring = prim::EnvFlag("MEMASCEND_DISABLE_IO_URING");
  options.disable_cuda = prim::CudaDisabledByEnvironment();
  if (const char* simd = std::getenv("MEMASCEND_MAX_SIMD"); simd != nullptr) {
    const std::string_view v(simd);
    if (v == "scalar") options.max_simd = SimdLevel::kScalar;
    if (v == "avx2") options.max_simd = SimdLevel::kAvx2;
  }
  return options;
}

SystemInfo ProbeSystem(const ProbeOptions& options) {
  SystemInfo info;
  info.kernel_release = prim::KernelRelease();
  info.cpu = prim::ProbeCpu();
  info.memory = prim::ProbeMemory();
  info.memory_limit = ReadMemoryLimit();
  info.io_uring = prim::ProbeIoUring(options.disable_io_uring);
  info.cuda = prim::ProbeCuda(options.disable_cuda);
  info.numa = prim::ProbeNuma();

  info.io_backend = info.io_uring.available ? IoBackendKind::kIoUring : IoBackendKind::kThreadPool;
  info.io_backend_reason =
      info.io_uring.available
          ? fmt::format(
                "io_uring: every operation the engine uses worked in the probe (read, "
                "write, registered files and buffers, fixed reads and writes{})",
                info.io_uring.direct_io ? " with O_DIRECT" : "")
          : fmt::format("thread pool: {}", info.io_uring.unavailable_reason);
  info.host_backing =
      info.cuda.device_count > 0 ? HostBackingKind::kCudaRegistered : HostBackingKind::kMlock;
  info.simd = SelectSimd(info.cpu, options.max_simd);
  return info;
}

std::string ToJson(const SystemInfo& info) {
  util::JsonWriter w;
  const auto limit = [](std::uint64_t v) -> std::int64_t {
    return v == kUnlimited ? -1 : static_cast<std::int64_t>(v);
  };
  w.BeginObject();
  w.Field("version", MEMASCEND_VERSION_STRING);
  w.Field("io_uring", info.io_uring.available);
  w.Field("cuda_devices", info.cuda.device_count);
  w.Field("numa_nodes", info.numa.node_count);
  w.Field("memlock_limit_bytes", limit(info.memory.memlock_soft_bytes));
  w.Field("page_size", info.memory.page_size);
  w.Field("io_backend", ToString(info.io_backend));
  w.Field("io_backend_reason", info.io_backend_reason);
  w.Field("host_backing", ToString(info.host_backing));
  w.Field("simd", ToString(info.simd));
  w.Field("kernel_release", info.kernel_release);

  w.Key("cpu").BeginObject();
  w.Field("model", info.cpu.model);
  w.Field("online_cpus", info.cpu.online_cpus);
  w.Key("features").BeginArray();
  for (std::string_view name : FeatureNames(info.cpu)) w.String(name);
  w.EndArray();
  w.EndObject();

  w.Key("memory").BeginObject();
  w.Field("total_bytes", info.memory.total_bytes);
  w.Field("available_bytes", info.memory.available_bytes);
  w.Field("huge_page_size", info.memory.huge_page_size);
  w.Field("huge_pages_total", info.memory.huge_pages_total);
  w.Field("memlock_soft_bytes", limit(info.memory.memlock_soft_bytes));
  w.Field("memlock_hard_bytes", limit(info.memory.memlock_hard_bytes));
  w.Field("cap_ipc_lock", info.memory.cap_ipc_lock);
  w.Field("lockable_bytes", limit(info.memory.lockable_bytes()));
  w.EndObject();

  const MemoryLimit& ml = info.memory_limit;
  w.Key("memory_limit").BeginObject();
  w.Field("cgroup_version", ml.cgroup_version);
  w.Field("cgroup_dir", ml.cgroup_dir);
  w.Field("cgroup_limit_bytes", limit(ml.cgroup_limit_bytes));
  w.Field("cgroup_limit_file", ml.cgroup_limit_file);
  w.Field("cgroup_usage_bytes", ml.cgroup_usage_bytes);
  w.Field("cgroup_reclaimable_bytes", ml.cgroup_reclaimable_bytes);
  w.Field("available_bytes", limit(ml.available_bytes));
  w.Field("limit_bytes", limit(ml.limit_bytes()));
  w.Field("limit_source", ml.limit_source());
  w.Field("headroom_bytes", limit(ml.headroom_bytes()));
  w.Field("headroom_source", ml.headroom_source());
  w.Field("detail", ml.detail);
  w.EndObject();

  w.Key("io_uring_detail").BeginObject();
  w.Field("available", info.io_uring.available);
  w.Field("reason", info.io_uring.unavailable_reason);
  w.Field("features", info.io_uring.features);
  w.Field("op_read", info.io_uring.op_read);
  w.Field("op_write", info.io_uring.op_write);
  w.Field("op_read_fixed", info.io_uring.op_read_fixed);
  w.Field("op_write_fixed", info.io_uring.op_write_fixed);
  w.Field("registered_files", info.io_uring.registered_files);
  w.Field("registered_buffers", info.io_uring.registered_buffers);
  w.Field("direct_io", info.io_uring.direct_io);
  w.Field("probe_dir", info.io_uring.probe_dir);
  w.Key("checks").BeginArray();
  for (const IoUringCheck& c : info.io_uring.checks) {
    w.BeginObject().Field("name", c.name).Field("ok", c.ok).Field("detail", c.detail).EndObject();
  }
  w.EndArray();
  w.EndObject();

  w.Key("cuda").BeginObject();
  w.Field("built_with_cuda", info.cuda.built_with_cuda);
  w.Field("device_count", info.cuda.device_count);
  w.Field("driver_version", info.cuda.driver_version);
  w.Field("runtime_version", info.cuda.runtime_version);
  w.Field("status", info.cuda.status);
  w.Key("devices").BeginArray();
  for (const CudaDeviceInfo& dev : info.cuda.devices) {
    w.BeginObject();
    w.Field("index", dev.index);
    w.Field("name", dev.name);
    w.Field("compute_capability", std::to_string(dev.compute_capability_major) + "." +
                                      std::to_string(dev.compute_capability_minor));
    w.Field("total_memory_bytes", dev.total_memory_bytes);
    w.Field("pci_bus_id", dev.pci_bus_id);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();

  w.Key("numa").BeginObject();
  w.Field("available", info.numa.available);
  w.Field("node_count", info.numa.node_count);
  w.Key("node_memory_bytes").BeginArray();
  for (std::uint64_t bytes : info.numa.node_memory_bytes) w.Uint(bytes);
  w.EndArray();
  w.EndObject();

  w.EndObject();
  return std::move(w).str();
}

}  // namespace memascend
