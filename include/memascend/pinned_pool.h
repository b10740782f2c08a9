// memascend/pinned_pool.h: a size-class pool of page-locked blocks, adapted to the workload.
//
// Offloaded training asks for the same handful of tensor sizes over and over. The pool
// keeps idle blocks per size class so that the hit path is a lock, a pop and an
// unlock, and it derives its classes from the sizes the workload will really ask for,
// so a block is as large as its tensor (to the 4 KiB direct-I/O block), not the next
// power of two.
//
//   memascend::PinnedPoolOptions options;
//   options.expected_sizes = {262144000, 33554432, 90177536, 8192};  // bytes
//   MEMASCEND_ASSIGN_OR_RETURN(auto pool, memascend::PinnedPool::Create(arena.get(), options));
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::PinnedBlock block,
//                              pool->Allocate(33554432, memascend::Use::kParameters));
//   Read(fd, block.data(), block.size());
//   // ~PinnedBlock returns the block to its class
//
// Note [size classes]: with PoolPolicy::kAdaptive every distinct expected size,
// rounded up to 4 KiB, is a class of its own; any other size falls into geometric
// classes, `classes_per_doubling` per power of two (8 by default: at most 11% of a
// block wasted), and 4 KiB multiples below 4 KiB x classes_per_doubling.
// PoolPolicy::kPow2 follows PyTorch's CachingHostAllocator instead (the baseline):
// every request rounded up to a power of two, one free list per power, no splitting,
// blocks cached until Trim().
//
// Note [reclaim on miss]: in kAdaptive, the pool keeps idle blocks only while the bytes
// it holds stay within (1 + idle_slack) x the peak bytes its callers have had in use at
// once. A request that finds its class empty first fills a hole of free arena space;
// failing that, if a new block would carry the pool past that bound, it gives idle
// blocks back to the arena, least recently used classes first, until it would not, and
// only then lets the arena grow (which unmaps the regions those blocks left empty). So
// the memory held follows the peak in use when the mix of sizes changes between phases
// (forward, backward, optimizer step), while the idle blocks a steady phase reuses stay
// cached. The hit path never does this.
//
// Note [reuse fences]: a block handed to an asynchronous copy gets a fence
// (SetReuseFence, e.g. a CUDA event recorded after the copy). A returned block whose
// fence is not ready waits in its class and is reused, or trimmed, only once it is.
//
// Thread-safety: Allocate, Free, Trim and stats may be called concurrently. A
// PinnedBlock is owned by one thread at a time.
// Lifetime: the pool must outlive its blocks, and the arena must outlive the pool.
#ifndef MEMASCEND_PINNED_POOL_H_
#define MEMASCEND_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/host_arena.h>
#include <memascend/memory_ledger.h>
#include <memascend/types.h>

