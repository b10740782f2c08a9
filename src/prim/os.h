// prim/os.h: facts read from the kernel about the CPU and memory.
#ifndef MEMASCEND_SRC_PRIM_OS_H_
#define MEMASCEND_SRC_PRIM_OS_H_

#include <cstdint>
#include <string>
#include <thread>
#include <utility>

#include <memascend/system.h>

namespace memascend::prim {

std::string KernelRelease();
CpuInfo ProbeCpu();
MemoryInfo ProbeMemory();

// True when the environment variable `name` is set to anything but "", "0",
// "false", "no" or "off" (the rule of every MEMASCEND_DISABLE_* switch).
bool EnvFlag(const char* name) noexcept;

// Page size of this process, cached after the first call (sysconf never changes it).
std::uint64_t PageSize() noexcept;

// Names the calling thread, as top -H, a debugger and /proc/self/task/*/comm show it
// (every thread MemAscend starts is named "ma-...": whose CPU time is whose). The kernel
// keeps 15 characters; a longer name is cut. Best effort: a failure changes nothing.
void NameThisThread(const char* name) noexcept;

// True on a thread StartThread made (MemAscend's own), false on any other: a caller's
// thread is left as it was found (Note [current device], prim/cuda_memory.h).
bool IsOurThread() noexcept;
void MarkThisThreadOurs() noexcept;

// A thread that names itself `name` (a string literal: it must outlive the thread's start)
// and then runs `body`: how every thread MemAscend starts is made.
template <typename F>
std::thread StartThread(const char* name, F&& body) {
  return std::thread([name, body = std::forward<F>(body)]() mutable {
    NameThisThread(name);
    MarkThisThreadOurs();
    body();
  });
}

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_OS_H_
