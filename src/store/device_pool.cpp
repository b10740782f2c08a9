#include "store/device_pool.h"

#include <fmt/format.h>

#include <memascend/status.h>

#include "util/units.h"

namespace memascend::store {

DevicePool::DevicePool(prim::DeviceAllocation slab, MemoryLedger* ledger)
    : DevicePool(slab.data(), slab.size(), ledger) {
  slab_ = std::move(slab);
}

DevicePool::DevicePool(std::byte* base, std::size_t bytes, MemoryLedger* ledger)
    : base_(base), bytes_(bytes), ledger_(ledger), free_(bytes / kDeviceBlockBytes) {
  if (ledger_ != nullptr)
    ledger_->Update(Tier::kGpu, {{Use::kFree, 0, static_cast<std::int64_t>(bytes_)}});
}

DevicePool::~DevicePool() {
  if (ledger_ == nullptr) return;
  for (const auto& [start, block] : live_) {
    const auto b = static_cast<std::int64_t>(block.units * kDeviceBlockBytes);
    ledger_->Update(Tier::kGpu, {{block.use, -b, -b}, {Use::kFree, 0, b}});
  }
  ledger_->Update(Tier::kGpu, {{Use::kFree, 0, -static_cast<std::int64_t>(bytes_)}});
}

absl::StatusOr<std::byte*> DevicePool::Allocate(std::size_t bytes, Use use) {
  if (bytes == 0) return absl::InvalidArgumentError("device block of 0 bytes");
  const std::uint64_t units = (bytes + kDeviceBlockBytes - 1) / kDeviceBlockBytes;
  auto extents = free_.Allocate(units, /*max_extents=*/1);
  if (!extents.ok()) {
    return absl::ResourceExhaustedError(
        fmt::format("GPU tier: no free extent of {} (budget {}, free {}, largest free extent {})",
                    util::FormatBytes(units * kDeviceBlockBytes), util::FormatBytes(bytes_),
                    util::FormatBytes(bytes_ - allocated_), util::FormatBytes(largest_free())));
  }
  const std::uint64_t start = (*extents)[0].start;
  live_.emplace(start, Block{units, use});
  allocated_ += units * kDeviceBlockBytes;
  if (ledger_ != nullptr) {
    const auto b = static_cast<std::int64_t>(units * kDeviceBlockBytes);
    ledger_->Update(Tier::kGpu, {{use, b, b}, {Use::kFree, 0, -b}});
  }
  return base_ + start * kDeviceBlockBytes;
}

absl::Status DevicePool::Free(std::byte* block) {
  if (block < base_ || block >= base_ + bytes_ ||
      static_cast<std::size_t>(block - base_) % kDeviceBlockBytes != 0) {
    return absl::InvalidArgumentError("DevicePool::Free: not a block of this pool");
  }
  const std::uint64_t start = static_cast<std::uint64_t>(block - base_) / kDeviceBlockBytes;
  auto it = live_.find(start);
  if (it == live_.end())
    return absl::InvalidArgumentError("DevicePool::Free: not a live block (freed twice?)");
  const storage::Extent e{start, it->second.units};
  MEMASCEND_RETURN_IF_ERROR(free_.Free({&e, 1}));
  allocated_ -= e.units * kDeviceBlockBytes;
  if (ledger_ != nullptr) {
    const auto b = static_cast<std::int64_t>(e.units * kDeviceBlockBytes);
    ledger_->Update(Tier::kGpu, {{it->second.use, -b, -b}, {Use::kFree, 0, b}});
  }
  live_.erase(it);
  return absl::OkStatus();
}

std::size_t DevicePool::largest_free() const noexcept {
  return free_.largest_free() * kDeviceBlockBytes;
}

absl::Status DevicePool::CheckInvariants() const {
  MEMASCEND_RETURN_IF_ERROR(free_.CheckInvariants());
  std::uint64_t units = 0;
  for (const auto& [start, block] : live_) units += block.units;
  if (units * kDeviceBlockBytes != allocated_ ||
      free_.free_units() + units != free_.total_units()) {
    return absl::InternalError(fmt::format("device pool: {} live units, {} free of {}", units,
                                           free_.free_units(), free_.total_units()));
  }
  return absl::OkStatus();
}

}  // namespace memascend::store
