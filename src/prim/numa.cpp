#include "prim/numa.h"

#include <numa.h>

namespace memascend::prim {

NumaInfo ProbeNuma() {
  NumaInfo info;
  // numa_available() is -1 when the kernel has no NUMA policy support (get_mempolicy
  // fails), e.g. CONFIG_NUMA=n or a seccomp profile that blocks it.
  if (numa_available() < 0) return info;
  info.available = true;
  info.node_count = numa_num_configured_nodes();
  const int max_node = numa_max_node();
  for (int node = 0; node <= max_node; ++node) {
    long long free_bytes = 0;
    const long long size = numa_node_size64(node, &free_bytes);
    if (size > 0) info.node_memory_bytes.push_back(static_cast<std::uint64_t>(size));
  }
  return info;
}

}  // namespace memascend::prim
