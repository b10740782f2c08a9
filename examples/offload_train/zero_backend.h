// The ZeRO-Infinity baseline: the same training run under DeepSpeed's host-memory and
// storage rules (../shared/guide/ANCHORS.md), implemented as written, not weakened.
//
// - Parameter swap buffers: one pinned allocation of param_buffer_count x
//   param_buffer_size elements (16-bit), where param_buffer_size is raised to the
//   largest parameter. A parameter is swapped in to a free buffer before its layer
//   runs (the next one prefetched into another buffer).
// - Optimizer swap buffers: optimizer_buffer_count pinned buffers, each the largest
//   optimizer sub-group in fp32. Sub-groups pack consecutive parameters until they
//   reach sub_group_size elements (the last parameter may pass it). A sub-group's step
//   swaps in its fp32 master weights and both moments, takes its gradient as fp32, runs
//   Adam, swaps the states out and writes the new 16-bit parameters.
// - Gradients: stage 3's grad_partitions_flat_buffer, one pinned 16-bit buffer for all
//   parameters (pinned when the optimizer is offloaded).
// - Every pinned allocation goes through the pow2 pool (PyTorch's caching host
//   allocator rounds to powers of two).
// - Storage: one file per tensor on a file system
//   (<nvme_path>/zero_stage_3/<dtype>params/rank0/<id>_param.tensor.swp), opened per
//   transfer with O_DIRECT and moved in aio_block_bytes requests with
//   aio_queue_depth in flight on a thread pool. Tensors under min_swap_bytes stay in
//   (pageable) memory.
// - Overflow check: isinf(flat).any(), then isnan(flat).any(), each over a 1-byte
//   temporary per gradient element.
// Unlike DeepSpeed, every I/O result is checked (checking costs no memory).
//
// Thread-safety: one training loop drives it.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_BACKEND_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_BACKEND_H_

#include <memory>

#include <absl/status/statusor.h>

#include <memascend/memory_ledger.h>

#include "backend.h"
#include "trainer.h"

namespace offload_train {

// kResourceExhausted when the buffers' rules cannot hold the model (a parameter larger
// than param_buffer_size after the rule raised it cannot happen; fewer than four
// optimizer buffers or one parameter buffer can).
absl::StatusOr<std::unique_ptr<Backend>> MakeZeroInfinityBackend(
    const TrainOptions& options, const memascend::StateLayout& state_layout,
    memascend::MemoryLedger* ledger);

// The pinned bytes the ZeRO-Infinity rules allocate for this model (after pow2 rounding).
std::uint64_t ZeroPinnedBytes(const TrainOptions& options);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_BACKEND_H_
