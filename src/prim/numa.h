// prim/numa.h: NUMA topology through libnuma.
#ifndef MEMASCEND_SRC_PRIM_NUMA_H_
#define MEMASCEND_SRC_PRIM_NUMA_H_

#include <memascend/system.h>

namespace memascend::prim {

NumaInfo ProbeNuma();

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_NUMA_H_
