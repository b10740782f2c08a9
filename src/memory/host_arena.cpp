#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/host_arena.h>

#include "prim/cuda.h"
#include "prim/memory.h"
#include "prim/os.h"
#include "util/align.h"
#include "util/units.h"

namespace memascend {

std::string_view ToString(ArenaBacking backing) noexcept {
  switch (backing) {
    case ArenaBacking::kAuto:
      return "auto";
    case ArenaBacking::kCudaRegistered:
      return "cuda_registered";
    case ArenaBacking::kMlock:
      return "mlock";
    case ArenaBacking::kUnlocked:
      return "unlocked";
    case ArenaBacking::kAccounting:
      return "accounting";
  }
  return "unknown";
}

namespace {

using util::RoundUp;

prim::RegionBacking ToRegionBacking(ArenaBacking backing) {
  switch (backing) {
    case ArenaBacking::kCudaRegistered:
      return prim::RegionBacking::kCudaRegistered;
    case ArenaBacking::kAccounting:
      return prim::RegionBacking::kAccounting;
    case ArenaBacking::kUnlocked:
      return prim::RegionBacking::kUnlocked;
    case ArenaBacking::kMlock:
    case ArenaBacking::kAuto:
      break;
  }
  return prim::RegionBacking::kMlock;
}

bool CountsAsLive(Use use) { return use != Use::kCached && use != Use::kFree; }

}  // namespace

struct HostArena::Impl {
  struct Region {
    prim::MappedRegion mem;
    std::size_t allocated = 0;
    std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(mem.data()); }
    std::uintptr_t end() const { return begin() + mem.size(); }
  };
  struct FreeExtent {
    std::size_t size;
    Region* region;
  };
  struct Live {
    std::size_t size;       // carved
    std::size_t requested;  // asked for
    Use use;
    Region* region;
  };

  HostArenaOptions options;
  mutable absl::Mutex mu;
  std::map<std::uintptr_t, std::unique_ptr<Region>> regions ABSL_GUARDED_BY(mu);
  std::map<std::uintptr_t, FreeExtent> free_by_addr ABSL_GUARDED_BY(mu);
  std::set<std::pair<std::size_t, std::uintptr_t>> free_by_size ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uintptr_t, Live> live ABSL_GUARDED_BY(mu);
  std::size_t mapped ABSL_GUARDED_BY(mu) = 0;
  std::size_t mapped_peak ABSL_GUARDED_BY(mu) = 0;
  std::size_t allocated ABSL_GUARDED_BY(mu) = 0;
  std::uint64_t regions_mapped_total ABSL_GUARDED_BY(mu) = 0;

  void Report(std::initializer_list<LedgerDelta> deltas) {
    if (options.ledger != nullptr) options.ledger->Update(Tier::kPinnedHost, deltas);
  }

