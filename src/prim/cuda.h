// prim/cuda.h: every CUDA runtime call of MemAscend goes through here.
//
// The library links the CUDA runtime statically when built with CUDA, so a machine
// without the toolkit runs it; without a driver the runtime reports no devices.
#ifndef MEMASCEND_SRC_PRIM_CUDA_H_
#define MEMASCEND_SRC_PRIM_CUDA_H_

#include <string>

#include <memascend/system.h>

namespace memascend::prim {

// Devices, driver and runtime versions. No driver or no device gives device_count 0
// and a status saying which; never an error. So does a process that cannot use CUDA
// (CudaUnusableReason), without calling the runtime.
CudaInfo ProbeCuda(bool disabled_by_option);

// True when MEMASCEND_DISABLE_CUDA is set (ProbeOptions::FromEnvironment's rule).
bool CudaDisabledByEnvironment() noexcept;

// CudaUnusableReason().empty(), without building the message.
bool CudaUsable() noexcept;

// Records that this process calls the CUDA runtime. Every MemAscend path into the
// runtime starts with it (ProbeCuda, CudaDeviceCount, the kernels' launches).
void NoteCudaUse() noexcept;

// Note [cuda and fork]
// The CUDA runtime does not survive fork(): a child of a process that has used it
// gets errors (or worse) from its first call. MemAscend remembers the process that
// first called the runtime; in a forked child (another pid, same memory image) the
// library behaves as on a machine without a GPU, so host memory falls back to
// mlock and the GPU tier reports kFailedPrecondition, rather than failing later
// with an error that hides the cause. Returns why CUDA cannot be used here, or ""
// when it can as far as MemAscend knows (a runtime initialised before fork by
// other code in the parent is caught by the errors' own messages instead).
std::string CudaUnusableReason();

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_CUDA_H_
