// memascend/memascend.h: includes the whole public API of MemAscend.
//
//   #include <memascend/memascend.h>
//
// Prefer the individual headers in code that cares about build times.
#ifndef MEMASCEND_MEMASCEND_H_
#define MEMASCEND_MEMASCEND_H_

#include <memascend/status.h>
#include <memascend/system.h>
#include <memascend/version.h>

#endif  // MEMASCEND_MEMASCEND_H_
