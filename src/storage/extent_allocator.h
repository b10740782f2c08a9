// storage/extent_allocator.h: free space of a volume's data region, in allocation units.
#ifndef MEMASCEND_SRC_STORAGE_EXTENT_ALLOCATOR_H_
#define MEMASCEND_SRC_STORAGE_EXTENT_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <vector>

#include <absl/status/statusor.h>

#include "storage/format.h"

namespace memascend::storage {

// Best fit over free extents, coalescing on free, exact accounting.
// Thread-safety: none (the volume serialises it).
class ExtentAllocator {
 public:
  explicit ExtentAllocator(std::uint64_t units);

  // `units` as one extent (best fit) when one is large enough, else the largest free
  // extents until covered (at most `max_extents`). kResourceExhausted, and nothing
  // changes, when the free space cannot cover it.
  absl::StatusOr<std::vector<Extent>> Allocate(std::uint64_t units,
                                               std::size_t max_extents = kMaxExtents);

  // Returns extents. kInternal, and nothing changes, if any part is already free or
  // out of range (the caller's bookkeeping is broken).
  absl::Status Free(std::span<const Extent> extents);

  // Marks extents used (rebuilding free space from the journal). kDataLoss if any
  // part is out of range or already used (two objects claim the same units).
  absl::Status Reserve(std::span<const Extent> extents);

  // More units at the end, free (a grown volume). Nothing changes for fewer.
  void Extend(std::uint64_t units);

  std::uint64_t total_units() const noexcept { return total_; }
  std::uint64_t free_units() const noexcept { return free_; }
  std::uint64_t largest_free() const noexcept;
  // 1 - largest free extent / free space: 0 when all free space is one extent.
  double fragmentation() const noexcept;
  std::size_t free_extents() const noexcept { return by_start_.size(); }

  // Walks both indexes; kInternal on the first inconsistency.
  absl::Status CheckInvariants() const;

 private:
  bool IsFree(const Extent& e) const;
  void Insert(std::uint64_t start, std::uint64_t units);
  void Erase(std::map<std::uint64_t, std::uint64_t>::iterator it);
  void Take(std::uint64_t start,
            std::uint64_t units);  // [start, start+units) lies in one free extent

  std::uint64_t total_;
  std::uint64_t free_;
  std::map<std::uint64_t, std::uint64_t> by_start_;            // start -> units
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (units, start)
};

}  // namespace memascend::storage

#endif  // MEMASCEND_SRC_STORAGE_EXTENT_ALLOCATOR_H_
