// store/device_pool.h: the GPU tier's device memory: one device allocation of the GPU
// budget, carved best-fit into blocks aligned to kDeviceBlockBytes, coalesced on free.
//
// Why one allocation: cudaMalloc and cudaFree synchronise the device, so a tier that
// called them per tensor would stall every stream of the trainer. The slab is taken at
// the first GPU acquire and held for the store's life, like PyTorch's caching allocator
// holds its segments; the budget bounds it.
//
// Thread-safety: none (the tensor store serialises it).
// Lifetime: blocks are offsets into the slab, valid until freed or the pool goes.
#ifndef MEMASCEND_SRC_STORE_DEVICE_POOL_H_
#define MEMASCEND_SRC_STORE_DEVICE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include <absl/status/statusor.h>

#include <memascend/memory_ledger.h>

#include "prim/cuda_memory.h"
#include "storage/extent_allocator.h"

namespace memascend::store {

inline constexpr std::size_t kDeviceBlockBytes = 512;  // cudaMalloc aligns to 256 or more

class DevicePool {
 public:
  // Over `slab` (owned). The ledger (may be null) gets the slab as reserved kFree bytes
  // under Tier::kGpu, and blocks as live bytes of their use.
  DevicePool(prim::DeviceAllocation slab, MemoryLedger* ledger);
  // Carving only, over an address range the pool never touches: for tests of the
  // allocator where no GPU exists.
  DevicePool(std::byte* base, std::size_t bytes, MemoryLedger* ledger);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // A block of `bytes` (rounded up to kDeviceBlockBytes). kInvalidArgument for 0 bytes;
  // kResourceExhausted when no free extent fits (saying what is free and the largest
  // extent); nothing changes then.
  absl::StatusOr<std::byte*> Allocate(std::size_t bytes, Use use);
  // kInvalidArgument, and nothing changes, for a pointer that is not a live block.
  absl::Status Free(std::byte* block);

  std::size_t capacity() const noexcept { return bytes_; }
  std::size_t allocated() const noexcept { return allocated_; }
  std::size_t largest_free() const noexcept;
  absl::Status CheckInvariants() const;

 private:
  struct Block {
    std::uint64_t units;
    Use use;
  };
  prim::DeviceAllocation slab_;
  std::byte* base_;
  std::size_t bytes_;
  MemoryLedger* ledger_;
  storage::ExtentAllocator free_;
  std::map<std::uint64_t, Block> live_;  // start unit -> block
  std::size_t allocated_ = 0;
};

}  // namespace memascend::store

#endif  // MEMASCEND_SRC_STORE_DEVICE_POOL_H_
