// prim/memory.h: page-locked memory regions and process memory readings.
#ifndef MEMASCEND_SRC_PRIM_MEMORY_H_
#define MEMASCEND_SRC_PRIM_MEMORY_H_

#include <cstddef>
#include <cstdint>

#include <absl/status/statusor.h>

namespace memascend::prim {

enum class RegionBacking {
  kCudaRegistered,  // mmap + cudaHostRegister (page-locked and known to the GPU driver)
  kMlock,           // mmap + mlock
  kUnlocked,        // mmap alone (ordinary memory)
  kAccounting,      // address space only (PROT_NONE, MAP_NORESERVE): for simulations
};

struct RegionOptions {
  RegionBacking backing = RegionBacking::kMlock;
  int numa_node = -1;  // bind pages to this node before locking; -1: no binding
};

// One mmap'ed region, locked or registered per its backing; unlocked, unregistered
// and unmapped on destruction. Move-only. Thread-safety: none (an owner at a time).
class MappedRegion {
 public:
  // `bytes` must be a positive multiple of the page size. Errors name the limit that
  // failed (RLIMIT_MEMLOCK for mlock, the CUDA error for registration) and how to
  // raise it; kResourceExhausted when the memory is not to be had.
  static absl::StatusOr<MappedRegion> Map(std::size_t bytes, const RegionOptions& options);

  MappedRegion() noexcept = default;
  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  RegionBacking backing() const noexcept { return backing_; }

 private:
  void Reset() noexcept;

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;  // size_ and the guard page (Note [region guard])
  RegionBacking backing_ = RegionBacking::kMlock;
};

// Resident set size of this process now, and its high-water mark (VmHWM), in bytes.
std::uint64_t CurrentRssBytes();
std::uint64_t PeakRssBytes();

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_MEMORY_H_
