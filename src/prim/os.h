// prim/os.h: facts read from the kernel about the CPU and memory.
#ifndef MEMASCEND_SRC_PRIM_OS_H_
#define MEMASCEND_SRC_PRIM_OS_H_

#include <cstdint>
#include <string>

#include <memascend/system.h>

namespace memascend::prim {

std::string KernelRelease();
CpuInfo ProbeCpu();
MemoryInfo ProbeMemory();

// Page size of this process, cached after the first call (sysconf never changes it).
std::uint64_t PageSize() noexcept;

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_OS_H_
