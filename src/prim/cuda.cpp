#include "prim/cuda.h"

#include <atomic>
#include <string>
#include <string_view>
#include <unistd.h>

#include <fmt/format.h>

#include <memascend/cuda.h>

#include "prim/cuda_memory.h"
#include "prim/os.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend::prim {
namespace {

// The process that first called the CUDA runtime (0: none yet). A forked child
// inherits the value and so sees another pid: Note [cuda and fork].
std::atomic<pid_t> g_cuda_process{0};

// The process that used CUDA before this one was forked from it, or 0.
pid_t ForkedFrom() noexcept {
  const pid_t user = g_cuda_process.load(std::memory_order_relaxed);
  return user != 0 && user != ::getpid() ? user : 0;
}

}  // namespace

bool CudaDisabledByEnvironment() noexcept { return EnvFlag("MEMASCEND_DISABLE_CUDA"); }

void NoteCudaUse() noexcept {
  pid_t none = 0;
  g_cuda_process.compare_exchange_strong(none, ::getpid(), std::memory_order_relaxed);
}

bool CudaUsable() noexcept { return !CudaDisabledByEnvironment() && ForkedFrom() == 0; }

std::string CudaUnusableReason() {
  if (CudaDisabledByEnvironment()) return "disabled by MEMASCEND_DISABLE_CUDA";
  if (const pid_t user = ForkedFrom(); user != 0) {
    return fmt::format(
        "this process was forked from process {} after that one used CUDA, and the CUDA "
        "runtime does not survive fork(); use CUDA only after fork, or exec a new program",
        user);
  }
  return "";
}

CudaInfo ProbeCuda(bool disabled_by_option) {
  CudaInfo info;
#if MEMASCEND_HAVE_CUDA
  info.built_with_cuda = true;
  if (disabled_by_option) {
    info.status = "disabled by MEMASCEND_DISABLE_CUDA";
    return info;
  }
  if (std::string why = CudaUnusableReason(); !why.empty()) {
    info.status = std::move(why);
    return info;
  }
  NoteCudaUse();
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // cudaErrorNoDevice, cudaErrorInsufficientDriver (no driver at all), and friends:
    // all mean "no usable GPU here", which is a fact, not a failure.
    info.status = (err == cudaErrorInsufficientDriver && info.driver_version == 0)
                      ? "no CUDA driver installed"
                      : cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return info;
  }
  info.device_count = count;
  info.status = count > 0 ? "ok" : "no CUDA-capable device";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo dev;
    dev.index = i;
    dev.name = prop.name;
    dev.compute_capability_major = prop.major;
    dev.compute_capability_minor = prop.minor;
    dev.total_memory_bytes = prop.totalGlobalMem;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), i) == cudaSuccess) dev.pci_bus_id = bus;
    info.devices.push_back(std::move(dev));
  }
#else
  (void)disabled_by_option;
  info.status = "built without CUDA (MEMASCEND_WITH_CUDA=OFF or nvcc not found)";
#endif
  return info;
}

}  // namespace memascend::prim

namespace memascend {

absl::StatusOr<std::unique_ptr<ReuseFence>> RecordCudaFence(CudaStreamView stream) {
  if (prim::CudaDeviceCount() == 0) {
    const std::string why = prim::CudaUnusableReason();
    return absl::FailedPreconditionError(fmt::format(
        "RecordCudaFence: {}", why.empty() ? "no CUDA device (or built without CUDA)" : why));
  }
  auto event = prim::CudaEvent::Create();
  if (!event.ok()) return event.status();
  if (absl::Status s = event->Record(stream); !s.ok()) return s;
  return prim::EventFence(std::make_shared<prim::CudaEvent>(*std::move(event)));
}

}  // namespace memascend
