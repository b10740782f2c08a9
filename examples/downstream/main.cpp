// A minimal program linked against an installed MemAscend: it probes the machine,
// reports the backends MemAscend would pick, and uses the status macros.
#include <cstdio>
#include <string>

#include <memascend/memascend.h>

namespace {

absl::StatusOr<std::string> Describe(const memascend::SystemInfo& info) {
  if (info.memory.page_size == 0) return absl::InternalError("probe returned no page size");
  return std::string(memascend::ToString(info.io_backend)) + " I/O, " +
         std::string(memascend::ToString(info.host_backing)) + " pinned memory, " +
         std::string(memascend::ToString(info.simd)) + " CPU kernels";
}

absl::Status Run() {
  const memascend::SystemInfo info = memascend::ProbeSystem();
  MEMASCEND_ASSIGN_OR_RETURN(const std::string summary, Describe(info));
  std::printf("downstream: MemAscend %s (headers %s): %s, %d CUDA device(s)\n",
              std::string(memascend::VersionString()).c_str(), MEMASCEND_VERSION_STRING,
              summary.c_str(), info.cuda.device_count);
  if (memascend::VersionString() != MEMASCEND_VERSION_STRING) {
    return absl::FailedPreconditionError("library and header versions differ");
  }
  return absl::OkStatus();
}

}  // namespace

int main() {
  const absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "downstream: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