  void InsertFree(std::uintptr_t addr, std::size_t size, Region* region)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    free_by_addr.emplace(addr, FreeExtent{size, region});
    free_by_size.emplace(size, addr);
  }
  void EraseFree(std::map<std::uintptr_t, FreeExtent>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    free_by_size.erase({it->second.size, it->first});
    free_by_addr.erase(it);
  }

  // Frees [addr, addr+size) of `region`, merging with free neighbours in that region.
  void AddFreeCoalesced(std::uintptr_t addr, std::size_t size, Region* region)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto next = free_by_addr.find(addr + size);
    if (next != free_by_addr.end() && next->second.region == region) {
      size += next->second.size;
      EraseFree(next);
    }
    auto after = free_by_addr.lower_bound(addr);
    if (after != free_by_addr.begin()) {
      auto prev = std::prev(after);
      if (prev->second.region == region && prev->first + prev->second.size == addr) {
        addr = prev->first;
        size += prev->second.size;
        EraseFree(prev);
      }
    }
    InsertFree(addr, size, region);
  }

  ArenaAllocation Carve(std::uintptr_t addr, std::size_t rounded, std::size_t requested, Use use)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = free_by_addr.find(addr);
    const FreeExtent extent = it->second;
    EraseFree(it);
    if (extent.size > rounded) InsertFree(addr + rounded, extent.size - rounded, extent.region);
    live.emplace(addr, Live{rounded, requested, use, extent.region});
    extent.region->allocated += rounded;
    allocated += rounded;
    Report({{Use::kFree, 0, -static_cast<std::int64_t>(rounded)},
            {use, CountsAsLive(use) ? static_cast<std::int64_t>(requested) : 0,
             static_cast<std::int64_t>(rounded)}});
    return ArenaAllocation{reinterpret_cast<std::byte*>(addr), rounded};
  }

  std::size_t ReleaseFreeRegionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::size_t released = 0;
    for (auto it = regions.begin(); it != regions.end();) {
      Region* region = it->second.get();
      if (region->allocated != 0) {
        ++it;
        continue;
      }
      // An empty region is one coalesced free extent.
      EraseFree(free_by_addr.find(region->begin()));
      released += region->mem.size();
      mapped -= region->mem.size();
      it = regions.erase(it);
    }
    if (released > 0) Report({{Use::kFree, 0, -static_cast<std::int64_t>(released)}});
    return released;
  }

  std::size_t LargestFreeLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return free_by_size.empty() ? 0 : free_by_size.rbegin()->first;
  }

  // Best fit; with !split_free_regions, skips entirely free regions larger than needed.
  std::optional<std::uintptr_t> FindFit(std::size_t rounded, bool split_free_regions) const
      ABSL_SHARED_LOCKS_REQUIRED(mu) {
    for (auto it = free_by_size.lower_bound({rounded, 0}); it != free_by_size.end(); ++it) {
      if (split_free_regions || it->first == rounded) return it->second;
      const Region* region = free_by_addr.at(it->second).region;
      if (region->allocated != 0) return it->second;  // a fragment: filling it costs nothing
    }
    return std::nullopt;
  }

  absl::StatusOr<ArenaAllocation> Allocate(std::size_t bytes, Use use, bool allow_growth,
                                           bool split_free_regions) {
    if (bytes == 0) return absl::InvalidArgumentError("host arena: cannot allocate 0 bytes");
    if (bytes > options.budget_bytes) {
      return absl::ResourceExhaustedError(
          fmt::format("host arena: {} requested exceeds the whole budget of {}",
                      util::FormatBytes(bytes), util::FormatBytes(options.budget_bytes)));
    }
    const std::size_t rounded = RoundUp(bytes, kHostBlockBytes);
    absl::MutexLock lock(&mu);
    if (const auto fit = FindFit(rounded, split_free_regions)) {
      return Checked(Carve(*fit, rounded, bytes, use));
    }
    if (!allow_growth) {
      return absl::ResourceExhaustedError(
          fmt::format("host arena: no free extent holds {} (largest free extent {})",
                      util::FormatBytes(rounded), util::FormatBytes(LargestFreeLocked())));
    }
    ReleaseFreeRegionsLocked();  // Note [arena growth]
    const std::size_t page = prim::PageSize();
    const std::size_t left = (options.budget_bytes - mapped) / page * page;
    if (rounded > left) {
      return absl::ResourceExhaustedError(fmt::format(
          "host arena budget exhausted: {} requested, {} of the {} budget held ({} free in "
          "fragments, largest {}); free memory or raise the budget",
          util::FormatBytes(rounded), util::FormatBytes(mapped),
          util::FormatBytes(options.budget_bytes), util::FormatBytes(mapped - allocated),
          util::FormatBytes(LargestFreeLocked())));
    }
    const std::size_t want = std::min(std::max(RoundUp(rounded, page), options.chunk_bytes), left);
    auto mem = prim::MappedRegion::Map(
        want, prim::RegionOptions{ToRegionBacking(options.backing), options.numa_node});
    if (!mem.ok()) {
      return absl::Status(mem.status().code(),
                          fmt::format("host arena: growing by {}: {}", util::FormatBytes(want),
                                      std::string(mem.status().message())));
    }
    auto region = std::make_unique<Region>();
    region->mem = *std::move(mem);
    Region* raw = region.get();
    regions.emplace(raw->begin(), std::move(region));
    mapped += want;
    mapped_peak = std::max(mapped_peak, mapped);
    ++regions_mapped_total;
    Report({{Use::kFree, 0, static_cast<std::int64_t>(want)}});
    InsertFree(raw->begin(), want, raw);
    return Checked(Carve(raw->begin(), rounded, bytes, use));
  }

  // With debug_checks, walks every map after an operation and stops at corruption.
  void DebugCheckLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (!options.debug_checks) return;
    const absl::Status s = CheckInvariantsLocked();
    if (!s.ok()) {
      std::fprintf(stderr, "memascend: host arena corrupt: %s\n", s.ToString().c_str());
      std::abort();
    }
  }

  ArenaAllocation Checked(ArenaAllocation a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    DebugCheckLocked();
    return a;
  }

  absl::Status CheckInvariantsLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (free_by_addr.size() != free_by_size.size()) {
      return absl::InternalError("free maps disagree in size");
    }
    struct Piece {
      std::uintptr_t addr;
      std::size_t size;
      bool free;
      const Region* region;
    };
    std::vector<Piece> pieces;
    std::size_t live_sum = 0;
    for (const auto& [addr, e] : free_by_addr) {
      if (!free_by_size.contains({e.size, addr})) {
        return absl::InternalError(fmt::format("extent {:#x} missing from size index", addr));
      }
      pieces.push_back({addr, e.size, true, e.region});
    }
    for (const auto& [addr, l] : live) {
      pieces.push_back({addr, l.size, false, l.region});
      live_sum += l.size;
    }
    if (live_sum != allocated) return absl::InternalError("allocated counter disagrees");
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.addr < b.addr; });
    std::size_t mapped_sum = 0;
    auto p = pieces.begin();
    for (const auto& [begin, region] : regions) {
      mapped_sum += region->mem.size();
      std::uintptr_t cursor = region->begin();
      std::size_t region_live = 0;
      bool prev_free = false;
      for (; p != pieces.end() && p->addr < region->end(); ++p) {
        if (p->region != region.get() || p->addr != cursor) {
          return absl::InternalError(fmt::format("gap or overlap at {:#x}", p->addr));
        }
        if (p->free && prev_free) {
          return absl::InternalError(fmt::format("uncoalesced free extents at {:#x}", p->addr));
        }
        prev_free = p->free;
        if (!p->free) region_live += p->size;
        cursor += p->size;
      }
      if (cursor != region->end()) return absl::InternalError("region not fully covered");
      if (region_live != region->allocated) return absl::InternalError("region counter disagrees");
    }
    if (p != pieces.end()) return absl::InternalError("extent outside every region");
    if (mapped_sum != mapped) return absl::InternalError("mapped counter disagrees");
    return absl::OkStatus();
  }
};

