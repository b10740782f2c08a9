// prim/cuda.h: every CUDA runtime call of MemAscend goes through here.
//
// The library links the CUDA runtime statically when built with CUDA, so a machine
// without the toolkit runs it; without a driver the runtime reports no devices.
#ifndef MEMASCEND_SRC_PRIM_CUDA_H_
#define MEMASCEND_SRC_PRIM_CUDA_H_

#include <memascend/system.h>

namespace memascend::prim {

// Devices, driver and runtime versions. No driver or no device gives device_count 0
// and a status saying which; never an error.
CudaInfo ProbeCuda(bool disabled_by_option);

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_CUDA_H_
