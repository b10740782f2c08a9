// The ZeRO-Infinity baseline: the same training run under DeepSpeed's host-memory and
// storage rules (../shared/guide/ANCHORS.md), implemented as written, not weakened.
//
// Note [zero rules]: each rule, and the DeepSpeed source it comes from
// (deepspeed/runtime/zero/ and deepspeed/runtime/swap_tensor/, v0.16.5; what 0.19.5
// changed is said where it applies, under ZeroOptions::release):
// - Parameter swap buffers (partitioned_param_swapper.py, AsyncPartitionedParameterSwapper,
//   made whenever offload_param's device is nvme): one pinned allocation of
//   param_buffer_count x param_buffer_size elements (16-bit), param_buffer_size raised to
//   the largest parameter. A parameter on NVMe is swapped in to a free buffer before its
//   layer runs (the next one prefetched into another).
// - Parameters kept in CPU memory (stage3.py, _create_param_groups_fp16_flat_cpu_memory and
//   _create_fp16_partitions_with_defragmentation): a pinned 16-bit flat buffer of
//   min(all parameters, max_in_cpu) elements; each optimizer sub-group whose parameters
//   fit in it, in order, lives there and is never swapped; the others live on NVMe. If any
//   does, a pinned 16-bit buffer of the largest sub-group (reserve_partitioned_swap_space)
//   carries the new parameters out after the sub-group's step.
// - Optimizer swap buffers (partitioned_optimizer_swapper.py): optimizer_buffer_count
//   pinned buffers, each the largest optimizer sub-group in fp32. Sub-groups pack
//   consecutive parameters until they reach sub_group_size elements (the last parameter
//   may pass it; stage3.py, _create_fp16_sub_groups). A sub-group's step swaps in its fp32
//   master weights, both moments and its fp32 gradient, runs Adam, swaps the states out
//   and writes the new 16-bit parameters.
// - Gradients (stage3.py, partition_grads): the backward pass writes 16-bit gradients to
//   the flat grad_partitions_flat_buffer, pinned only with offload_optimizer.pin_memory
//   (pageable and zero-filled otherwise). A bucket of reduce_bucket_size elements at a
//   time (and the rest at the end of the backward pass), each gradient is made fp32 on
//   the GPU (grad_buffer.to(device), then .float(): no host memory) and, with the
//   optimizer on NVMe, swapped out (swap_out_gradients, staged through the optimizer swap
//   buffers); the step swaps them back in.
// - Every pinned allocation goes through the pow2 pool (PyTorch's caching host
//   allocator rounds to powers of two). From 0.19.5 the swap buffers (parameter,
//   partitioned and optimizer) are new_cpu_locked_tensor's instead: posix_memalign and
//   mlock at their exact size, zeroed in place (no pageable copy at start-up); and
//   offload_optimizer.pin_memory and offload_param.pin_memory default to true
//   (offload_config.py), the latter pinning each parameter too small to swap
//   (partition_parameters.py, _partition_param).
// - Storage: one file per tensor on a file system
//   (<nvme_path>/zero_stage_3/<dtype>params/rank0/<id>_param.tensor.swp), opened per
//   transfer with O_DIRECT and moved in aio_block_bytes requests with
//   aio_queue_depth in flight on a thread pool. Tensors under max(MIN_AIO_BYTES = 1 MiB,
//   aio block_size) bytes stay in memory (swappable_tensor's min_aio_bytes).
// - Overflow check (stage3.py, has_overflow_partitioned_grads_serial and
//   CheckOverflow), fp16 only (_overflow_check_and_loss_scale_update: bf16 checks
//   nothing): isinf(flat).any(), then isnan(flat).any(), each over a 1-byte temporary per
//   gradient element, on the intra-op threads as ATen runs them.
// - Start-up (swap_buffer_manager.py, SwapBufferManager; stage3.py,
//   _create_fp32_partitions): each optimizer swap buffer is pin_memory(torch.zeros(n)),
//   a zeroed pageable copy beside the pinned one until it is made (up to 0.16.5); each sub-group's
//   fp32 master weights are made in a pageable buffer of the sub-group before they go out.
// - Pipelining (pipelined_optimizer_swapper.py, PipelinedOptimizerSwapper, used when
//   offload_optimizer's pipeline_read or pipeline_write is set): with pipeline_read the
//   next sub-group's states and gradient are read while one steps; with pipeline_write
//   a sub-group's states are written while the next one steps, finished before the one
//   after is written. Reads and writes go through handles of their own. Each sub-group
//   in flight takes four optimizer buffers (master weights, both moments, gradient), so
//   buffer_count must be 8 with one flag, 12 with both ("ran out of swap buffers"
//   otherwise). The new 16-bit parameters of a sub-group on NVMe are written behind too,
//   finished before the next sub-group refills their buffer (swap_out_partitioned_params'
//   synchronize_writes), with or without the flags.
// Unlike DeepSpeed, every I/O result is checked (checking costs no memory).
//
// Thread-safety: one training loop drives it.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_H_

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

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_H_
