#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdio>
#include <deque>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/pinned_pool.h>

#include "util/align.h"
#include "util/units.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MEMASCEND_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define MEMASCEND_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define MEMASCEND_POISON(p, n) ((void)(p), (void)(n))
#define MEMASCEND_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace memascend {

std::string_view ToString(PoolPolicy policy) noexcept {
  switch (policy) {
    case PoolPolicy::kAdaptive:
      return "adaptive";
    case PoolPolicy::kPow2:
      return "pow2";
  }
  return "unknown";
}

namespace {

using util::RoundUp;
constexpr int kBlockShift = 12;  // log2(kHostBlockBytes)
static_assert(std::size_t{1} << kBlockShift == kHostBlockBytes);
constexpr int kMaxShift = 62;  // largest class: 4 EiB, far past any budget
constexpr std::size_t kMaxRequest = std::size_t{1} << kMaxShift;

void AtomicMax(std::atomic<std::size_t>& target, std::size_t value) {
  std::size_t cur = target.load(std::memory_order_relaxed);
  while (cur < value && !target.compare_exchange_weak(cur, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

struct PinnedPool::Impl {
  struct Class {
    std::size_t block_bytes = 0;
    bool expected = false;
    absl::Mutex mu;
    std::vector<std::byte*> idle ABSL_GUARDED_BY(mu);
    std::deque<std::pair<std::byte*, std::unique_ptr<ReuseFence>>> fenced ABSL_GUARDED_BY(mu);
    std::size_t in_use ABSL_GUARDED_BY(mu) = 0;
    std::uint64_t hits ABSL_GUARDED_BY(mu) = 0;
    std::uint64_t misses ABSL_GUARDED_BY(mu) = 0;
    std::atomic<std::uint64_t> last_use{0};  // pool tick of the latest allocation

    // Moves returned blocks whose fences are ready to the idle list.
    void PollFencesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      for (auto it = fenced.begin(); it != fenced.end();) {
        if (it->second->Ready()) {
          idle.push_back(it->first);
          it = fenced.erase(it);
        } else {
          ++it;
        }
      }
    }
  };

  HostArena* arena = nullptr;
  PinnedPoolOptions options;
  bool poison = false;
  int geo_log2_threshold = 0;  // log2(kHostBlockBytes * classes_per_doubling)
  std::size_t expected_count = 0;
  std::vector<std::unique_ptr<Class>> classes;  // immutable after Create()
  absl::flat_hash_map<std::size_t, int> exact;  // block bytes -> class (immutable)

  std::atomic<std::size_t> live{0}, held{0}, live_peak{0}, held_peak{0};
  std::atomic<std::size_t> in_use{0}, in_use_peak{0};  // block capacity
  std::atomic<std::uint64_t> hits{0}, misses{0}, reclaimed{0}, arena_calls{0}, tick{0};

  absl::Mutex live_mu;  // debug_checks only
  absl::flat_hash_map<const std::byte*, std::pair<int, std::size_t>> live_blocks
      ABSL_GUARDED_BY(live_mu);

  void Report(std::initializer_list<LedgerDelta> deltas) const {
    if (MemoryLedger* ledger = arena->ledger(); ledger != nullptr) {
      ledger->Update(Tier::kPinnedHost, deltas);
    }
  }

  // Class index for a request; -1 if too large. See Note [size classes].
  int ClassOf(std::size_t bytes) const noexcept {
    if (bytes == 0 || bytes > kMaxRequest) return -1;
    if (options.policy == PoolPolicy::kPow2) {
      const std::size_t block = std::bit_ceil(std::max(bytes, kHostBlockBytes));
      return std::countr_zero(block) - kBlockShift;
    }
    const std::size_t rounded = RoundUp(bytes, kHostBlockBytes);
    if (const auto it = exact.find(rounded); it != exact.end()) return it->second;
    const int d = options.classes_per_doubling;
    const std::size_t threshold = std::size_t{1} << geo_log2_threshold;
    if (rounded <= threshold) {
      return static_cast<int>(expected_count + rounded / kHostBlockBytes - 1);
    }
    const int k = std::bit_width(rounded - 1) - 1;  // 2^k < rounded <= 2^(k+1)
    const std::size_t base = std::size_t{1} << k;
    const std::size_t step = base / static_cast<std::size_t>(d);
    const std::size_t j = (rounded - base + step - 1) / step;  // 1..d
    return static_cast<int>(expected_count + static_cast<std::size_t>(d) +
                            static_cast<std::size_t>(k - geo_log2_threshold) * d + (j - 1));
  }

  void BuildClasses() {
    const auto add = [&](std::size_t block, bool expected) {
      auto c = std::make_unique<Class>();
      c->block_bytes = block;
      c->expected = expected;
      classes.push_back(std::move(c));
    };
    if (options.policy == PoolPolicy::kPow2) {
      for (int shift = kBlockShift; shift <= kMaxShift; ++shift)
        add(std::size_t{1} << shift, false);
      return;
    }
    std::vector<std::size_t> sizes;
    for (std::size_t s : options.expected_sizes) sizes.push_back(RoundUp(s, kHostBlockBytes));
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    for (std::size_t s : sizes) {
      exact.emplace(s, static_cast<int>(classes.size()));
      add(s, true);
    }
    expected_count = classes.size();
    const int d = options.classes_per_doubling;
    geo_log2_threshold = kBlockShift + std::countr_zero(static_cast<unsigned>(d));
    for (int i = 1; i <= d; ++i) add(kHostBlockBytes * static_cast<std::size_t>(i), false);
    for (int k = geo_log2_threshold; k < kMaxShift; ++k) {
      const std::size_t base = std::size_t{1} << k;
      for (int j = 1; j <= d; ++j) add(base + base / static_cast<std::size_t>(d) * j, false);
    }
  }

  // Gives idle (and ready fenced) blocks back to the arena, least recently used classes
  // first, until at least `want` bytes are given back; returns the bytes given back.
  std::size_t GiveBackIdle(std::size_t want = SIZE_MAX) {
    std::vector<Class*> order;
    for (const auto& c : classes) {
      if (c->last_use.load(std::memory_order_relaxed) != 0) order.push_back(c.get());
    }
    std::sort(order.begin(), order.end(), [](const Class* a, const Class* b) {
      return a->last_use.load(std::memory_order_relaxed) <
             b->last_use.load(std::memory_order_relaxed);
    });
    std::size_t given = 0;
    std::vector<std::byte*> blocks;
    for (Class* c : order) {
      if (given >= want) break;
      {
        absl::MutexLock lock(&c->mu);
        c->PollFencesLocked();
        while (!c->idle.empty() && given + blocks.size() * c->block_bytes < want) {
          blocks.push_back(c->idle.back());
          c->idle.pop_back();
        }
      }
      for (std::byte* p : blocks) {
        if (poison) MEMASCEND_UNPOISON(p, c->block_bytes);
        (void)arena->Free(p);  // our own block: the arena cannot refuse it
        held.fetch_sub(c->block_bytes, std::memory_order_relaxed);
        given += c->block_bytes;
      }
      blocks.clear();
    }
    return given;
  }

  // A block for a miss (Note [reclaim on miss]).
  absl::StatusOr<ArenaAllocation> NewBlock(std::size_t block) {
    arena_calls.fetch_add(1, std::memory_order_relaxed);
    const bool adaptive = options.policy == PoolPolicy::kAdaptive;
    if (adaptive) {
      auto hole = arena->AllocateFromFree(block, Use::kCached, options.reuse_free_regions);
      if (hole.ok()) return hole;
      if (options.reclaim_idle_on_miss) {
        const std::size_t peak = in_use_peak.load(std::memory_order_relaxed);
        const auto bound =
            static_cast<std::size_t>(static_cast<double>(peak) * (1.0 + options.idle_slack));
        const std::size_t after = held.load(std::memory_order_relaxed) + block;
        if (after > bound && GiveBackIdle(after - bound) > 0) {
          reclaimed.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    // pow2 grows plainly, as PyTorch does; adaptive never splits an empty region.
    const bool split = !adaptive || options.reuse_free_regions;
    auto grown = arena->Allocate(block, Use::kCached, split);
    if (grown.ok() || grown.status().code() != absl::StatusCode::kResourceExhausted || !adaptive) {
      return grown;
    }
    // Out of budget: idle blocks of any class are worth more as free space.
    if (GiveBackIdle() == 0) return grown;
    return arena->Allocate(block, Use::kCached, split);
  }
};

PinnedPool::PinnedPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PinnedPool::~PinnedPool() {
  std::size_t outstanding = 0;
  for (const auto& c : impl_->classes) {
    absl::MutexLock lock(&c->mu);
    outstanding += c->in_use;
    for (auto& [p, fence] : c->fenced) c->idle.push_back(p);  // destroyed: no copies in flight
    c->fenced.clear();
  }
  impl_->GiveBackIdle();
  if (outstanding > 0) {
    std::fprintf(stderr, "memascend: PinnedPool destroyed with %zu block(s) still in use\n",
                 outstanding);
  }
}

absl::StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(HostArena* arena,
                                                               PinnedPoolOptions options) {
  if (arena == nullptr) return absl::InvalidArgumentError("pinned pool: arena is null");
  const int d = options.classes_per_doubling;
  if (d < 1 || d > 64 || !std::has_single_bit(static_cast<unsigned>(d))) {
    return absl::InvalidArgumentError(fmt::format(
        "pinned pool: classes_per_doubling must be a power of two in 1..64, got {}", d));
  }
  if (!(options.idle_slack >= 0.0)) {
    return absl::InvalidArgumentError("pinned pool: idle_slack must be >= 0");
  }
  for (std::size_t s : options.expected_sizes) {
    if (s == 0 || s > kMaxRequest) {
      return absl::InvalidArgumentError(fmt::format("pinned pool: bad expected size {}", s));
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->arena = arena;
  impl->options = std::move(options);
  impl->poison = impl->options.debug_checks && arena->backing() != ArenaBacking::kAccounting;
  impl->BuildClasses();
  return std::unique_ptr<PinnedPool>(new PinnedPool(std::move(impl)));
}

absl::StatusOr<PinnedBlock> PinnedPool::Allocate(std::size_t bytes, Use use) {
  Impl& m = *impl_;
  const int cls = m.ClassOf(bytes);
  if (cls < 0) {
    return absl::InvalidArgumentError(
        bytes == 0 ? std::string("pinned pool: cannot allocate 0 bytes")
                   : fmt::format("pinned pool: {} bytes is past the largest class", bytes));
  }
  Impl::Class& c = *m.classes[static_cast<std::size_t>(cls)];
  c.last_use.store(m.tick.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  AtomicMax(m.in_use_peak,
            m.in_use.fetch_add(c.block_bytes, std::memory_order_relaxed) + c.block_bytes);
  std::byte* data = nullptr;
  {
    absl::MutexLock lock(&c.mu);
    if (!c.fenced.empty()) c.PollFencesLocked();
    if (!c.idle.empty()) {
      data = c.idle.back();
      c.idle.pop_back();
      ++c.in_use;
      ++c.hits;
    } else {
      ++c.misses;
    }
  }
  if (data != nullptr) {
    m.hits.fetch_add(1, std::memory_order_relaxed);
  } else {
    m.misses.fetch_add(1, std::memory_order_relaxed);
    auto fresh = m.NewBlock(c.block_bytes);
    if (!fresh.ok()) {
      m.in_use.fetch_sub(c.block_bytes, std::memory_order_relaxed);
      return fresh.status();
    }
    data = fresh->data;
    m.held.fetch_add(c.block_bytes, std::memory_order_relaxed);
    AtomicMax(m.held_peak, m.held.load(std::memory_order_relaxed));
    absl::MutexLock lock(&c.mu);
    ++c.in_use;
  }
  if (m.poison) MEMASCEND_UNPOISON(data, c.block_bytes);
  if (m.options.debug_checks) {
    absl::MutexLock lock(&m.live_mu);
    m.live_blocks[data] = {cls, bytes};
  }
  AtomicMax(m.live_peak, m.live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  m.Report({{Use::kCached, 0, -static_cast<std::int64_t>(c.block_bytes)},
            {use, static_cast<std::int64_t>(bytes), static_cast<std::int64_t>(c.block_bytes)}});
  return PinnedBlock(this, data, bytes, cls, use);
}

void PinnedPool::Return(std::byte* data, std::size_t size, int cls, Use use,
                        std::unique_ptr<ReuseFence> fence) noexcept {
  Impl& m = *impl_;
  Impl::Class& c = *m.classes[static_cast<std::size_t>(cls)];
  if (m.options.debug_checks) {
    absl::MutexLock lock(&m.live_mu);
    m.live_blocks.erase(data);
  }
  m.live.fetch_sub(size, std::memory_order_relaxed);
  m.in_use.fetch_sub(c.block_bytes, std::memory_order_relaxed);
  m.Report({{use, -static_cast<std::int64_t>(size), -static_cast<std::int64_t>(c.block_bytes)},
            {Use::kCached, 0, static_cast<std::int64_t>(c.block_bytes)}});
  const bool wait = fence != nullptr && !fence->Ready();
  if (m.poison && !wait) MEMASCEND_POISON(data, c.block_bytes);
  absl::MutexLock lock(&c.mu);
  --c.in_use;
  if (wait) {
    c.fenced.emplace_back(data, std::move(fence));
  } else {
    c.idle.push_back(data);
  }
}

absl::Status PinnedPool::Free(void* data, std::size_t bytes, Use use,
                              std::unique_ptr<ReuseFence> fence) {
  Impl& m = *impl_;
  auto* p = static_cast<std::byte*>(data);
  const int cls = m.ClassOf(bytes);
  if (p == nullptr || cls < 0 || reinterpret_cast<std::uintptr_t>(p) % kHostBlockBytes != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "pinned pool: Free({}, {}): not a block of this pool (null, misaligned or bad size)", data,
        bytes));
  }
  if (m.options.debug_checks) {
    absl::MutexLock lock(&m.live_mu);
    const auto it = m.live_blocks.find(p);
    if (it == m.live_blocks.end()) {
      return absl::InvalidArgumentError(fmt::format(
          "pinned pool: Free({}): not a live block of this pool (foreign pointer or double free)",
          data));
    }
    if (it->second.second != bytes) {
      return absl::InvalidArgumentError(
          fmt::format("pinned pool: Free({}, {}): the block was allocated with {} bytes", data,
                      bytes, it->second.second));
    }
  }
  Return(p, bytes, cls, use, std::move(fence));
  return absl::OkStatus();
}

std::size_t PinnedPool::Trim() {
  const std::size_t bytes = impl_->GiveBackIdle();
  impl_->arena->ReleaseFreeRegions();
  return bytes;
}

std::size_t PinnedPool::BlockBytesFor(std::size_t bytes) const noexcept {
  const int cls = impl_->ClassOf(bytes);
  return cls < 0 ? 0 : ClassBytes(cls);
}

std::size_t PinnedPool::ClassBytes(int cls) const noexcept {
  return impl_->classes[static_cast<std::size_t>(cls)]->block_bytes;
}

PinnedPoolStats PinnedPool::stats() const {
  const Impl& m = *impl_;
  PinnedPoolStats s;
  s.live_bytes = m.live.load();
  s.held_bytes = m.held.load();
  s.live_peak_bytes = m.live_peak.load();
  s.held_peak_bytes = m.held_peak.load();
  s.in_use_peak_bytes = m.in_use_peak.load();
  s.arena_calls = m.arena_calls.load();
  s.hits = m.hits.load();
  s.misses = m.misses.load();
  s.reclaimed_blocks = m.reclaimed.load();
  for (const auto& c : m.classes) {
    absl::MutexLock lock(&c->mu);
    if (c->hits + c->misses == 0) continue;
    s.classes.push_back({c->block_bytes, c->expected, c->in_use, c->idle.size(), c->fenced.size(),
                         c->hits, c->misses});
  }
  return s;
}

PoolPolicy PinnedPool::policy() const noexcept { return impl_->options.policy; }
HostArena* PinnedPool::arena() const noexcept { return impl_->arena; }

// ---- PinnedBlock ------------------------------------------------------------------

PinnedBlock::PinnedBlock(PinnedBlock&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      cls_(std::exchange(other.cls_, -1)),
      use_(other.use_),
      fence_(std::move(other.fence_)) {}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    cls_ = std::exchange(other.cls_, -1);
    use_ = other.use_;
    fence_ = std::move(other.fence_);
  }
  return *this;
}

PinnedBlock::~PinnedBlock() { Reset(); }

std::size_t PinnedBlock::capacity() const noexcept {
  return pool_ == nullptr ? 0 : pool_->ClassBytes(cls_);
}

void PinnedBlock::Reset() noexcept {
  if (pool_ == nullptr) return;
  pool_->Return(data_, size_, cls_, use_, std::move(fence_));
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  cls_ = -1;
}

std::byte* PinnedBlock::Release() noexcept {
  pool_ = nullptr;
  cls_ = -1;
  size_ = 0;
  fence_.reset();
  return std::exchange(data_, nullptr);
}

}  // namespace memascend
