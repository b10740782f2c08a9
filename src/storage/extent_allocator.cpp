#include "storage/extent_allocator.h"

#include <fmt/format.h>

namespace memascend::storage {

ExtentAllocator::ExtentAllocator(std::uint64_t units) : total_(units), free_(0) {
  if (units > 0) Insert(0, units);
  free_ = units;
}

void ExtentAllocator::Extend(std::uint64_t units) {
  if (units <= total_) return;
  const Extent added{total_, units - total_};
  total_ = units;
  (void)Free(std::span<const Extent>(&added, 1));  // coalesces with a free run at the end
}

void ExtentAllocator::Insert(std::uint64_t start, std::uint64_t units) {
  by_start_.emplace(start, units);
  by_size_.emplace(units, start);
}

void ExtentAllocator::Erase(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_start_.erase(it);
}

std::uint64_t ExtentAllocator::largest_free() const noexcept {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

double ExtentAllocator::fragmentation() const noexcept {
  return free_ == 0 ? 0.0 : 1.0 - static_cast<double>(largest_free()) / static_cast<double>(free_);
}

bool ExtentAllocator::IsFree(const Extent& e) const {
  auto it = by_start_.upper_bound(e.start);
  if (it == by_start_.begin()) return false;
  --it;
  return e.start >= it->first && e.start + e.units <= it->first + it->second;
}

void ExtentAllocator::Take(std::uint64_t start, std::uint64_t units) {
  auto it = std::prev(by_start_.upper_bound(start));
  const std::uint64_t fs = it->first, fu = it->second;
  Erase(it);
  if (start > fs) Insert(fs, start - fs);
  if (start + units < fs + fu) Insert(start + units, fs + fu - start - units);
  free_ -= units;
}

absl::StatusOr<std::vector<Extent>> ExtentAllocator::Allocate(std::uint64_t units,
                                                              std::size_t max_extents) {
  if (units == 0) return std::vector<Extent>{};
  if (units > free_) {
    return absl::ResourceExhaustedError(
        fmt::format("volume full: {} units asked, {} free", units, free_));
  }
  if (auto fit = by_size_.lower_bound({units, 0}); fit != by_size_.end()) {
    const std::uint64_t start = fit->second;
    Take(start, units);
    return std::vector<Extent>{{start, units}};
  }
  // No single extent: the largest ones first, so the object gets as few pieces as can be.
  std::vector<Extent> picked;
  std::uint64_t covered = 0;
  for (auto it = by_size_.rbegin(); it != by_size_.rend() && covered < units; ++it) {
    if (picked.size() == max_extents) break;
    const std::uint64_t take = std::min(it->first, units - covered);
    picked.push_back({it->second, take});
    covered += take;
  }
  if (covered < units) {
    return absl::ResourceExhaustedError(
        fmt::format("volume too fragmented: {} units need more than {} extents (largest free {})",
                    units, max_extents, largest_free()));
  }
  for (const Extent& e : picked) Take(e.start, e.units);
  return picked;
}

absl::Status ExtentAllocator::Free(std::span<const Extent> extents) {
  for (const Extent& e : extents) {
    if (e.units == 0 || e.start + e.units > total_ || e.start + e.units < e.start) {
      return absl::InternalError(
          fmt::format("free of extent [{}, +{}) out of range", e.start, e.units));
    }
    auto next = by_start_.lower_bound(e.start);
    if ((next != by_start_.end() && next->first < e.start + e.units) ||
        (next != by_start_.begin() && std::prev(next)->first + std::prev(next)->second > e.start)) {
      return absl::InternalError(fmt::format("extent [{}, +{}) freed twice", e.start, e.units));
    }
  }
  for (const Extent& e : extents) {
    std::uint64_t start = e.start, units = e.units;
    auto next = by_start_.find(start + units);
    if (next != by_start_.end()) {
      units += next->second;
      Erase(next);
    }
    auto after = by_start_.lower_bound(start);
    if (after != by_start_.begin()) {
      auto prev = std::prev(after);
      if (prev->first + prev->second == start) {
        start = prev->first;
        units += prev->second;
        Erase(prev);
      }
    }
    Insert(start, units);
    free_ += e.units;
  }
  return absl::OkStatus();
}

absl::Status ExtentAllocator::Reserve(std::span<const Extent> extents) {
  for (const Extent& e : extents) {
    if (e.units == 0 || e.start + e.units > total_ || e.start + e.units < e.start) {
      return absl::DataLossError(
          fmt::format("extent [{}, +{}) lies outside the data region", e.start, e.units));
    }
    if (!IsFree(e)) {
      return absl::DataLossError(
          fmt::format("extent [{}, +{}) is claimed twice", e.start, e.units));
    }
    Take(e.start, e.units);
  }
  return absl::OkStatus();
}

absl::Status ExtentAllocator::CheckInvariants() const {
  if (by_start_.size() != by_size_.size())
    return absl::InternalError("free indexes differ in size");
  std::uint64_t sum = 0, end = 0;
  bool first = true;
  for (const auto& [start, units] : by_start_) {
    if (units == 0 || !by_size_.contains({units, start}))
      return absl::InternalError("index mismatch");
    if (!first && start <= end)
      return absl::InternalError(fmt::format("free extents touch at {}", start));
    end = start + units;
    first = false;
    sum += units;
  }
  if (end > total_) return absl::InternalError("free extent past the end");
  if (sum != free_) return absl::InternalError("free counter disagrees");
  return absl::OkStatus();
}

}  // namespace memascend::storage
