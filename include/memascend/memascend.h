// memascend/memascend.h: includes the whole public API of MemAscend.
//
//   #include <memascend/memascend.h>
//
// Prefer the individual headers in code that cares about build times.
#ifndef MEMASCEND_MEMASCEND_H_
#define MEMASCEND_MEMASCEND_H_

#include <memascend/block_target.h>
#include <memascend/cuda.h>
#include <memascend/cuda_kernels.h>
#include <memascend/device_training.h>
#include <memascend/host_arena.h>
#include <memascend/host_budget.h>
#include <memascend/io_engine.h>
#include <memascend/io_scheduler.h>
#include <memascend/kernels.h>
#include <memascend/memory_ledger.h>
#include <memascend/object_store.h>
#include <memascend/offloaded_optimizer.h>
#include <memascend/offloaded_training.h>
#include <memascend/pinned_pool.h>
#include <memascend/safetensors.h>
#include <memascend/status.h>
#include <memascend/system.h>
#include <memascend/tensor_store.h>
#include <memascend/training_state.h>
#include <memascend/types.h>
#include <memascend/version.h>
#include <memascend/volume.h>
#include <memascend/workload.h>

#endif  // MEMASCEND_MEMASCEND_H_