HostArena::HostArena(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HostArena::~HostArena() {
  absl::MutexLock lock(&impl_->mu);
  // Whatever is still carved or free leaves the ledger with the arena.
  for (const auto& [addr, l] : impl_->live) {
    impl_->Report({{l.use, CountsAsLive(l.use) ? -static_cast<std::int64_t>(l.requested) : 0,
                    -static_cast<std::int64_t>(l.size)}});
  }
  impl_->Report({{Use::kFree, 0, -static_cast<std::int64_t>(impl_->mapped - impl_->allocated)}});
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(const HostArenaOptions& options) {
  if (options.budget_bytes == 0) {
    return absl::InvalidArgumentError("host arena: budget_bytes must be positive");
  }
  if (options.chunk_bytes % prim::PageSize() != 0) {
    return absl::InvalidArgumentError(
        fmt::format("host arena: chunk_bytes {} is not a multiple of the page size {}",
                    options.chunk_bytes, prim::PageSize()));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.backing == ArenaBacking::kAuto) {
    impl->options.backing = prim::ProbeCuda(false).device_count > 0 ? ArenaBacking::kCudaRegistered
                                                                    : ArenaBacking::kMlock;
  }
  if (impl->options.backing == ArenaBacking::kCudaRegistered) {
    const CudaInfo cuda = prim::ProbeCuda(false);
    if (cuda.device_count == 0) {
      return absl::FailedPreconditionError(
          fmt::format("host arena: CUDA-registered backing needs a CUDA device ({})", cuda.status));
    }
  }
  return std::unique_ptr<HostArena>(new HostArena(std::move(impl)));
}

absl::StatusOr<ArenaAllocation> HostArena::Allocate(std::size_t bytes, Use attribute,
                                                    bool split_free_regions) {
  return impl_->Allocate(bytes, attribute, /*allow_growth=*/true, split_free_regions);
}

absl::StatusOr<ArenaAllocation> HostArena::AllocateFromFree(std::size_t bytes, Use attribute,
                                                            bool split_free_regions) {
  return impl_->Allocate(bytes, attribute, /*allow_growth=*/false, split_free_regions);
}

absl::Status HostArena::Free(void* data) {
  Impl& m = *impl_;
  const auto addr = reinterpret_cast<std::uintptr_t>(data);
  absl::MutexLock lock(&m.mu);
  const auto it = m.live.find(addr);
  if (it == m.live.end()) {
    auto region = m.regions.upper_bound(addr);
    const bool inside = region != m.regions.begin() && std::prev(region)->second->end() > addr;
    return absl::InvalidArgumentError(
        fmt::format("host arena: {} is {}", data,
                    inside ? "not the start of a live allocation (interior pointer, or freed twice)"
                           : "not from this arena"));
  }
  const Impl::Live l = it->second;
  m.live.erase(it);
  l.region->allocated -= l.size;
  m.allocated -= l.size;
  m.AddFreeCoalesced(addr, l.size, l.region);
  m.Report({{l.use, CountsAsLive(l.use) ? -static_cast<std::int64_t>(l.requested) : 0,
             -static_cast<std::int64_t>(l.size)},
            {Use::kFree, 0, static_cast<std::int64_t>(l.size)}});
  m.DebugCheckLocked();
  return absl::OkStatus();
}

std::size_t HostArena::ReleaseFreeRegions() {
  absl::MutexLock lock(&impl_->mu);
  return impl_->ReleaseFreeRegionsLocked();
}

HostArenaStats HostArena::stats() const {
  absl::MutexLock lock(&impl_->mu);
  HostArenaStats s;
  s.budget_bytes = impl_->options.budget_bytes;
  s.mapped_bytes = impl_->mapped;
  s.mapped_peak_bytes = impl_->mapped_peak;
  s.allocated_bytes = impl_->allocated;
  s.free_bytes = impl_->mapped - impl_->allocated;
  s.largest_free_extent = impl_->LargestFreeLocked();
  s.regions = impl_->regions.size();
  s.allocations = impl_->live.size();
  s.regions_mapped_total = impl_->regions_mapped_total;
  return s;
}

std::vector<std::span<std::byte>> HostArena::Regions() const {
  absl::MutexLock lock(&impl_->mu);
  std::vector<std::span<std::byte>> out;
  for (const auto& [begin, region] : impl_->regions)
    out.emplace_back(region->mem.data(), region->mem.size());
  return out;
}

ArenaBacking HostArena::backing() const noexcept { return impl_->options.backing; }
std::size_t HostArena::budget_bytes() const noexcept { return impl_->options.budget_bytes; }
MemoryLedger* HostArena::ledger() const noexcept { return impl_->options.ledger; }

absl::Status HostArena::CheckInvariants() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->CheckInvariantsLocked();
}

}  // namespace memascend
