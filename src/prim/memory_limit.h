// prim/memory_limit.h: Note [memory limit] (memascend/system.h) read under a root
// directory, so that tests read fake /proc and /sys trees.
#ifndef MEMASCEND_SRC_PRIM_MEMORY_LIMIT_H_
#define MEMASCEND_SRC_PRIM_MEMORY_LIMIT_H_

#include <string>

#include <memascend/system.h>

namespace memascend::prim {

// Reads <root>/proc/self/cgroup, <root>/proc/self/mountinfo, <root>/proc/meminfo and the
// cgroup files under <root><mount point>; "" is the real root. Never fails: what cannot
// be read is no limit, and MemoryLimit::detail says what that was.
MemoryLimit ReadMemoryLimit(const std::string& root);

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_MEMORY_LIMIT_H_
