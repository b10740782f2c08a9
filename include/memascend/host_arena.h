// memascend/host_arena.h: page-locked host memory in large regions, carved to exact sizes.
//
// The arena maps page-locked regions (CUDA-registered when a GPU is present, so GPU
// copies are true DMA; else mmap + mlock; or address space only, for simulations) and
// carves them into allocations aligned and sized to the direct-I/O block (4 KiB):
// never rounded to powers of two. Frees coalesce with free neighbours of the same
// region. The arena grows a region at a time up to a hard budget.
//
//   memascend::HostArenaOptions options;
//   options.budget_bytes = 8ull << 30;
//   MEMASCEND_ASSIGN_OR_RETURN(auto arena, memascend::HostArena::Create(options));
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::ArenaAllocation a, arena->Allocate(10'000));
//   // a.size == 12288, a.data is 4 KiB-aligned and page-locked
//   MEMASCEND_RETURN_IF_ERROR(arena->Free(a.data));
//
// Note [arena growth]: a request that no free extent can hold first gives back the
// regions that are entirely free (they were too small to hold it), then maps a new
// region of max(request, chunk_bytes), clipped to what is left of the budget. So the
// bytes held stay close to the bytes carved, and the budget is never exceeded: past
// it, Allocate() returns kResourceExhausted saying how much is held and free.
//
// Thread-safety: all methods may be called concurrently (one internal mutex; the
// pinned pool keeps the arena off its hit path).
// Lifetime: allocations are valid until freed or until the arena is destroyed; the
// arena must outlive every pool built on it.
#ifndef MEMASCEND_HOST_ARENA_H_
#define MEMASCEND_HOST_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/memory_ledger.h>
#include <memascend/system.h>

namespace memascend {

// The direct-I/O block: every allocation is aligned to it and a multiple of it.
inline constexpr std::size_t kHostBlockBytes = 4096;

enum class ArenaBacking {
  kAuto,            // kCudaRegistered when a CUDA device is present, else kMlock
  kCudaRegistered,  // mmap + cudaHostRegister
  kMlock,           // mmap + mlock
  kUnlocked,        // mmap alone: ordinary memory the kernel may swap (RLIMIT_MEMLOCK too
                    // small to lock the budget: Note [default host budget], host_budget.h)
  kAccounting,      // address space only (PROT_NONE): the allocator logic without the
                    // memory, to simulate 70B-parameter workloads on a small machine
};
std::string_view ToString(ArenaBacking backing) noexcept;

struct HostArenaOptions {
  ArenaBacking backing = ArenaBacking::kAuto;
  std::size_t budget_bytes = 0;         // hard cap on bytes held (required, > 0)
  std::size_t chunk_bytes = 64u << 20;  // growth step; 0: each region exactly the request
  int numa_node = -1;                   // bind regions to this NUMA node; -1: no binding
  MemoryLedger* ledger = nullptr;       // reports held bytes under Tier::kPinnedHost
  bool debug_checks = false;            // walk the extent maps after every operation
};

struct ArenaAllocation {
  std::byte* data = nullptr;
  std::size_t size = 0;  // bytes carved: the request rounded up to kHostBlockBytes
};

struct HostArenaStats {
  std::size_t budget_bytes = 0;
  std::size_t mapped_bytes = 0;  // held from the OS now
  std::size_t mapped_peak_bytes = 0;
  std::size_t allocated_bytes = 0;  // carved into live allocations
  std::size_t free_bytes = 0;       // mapped_bytes - allocated_bytes
  std::size_t largest_free_extent = 0;
  std::size_t regions = 0;
  std::size_t allocations = 0;
  std::uint64_t regions_mapped_total = 0;  // over the arena's life
};

class HostArena {
 public:
  // kInvalidArgument for a zero budget or a chunk that is not a page multiple;
  // kFailedPrecondition for kCudaRegistered without CUDA. Maps nothing yet.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(const HostArenaOptions& options);

  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Best fit among free extents, else growth (Note [arena growth]). `attribute` is the
  // use the ledger files the bytes under until Free(). kInvalidArgument for 0 bytes;
  // kResourceExhausted past the budget or when the OS refuses to lock more (the
  // message names RLIMIT_MEMLOCK and how to raise it). A failed call changes nothing.
  // split_free_regions: see AllocateFromFree().
  absl::StatusOr<ArenaAllocation> Allocate(std::size_t bytes, Use attribute = Use::kStaging,
                                           bool split_free_regions = true);

  // As Allocate(), but never maps a new region: kResourceExhausted if no free extent
  // fits. With split_free_regions == false, a region that is entirely free is taken only
  // if it fits exactly: splitting it would leave a remainder that pins the whole region,
  // where growth would instead unmap it and map exactly what is needed (the pinned pool
  // uses this on its miss path).
  absl::StatusOr<ArenaAllocation> AllocateFromFree(std::size_t bytes, Use attribute = Use::kStaging,
                                                   bool split_free_regions = true);

  // Returns an allocation. kInvalidArgument, and nothing changes, for a pointer that is
  // not the start of a live allocation of this arena (foreign, interior, or freed twice).
  absl::Status Free(void* data);

  // Unmaps every region that holds no allocation; returns the bytes given back.
  std::size_t ReleaseFreeRegions();

  HostArenaStats stats() const;
  // The regions mapped now, by address: what an I/O engine registers as fixed buffers
  // (IoEngine::RegisterBuffers). Growth and ReleaseFreeRegions() change the set.
  std::vector<std::span<std::byte>> Regions() const;
  ArenaBacking backing() const noexcept;  // resolved: never kAuto
  std::size_t budget_bytes() const noexcept;
  MemoryLedger* ledger() const noexcept;  // from the options; may be null

  // Walks the extent maps and checks every invariant (no overlap, coalesced neighbours,
  // counters agree). kInternal describing the first violation.
  absl::Status CheckInvariants() const;

 private:
  struct Impl;
  explicit HostArena(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_HOST_ARENA_H_