namespace memascend {

class PinnedPool;

enum class PoolPolicy {
  kAdaptive,  // classes from the workload's sizes + geometric fallback (MemAscend)
  kPow2,      // PyTorch CachingHostAllocator rules (the baseline)
};
std::string_view ToString(PoolPolicy policy) noexcept;

struct PinnedPoolOptions {
  PoolPolicy policy = PoolPolicy::kAdaptive;
  // Byte sizes the workload will request (kAdaptive). Duplicates are fine.
  std::vector<std::size_t> expected_sizes;
  // Geometric classes per power of two for sizes not expected: a power of two, 1..64.
  int classes_per_doubling = 8;
  // Note [reclaim on miss]. Ignored by kPow2, which caches until Trim() as PyTorch does.
  bool reclaim_idle_on_miss = true;
  double idle_slack = 0.01;
  // Carve new blocks out of arena regions that are entirely free rather than unmapping
  // them and mapping exact ones. Fewer system calls and page faults, at the price of
  // holding more than the peak in use: for long-lived pools under a fixed budget (the
  // tensor store's). Off, the pool holds what Note [reclaim on miss] promises.
  bool reuse_free_regions = false;
  // Track every live block: Free() of a foreign pointer or a double free is a clear
  // kInvalidArgument, and idle blocks are poisoned for AddressSanitizer.
  bool debug_checks = false;
};

struct PoolClassStats {
  std::size_t block_bytes = 0;
  bool expected = false;  // derived from expected_sizes (vs geometric or power of two)
  std::size_t in_use = 0;
  std::size_t idle = 0;
  std::size_t fenced = 0;  // returned, waiting for their fence
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
};

struct PinnedPoolStats {
  std::size_t live_bytes = 0;  // requested by callers, blocks in use
  std::size_t held_bytes = 0;  // capacity of every block the pool holds (in use, idle, fenced)
  std::size_t live_peak_bytes = 0;
  std::size_t held_peak_bytes = 0;
  std::size_t in_use_peak_bytes = 0;  // capacity of blocks in use at once, at peak
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t reclaimed_blocks = 0;   // idle blocks given back to the arena on misses
  std::uint64_t arena_calls = 0;        // misses served by the arena (hole or growth)
  std::vector<PoolClassStats> classes;  // classes that ever held a block
};

// A block from the pool: move-only; returned to its class on destruction.
class PinnedBlock {
 public:
  PinnedBlock() noexcept = default;
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock();

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }  // bytes requested
  std::size_t capacity() const noexcept;               // bytes of the block
  Use use() const noexcept { return use_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  // The block is reused only after `fence` is ready (Note [reuse fences]). Replaces a
  // previous fence.
  void SetReuseFence(std::unique_ptr<ReuseFence> fence) noexcept { fence_ = std::move(fence); }

  // Returns the block to the pool now (the destructor does the same).
  void Reset() noexcept;

  // Gives up ownership: the caller must later call PinnedPool::Free(data, size) with
  // the same size. For handing blocks to code that keeps raw pointers.
  [[nodiscard]] std::byte* Release() noexcept;

 private:
  friend class PinnedPool;
  PinnedBlock(PinnedPool* pool, std::byte* data, std::size_t size, int cls, Use use) noexcept
      : pool_(pool), data_(data), size_(size), cls_(cls), use_(use) {}

  PinnedPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  int cls_ = -1;
  Use use_ = Use::kStaging;
  std::unique_ptr<ReuseFence> fence_;
};

class PinnedPool {
 public:
  // kInvalidArgument for a bad classes_per_doubling, a negative idle_slack, or an
  // expected size of 0.
  static absl::StatusOr<std::unique_ptr<PinnedPool>> Create(HostArena* arena,
                                                            PinnedPoolOptions options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of at least `bytes` (capacity per Note [size classes]). kInvalidArgument
  // for 0 bytes; kResourceExhausted when the arena's budget cannot hold another block
  // even after idle blocks are given back.
  absl::StatusOr<PinnedBlock> Allocate(std::size_t bytes, Use use = Use::kStaging);

  // Returns a block taken with PinnedBlock::Release(). `bytes` is the size it was
  // allocated with. With debug_checks, a pointer that is not a live block of this pool
  // (foreign, or freed twice) or a wrong size is kInvalidArgument and changes nothing;
  // without, only misalignment is detected.
  absl::Status Free(void* data, std::size_t bytes, Use use = Use::kStaging,
                    std::unique_ptr<ReuseFence> fence = nullptr);

  // Gives every idle block (fences ready) back to the arena; returns the bytes.
  std::size_t Trim();

  // The capacity a request of `bytes` gets (0 for 0 bytes).
  std::size_t BlockBytesFor(std::size_t bytes) const noexcept;

  PinnedPoolStats stats() const;
  PoolPolicy policy() const noexcept;
  HostArena* arena() const noexcept;

 private:
  friend class PinnedBlock;
  struct Impl;
  explicit PinnedPool(std::unique_ptr<Impl> impl);
  void Return(std::byte* data, std::size_t size, int cls, Use use,
              std::unique_ptr<ReuseFence> fence) noexcept;
  std::size_t ClassBytes(int cls) const noexcept;

  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_PINNED_POOL_H_
