// tools/alloc_counter.h: bytes requested from the global operator new by this process
// (the memascend binary replaces it; see alloc_counter.cpp). Benchmarks read it before
// and after a kernel to measure the memory the kernel allocates.
#ifndef MEMASCEND_TOOLS_ALLOC_COUNTER_H_
#define MEMASCEND_TOOLS_ALLOC_COUNTER_H_

#include <cstdint>

namespace memascend::cli {

std::uint64_t AllocatedBytes() noexcept;

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_ALLOC_COUNTER_H_
