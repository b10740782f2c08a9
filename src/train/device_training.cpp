// Parameters to the device, gradients from it (memascend/device_training.h).
#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/device_training.h>
#include <memascend/status.h>

#include "store/device_pool.h"
#include "train/copy_engine.h"
#include "util/timed.h"
#include "util/units.h"

namespace memascend {

using train::CopyEngine;
using train::CopyEvent;

namespace {

std::string Bytes(std::size_t n) { return util::FormatBytes(n); }

// A recording that no backward pass ends (forward passes only, none repeating the first)
// ends at this many acquires a group.
constexpr std::size_t kMaxRecorded = 4;

// Host buffers of copies in flight, let go once their event has completed; `start`
// (timing) is recorded before the copies when their time is wanted.
struct InFlight {
  std::shared_ptr<CopyEvent> done;
  std::vector<StateBuffer> hold;
  std::shared_ptr<CopyEvent> start;
};

}  // namespace

// ---- DeviceParameters ------------------------------------------------------------------

struct DeviceParameters::Impl {
  OffloadedAdam* adam = nullptr;
  DeviceParametersOptions o;
  std::size_t read_ahead_bytes = 0;
  std::unique_ptr<CopyEngine> engine;
  std::unique_ptr<store::DevicePool> pool;

  struct Slot {
    std::byte* block = nullptr;  // null: not on the device
    int leases = 0;
    bool wanted = false;                           // read ahead (or kept ahead), not yet acquired
    std::shared_ptr<CopyEvent> ready;              // the copy into the block
    std::vector<std::shared_ptr<CopyEvent>> uses;  // compute work on it, since its copy
    std::uint64_t used = 0;                        // ties in eviction: least recently used
  };

  mutable absl::Mutex mu;
  std::vector<Slot> slots ABSL_GUARDED_BY(mu);
  // Note [parameter read-ahead]: the recorded pass (groups in the order acquired, repeats
  // kept), each group's positions in it, and where the passes are now.
  std::vector<std::size_t> order ABSL_GUARDED_BY(mu);
  std::vector<std::vector<std::size_t>> occurs ABSL_GUARDED_BY(mu);
  bool recorded ABSL_GUARDED_BY(mu) = false;       // the recording has ended
  bool restarting ABSL_GUARDED_BY(mu) = false;     // order[0] came again: a new pass, or a repeat
  std::ptrdiff_t cursor ABSL_GUARDED_BY(mu) = -1;  // where the pass is; -1: nowhere yet
  std::ptrdiff_t last ABSL_GUARDED_BY(mu) = -1;    // the position acquired last
  PassDirection pass ABSL_GUARDED_BY(mu) = PassDirection::kForward;
  std::vector<std::shared_ptr<CopyEvent>> reuse_waits ABSL_GUARDED_BY(mu);
  std::deque<InFlight> inflight ABSL_GUARDED_BY(mu);
  std::size_t wanted_bytes ABSL_GUARDED_BY(mu) = 0;
  std::uint64_t tick ABSL_GUARDED_BY(mu) = 0;
  DeviceParametersStats stats ABSL_GUARDED_BY(mu);

  const StateLayout& layout() const { return adam->layout(); }
  std::size_t GroupBytes(std::size_t g) const {
    return layout().groups[g].elements * layout().ElementBytes(StateKind::kParameters);
  }

  // Drops the host buffers of completed copies, oldest first.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!inflight.empty() && inflight.front().done->Ready()) PopOldestLocked();
  }

  void PopOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    InFlight& f = inflight.front();
    if (f.start != nullptr) stats.copy_seconds += f.done->SecondsSince(*f.start);
    inflight.pop_front();
  }

  absl::Status WaitOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (inflight.empty()) return absl::OkStatus();
    absl::Status s;
    {
      const util::Timed timed(&stats.copy_wait_seconds);
      s = inflight.front().done->Wait();
    }
    PopOldestLocked();
    return s;
  }

  void FreeLocked(std::size_t g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Slot& s = slots[g];
    if (s.block == nullptr) return;
    // The next copy into this memory waits for the compute work that read it.
    for (auto& e : s.uses) {
      if (!e->Ready()) reuse_waits.push_back(std::move(e));
    }
    s.uses.clear();
    (void)pool->Free(s.block);  // a block exists only with a pool
    s.block = nullptr;
    s.ready.reset();
    if (s.wanted) {
      s.wanted = false;
      wanted_bytes -= GroupBytes(g);
    }
  }

  // Acquires from now until group g's next (Note [parameter read-ahead]): the recorded
  // pass forward, then backward, then forward again; kNever for a group not in it.
  static constexpr std::size_t kNever = static_cast<std::size_t>(-1);
  std::size_t NextUseLocked(std::size_t g) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (cursor < 0 || occurs[g].empty()) return kNever;
    const std::size_t m = order.size(), cycle = 2 * m;
    const auto c = static_cast<std::size_t>(cursor);
    const std::size_t now = pass == PassDirection::kForward ? c : cycle - 1 - c;
    std::size_t best = kNever;
    for (std::size_t k : occurs[g]) {
      for (std::size_t t : {k, cycle - 1 - k}) {
        std::size_t d = (t + cycle - now) % cycle;
        if (d == 0) d = cycle;
        best = std::min(best, d);
      }
    }
    return best;
  }

  // The released group, read ahead or not as `wanted` says, whose next use is furthest
  // (the least recently used of those alike); slots.size() when there is none.
  std::size_t VictimLocked(bool wanted) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::size_t victim = slots.size(), victim_next = 0;
    for (std::size_t g = 0; g < slots.size(); ++g) {
      const Slot& s = slots[g];
      if (s.block == nullptr || s.leases > 0 || s.wanted != wanted) continue;
      const std::size_t next = NextUseLocked(g);
      if (victim == slots.size() || next > victim_next ||
          (next == victim_next && s.used < slots[victim].used)) {
        victim = g;
        victim_next = next;
      }
    }
    return victim;
  }

  // A device block for `bytes`, evicting released groups whose next use is furthest first
  // (least recently used first among those the recorded pass does not hold).
  // An acquire (`drop_read_ahead`) takes the room of groups read ahead when nothing else is
  // left: read-ahead is never worth an acquire's failure (the pool's blocks are contiguous,
  // so bytes that fit can still be in pieces).
  absl::StatusOr<std::byte*> AllocateLocked(std::size_t bytes, bool drop_read_ahead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (;;) {
      absl::StatusOr<std::byte*> b = pool->Allocate(bytes, Use::kParameters);
      if (b.ok()) {
        stats.peak_resident_bytes = std::max(stats.peak_resident_bytes, pool->allocated());
        return b;
      }
      std::size_t victim = VictimLocked(/*wanted=*/false);
      if (victim == slots.size() && drop_read_ahead) victim = VictimLocked(/*wanted=*/true);
      if (victim == slots.size()) {
        std::size_t leased = 0;
        for (std::size_t g = 0; g < slots.size(); ++g) {
          if (slots[g].leases > 0) leased += GroupBytes(g);
        }
        return absl::ResourceExhaustedError(fmt::format(
            "device parameters: no room for {} in the device budget of {}: {} are acquired and "
            "{} read ahead (raise device_budget_bytes, or lower read_ahead_bytes)",
            Bytes(bytes), Bytes(o.device_budget_bytes), Bytes(leased), Bytes(wanted_bytes)));
      }
      FreeLocked(victim);
      ++stats.evictions;
    }
  }

  // A failed copy or record: the copies queued before it still read `f`'s host blocks,
  // which go back to the store when `f` goes, so the copy stream's work ends first; `s`.
  absl::Status Drained(absl::Status s, const InFlight& f) {
    if (f.hold.empty()) return s;
    if (auto e = engine->Record(o.copy_stream, false); e.ok() && (*e)->Wait().ok()) return s;
    const prim::DeviceGuard on(o.device);  // Note [current device]
    (void)prim::SynchronizeStream(o.copy_stream);
    return s;
  }

  // Queues the copies of group g's stored parameters to `to` on the copy stream (after
  // `after`, if given, and after the last uses of reused memory). The event after them.
  absl::StatusOr<std::shared_ptr<CopyEvent>> CopyGroupLocked(std::size_t g, std::byte* to,
                                                             CopyEvent* after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const CudaStreamView copy = o.copy_stream;
    for (auto& e : reuse_waits) MEMASCEND_RETURN_IF_ERROR(engine->MakeWait(copy, *e));
    reuse_waits.clear();
    if (after != nullptr) MEMASCEND_RETURN_IF_ERROR(engine->MakeWait(copy, *after));
    const StateLayout& l = layout();
    const std::size_t element = l.ElementBytes(StateKind::kParameters);
    // The parts' host buffers are taken first and the copies then queued back to back, so
    // the copy stream is not left idle while the host looks up each part.
    struct Ready {
      std::size_t offset, bytes;
      StateBuffer buffer;
    };
    std::vector<Ready> ready;
    std::shared_ptr<CopyEvent> done;
    const auto flush = [&]() -> absl::Status {
      if (ready.empty()) return absl::OkStatus();
      InFlight f;
      MEMASCEND_ASSIGN_OR_RETURN(f.start, engine->Record(copy, true));
      // Parts whose host blocks follow one another (as the store often allocates a group's
      // parts) go as one copy: fewer, larger copies come closer to the bus's ceiling. Such
      // blocks are in one region of the store's arena, pinned as a whole (no two regions
      // are adjacent: Note [region guard] in prim/memory.cpp).
      for (std::size_t k = 0; k < ready.size();) {
        const Ready& first = ready[k];
        std::size_t bytes = first.bytes;
        std::size_t end = k + 1;
        while (end < ready.size() && ready[end].buffer.data == first.buffer.data + bytes) {
          bytes += ready[end].bytes;  // offsets follow too: the parts are in order
          ++end;
        }
        if (absl::Status s = engine->Copy(to + first.offset, first.buffer.data, bytes,
                                          prim::CopyDirection::kHostToDevice, copy);
            !s.ok()) {
          return Drained(s, f);
        }
        ++stats.copies;
        for (; k < end; ++k) f.hold.push_back(std::move(ready[k].buffer));
      }
      ready.clear();
      absl::StatusOr<std::shared_ptr<CopyEvent>> after_copies = engine->Record(copy, true);
      if (!after_copies.ok()) return Drained(after_copies.status(), f);
      f.done = *std::move(after_copies);
      done = f.done;
      inflight.push_back(std::move(f));
      return absl::OkStatus();
    };
    for (std::size_t part = 0; part < l.Parts(g); ++part) {
      const auto [begin, end] = l.PartRange(g, part);
      absl::StatusOr<StateBuffer> buf;
      for (;;) {
        {
          const util::Timed timed(&stats.read_seconds);
          buf = adam->ReadParameters(g, part);  // the update's, once it has reached the group
        }
        if (buf.ok() || !absl::IsResourceExhausted(buf.status())) break;
        // The store's budget is held by copies: queue what is ready, let the oldest finish.
        MEMASCEND_RETURN_IF_ERROR(flush());
        if (inflight.empty()) break;
        MEMASCEND_RETURN_IF_ERROR(WaitOldestLocked());
      }
      if (!buf.ok()) return buf.status();
      ready.push_back(Ready{begin * element, (end - begin) * element, *std::move(buf)});
    }
    MEMASCEND_RETURN_IF_ERROR(flush());
    stats.bytes_to_device += GroupBytes(g);
    return done;
  }

  absl::Status LoadLocked(std::size_t g, bool drop_read_ahead = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_ASSIGN_OR_RETURN(std::byte * block, AllocateLocked(GroupBytes(g), drop_read_ahead));
    absl::StatusOr<std::shared_ptr<CopyEvent>> done = CopyGroupLocked(g, block, nullptr);
    if (!done.ok()) {
      (void)pool->Free(block);
      return done.status();
    }
    Slot& s = slots[g];
    s.block = block;
    s.ready = *std::move(done);
    return absl::OkStatus();
  }

  // Group g at `at` in the recorded pass (at == order.size(): at its end).
  void InsertLocked(std::size_t at, std::size_t g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), g);
    if (at + 1 == order.size()) {
      occurs[g].push_back(at);
    } else {
      for (auto& positions : occurs) positions.clear();
      for (std::size_t k = 0; k < order.size(); ++k) occurs[order[k]].push_back(k);
    }
    stats.recorded_groups = order.size();
  }

  void UnwantAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (Slot& s : slots) s.wanted = false;
    wanted_bytes = 0;
  }

  // Note [parameter read-ahead]: records the first pass, then follows the passes along it.
  void TrackLocked(std::size_t g, PassDirection direction) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const bool forward = direction == PassDirection::kForward;
    if (!recorded) {
      if (restarting) {  // order[0] came again: a new pass if order[1] follows, else a repeat
        restarting = false;
        if (forward && order.size() > 1 && g == order[1]) {
          recorded = true;
          cursor = last = 1;
          pass = direction;
          return;
        }
        UnwantAllLocked();  // what the new pass's read-ahead marked
        InsertLocked(order.size(), order[0]);
        cursor = last = static_cast<std::ptrdiff_t>(order.size()) - 1;
      }
      if (forward) {
        if (!order.empty() && g == order[0]) {
          restarting = true;  // read ahead as a new pass until the next acquire says
          recorded = order.size() == 1;
          cursor = last = 0;
          pass = direction;
          return;
        }
        InsertLocked(order.size(), g);
        cursor = last = static_cast<std::ptrdiff_t>(order.size()) - 1;
        if (order.size() >= kMaxRecorded * slots.size()) recorded = true;
        return;
      }
      if (order.empty()) return;  // a backward pass before any forward: nothing to follow
      recorded = true;            // the first backward acquire ends the recording
    }
    // Follow the recorded pass. A pass that turned starts at its end; within a pass the
    // cursor moves on to g's next position. It stays for g again, and, backward, for the
    // position after the one acquired last: a unit's groups come in their forward order in
    // the backward pass too, and the unit is reached at its first. A forward pass that
    // finds g only behind it began anew; a backward one goes back to g's last position.
    const bool turned = cursor < 0 || direction != pass;
    const std::vector<std::size_t>& at = occurs[g];
    const auto c = static_cast<std::size_t>(cursor < 0 ? 0 : cursor);
    pass = direction;
    if (!turned && order[c] == g) {
      last = cursor;
      return;
    }
    if (at.empty()) {
      // A group the recording missed (a first pass cut short, a module it skipped): the
      // forward pass adds it where it is met.
      if (forward && order.size() < kMaxRecorded * slots.size()) {
        const std::size_t where = turned ? 0 : c + 1;
        InsertLocked(where, g);
        cursor = last = static_cast<std::ptrdiff_t>(where);
        if (turned) UnwantAllLocked();
      }
      return;
    }
    if (forward) {
      auto next = turned ? at.begin() : std::upper_bound(at.begin(), at.end(), c);
      const bool anew = turned || next == at.end();
      if (next == at.end()) next = at.begin();
      if (anew) UnwantAllLocked();  // groups read ahead for the pass that ended
      cursor = last = static_cast<std::ptrdiff_t>(*next);
      return;
    }
    if (turned) {
      UnwantAllLocked();
      cursor = last = static_cast<std::ptrdiff_t>(at.back());
      return;
    }
    auto below = std::lower_bound(at.begin(), at.end(), c);  // the first at or after c
    if (below != at.begin()) {
      cursor = last = static_cast<std::ptrdiff_t>(*std::prev(below));
    } else if (last >= 0 &&
               std::binary_search(at.begin(), at.end(), static_cast<std::size_t>(last) + 1)) {
      last = last + 1;  // the unit's next group: the pass is still at the unit
    } else {
      cursor = last = static_cast<std::ptrdiff_t>(at.back());
    }
  }

  // Marks the groups ahead of the cursor wanted, while the bytes wanted stay within
  // read_ahead_bytes, and starts the copies of those not resident. A group stays wanted
  // until acquired, or until the pass turns or begins anew.
  void ReadAheadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (cursor < 0) return;
    // All wanted first, then loaded: no load evicts a group further ahead.
    std::vector<std::size_t> ahead;
    const std::ptrdiff_t step = pass == PassDirection::kForward ? 1 : -1;
    const std::ptrdiff_t m = static_cast<std::ptrdiff_t>(order.size());
    for (std::ptrdiff_t j = cursor + step; j >= 0 && j < m; j += step) {
      const std::size_t h = order[static_cast<std::size_t>(j)];
      if (slots[h].leases > 0 || slots[h].wanted) continue;
      // Its parameters change before the step commits (an update interleaved with this
      // pass has not reached it): reading them now would read them twice.
      if (adam->UpdatePendingFor(h)) break;
      if (wanted_bytes + GroupBytes(h) > read_ahead_bytes) break;
      slots[h].wanted = true;
      wanted_bytes += GroupBytes(h);
      ahead.push_back(h);
    }
    for (std::size_t i = 0; i < ahead.size(); ++i) {
      if (slots[ahead[i]].block != nullptr) continue;
      if (!LoadLocked(ahead[i]).ok()) {  // no room now: the acquires will load them
        for (std::size_t j = i; j < ahead.size(); ++j) {
          Slot& rest = slots[ahead[j]];
          if (rest.block == nullptr) {
            rest.wanted = false;
            wanted_bytes -= GroupBytes(ahead[j]);
          }
        }
        break;
      }
      ++stats.read_ahead;
    }
  }
};

DeviceParameters::DeviceParameters(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceParameters::~DeviceParameters() {
  if (impl_) (void)Synchronize();
}

absl::StatusOr<std::unique_ptr<DeviceParameters>> DeviceParameters::Create(
    OffloadedAdam* optimizer, const DeviceParametersOptions& options) {
  if (optimizer == nullptr) return absl::InvalidArgumentError("device parameters: no optimizer");
  const StateLayout& l = optimizer->layout();
  std::size_t largest = 0;
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    if (!l.Stored(StateKind::kParameters, g)) {
      return absl::FailedPreconditionError(fmt::format(
          "device parameters: group '{}' stores no parameters (they are derived from its master "
          "weights): make the layout with store_parameters",
          l.groups[g].name));
    }
    largest = std::max(largest, l.groups[g].elements * l.ElementBytes(StateKind::kParameters));
  }
  const std::size_t budget =
      options.device_budget_bytes / store::kDeviceBlockBytes * store::kDeviceBlockBytes;
  if (options.device_budget_bytes != 0 && budget < largest) {
    return absl::InvalidArgumentError(fmt::format(
        "device parameters: a device budget of {} bytes cannot hold the largest group ({})",
        options.device_budget_bytes, Bytes(largest)));
  }
  auto impl = std::make_unique<Impl>();
  impl->adam = optimizer;
  impl->o = options;
  impl->o.device_budget_bytes = budget;
  impl->read_ahead_bytes = options.read_ahead_bytes != 0 ? options.read_ahead_bytes : budget / 2;
  MEMASCEND_ASSIGN_OR_RETURN(impl->engine,
                             train::MakeCopyEngine(options.device, options.emulate_on_host));
  if (budget > 0) {
    MEMASCEND_ASSIGN_OR_RETURN(std::byte * slab, impl->engine->AllocateSlab(budget));
    impl->pool = std::make_unique<store::DevicePool>(slab, budget, nullptr);
  }
  {
    absl::MutexLock lock(&impl->mu);
    impl->slots.resize(l.groups.size());
    impl->occurs.resize(l.groups.size());
  }
  return std::unique_ptr<DeviceParameters>(new DeviceParameters(std::move(impl)));
}

absl::StatusOr<DeviceView> DeviceParameters::Acquire(std::size_t group, CudaStreamView compute,
                                                     PassDirection direction) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  const util::Timed timed(&m.stats.acquire_seconds);  // ends under the lock
  if (group >= m.slots.size()) {
    return absl::OutOfRangeError(
        fmt::format("device parameters: no group {} ({} groups)", group, m.slots.size()));
  }
  if (m.pool == nullptr) {
    return absl::FailedPreconditionError(
        "device parameters: no device budget (made for CopyTo only)");
  }
  m.ReapLocked();
  m.TrackLocked(group, direction);
  Impl::Slot& s = m.slots[group];
  ++m.stats.acquires;
  if (s.block != nullptr) {
    ++m.stats.hits;
    if (s.wanted) {
      s.wanted = false;
      m.wanted_bytes -= m.GroupBytes(group);
    }
  } else {
    ++m.stats.misses;
    MEMASCEND_RETURN_IF_ERROR(m.LoadLocked(group, /*drop_read_ahead=*/true));
  }
  s.used = ++m.tick;
  MEMASCEND_RETURN_IF_ERROR(m.engine->MakeWait(compute, *s.ready));
  ++s.leases;  // only once granted: a failed acquire leaves no lease to release
  m.ReadAheadLocked();
  return DeviceView{s.block, m.layout().groups[group].elements, m.layout().param_dtype};
}

absl::Status DeviceParameters::Release(std::size_t group, CudaStreamView compute) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (group >= m.slots.size() || m.slots[group].leases == 0) {
    return absl::FailedPreconditionError(
        fmt::format("device parameters: group {} released but not acquired", group));
  }
  Impl::Slot& s = m.slots[group];
  MEMASCEND_ASSIGN_OR_RETURN(std::shared_ptr<CopyEvent> use, m.engine->Record(compute));
  std::erase_if(s.uses, [](const std::shared_ptr<CopyEvent>& e) { return e->Ready(); });
  s.uses.push_back(std::move(use));
  --s.leases;
  return absl::OkStatus();
}

absl::Status DeviceParameters::Invalidate(std::size_t group) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (group >= m.slots.size()) {
    return absl::OutOfRangeError(fmt::format("device parameters: no group {}", group));
  }
  Impl::Slot& s = m.slots[group];
  if (s.leases > 0) {
    return absl::FailedPreconditionError(fmt::format(
        "device parameters: group {} is invalidated while acquired ({} leases)", group, s.leases));
  }
  if (s.block != nullptr) ++m.stats.invalidations;
  m.FreeLocked(group);
  return absl::OkStatus();
}

absl::Status DeviceParameters::CopyTo(std::size_t group, std::byte* device_memory,
                                      CudaStreamView compute) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (group >= m.slots.size()) {
    return absl::OutOfRangeError(fmt::format("device parameters: no group {}", group));
  }
  if (device_memory == nullptr) return absl::InvalidArgumentError("device parameters: no memory");
  m.ReapLocked();
  // The caller's memory may still be read by work queued on `compute`: the copies wait.
  MEMASCEND_ASSIGN_OR_RETURN(std::shared_ptr<CopyEvent> before, m.engine->Record(compute));
  MEMASCEND_ASSIGN_OR_RETURN(std::shared_ptr<CopyEvent> done,
                             m.CopyGroupLocked(group, device_memory, before.get()));
  return m.engine->MakeWait(compute, *done);
}

absl::Status DeviceParameters::Synchronize() {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  absl::Status status;
  while (!m.inflight.empty()) status.Update(m.WaitOldestLocked());
  return status;
}

DeviceParametersStats DeviceParameters::stats() const {
  absl::MutexLock lock(&impl_->mu);
  DeviceParametersStats s = impl_->stats;
  s.resident_bytes = impl_->pool != nullptr ? impl_->pool->allocated() : 0;
  return s;
}

// ---- DeviceGradients -------------------------------------------------------------------

struct DeviceGradients::Impl {
  OffloadedAdam* adam = nullptr;
  DeviceGradientsOptions o;
  std::size_t max_inflight = 0;
  std::unique_ptr<CopyEngine> engine;

  struct Part {
    std::size_t g = 0, part = 0, bytes = 0;
    StateBuffer buffer;
    std::shared_ptr<CopyEvent> done;
  };
  mutable absl::Mutex mu;
  std::deque<Part> pending ABSL_GUARDED_BY(mu);  // in the order queued
  std::size_t inflight_bytes ABSL_GUARDED_BY(mu) = 0;
  std::vector<bool> offloaded ABSL_GUARDED_BY(mu);  // this step's
  DeviceGradientsStats stats ABSL_GUARDED_BY(mu);

  // Hands the oldest part to the optimizer once its copy is done (waiting for it if
  // `wait`). False when it was not done and `wait` is false.
  // A copy that failed drops its part (the error is returned; the step must not be used).
  absl::StatusOr<bool> FinishOldestLocked(bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!wait && !pending.front().done->Ready()) return false;
    Part taken = std::move(pending.front());
    pending.pop_front();
    inflight_bytes -= taken.bytes;
    if (!taken.done->Ready()) ++stats.waits;
    // Always waited on: an event whose stream failed reads as done (Ready() says only that
    // nothing is left to wait for), and Wait() returns the copy's error, so a failed
    // copy's bytes never reach the norm, the update or a commit.
    MEMASCEND_RETURN_IF_ERROR(taken.done->Wait());
    MEMASCEND_RETURN_IF_ERROR(adam->EndGradient(taken.g, taken.part, std::move(taken.buffer)));
    return true;
  }

  absl::Status ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!pending.empty()) {
      MEMASCEND_ASSIGN_OR_RETURN(const bool finished, FinishOldestLocked(false));
      if (!finished) break;
    }
    return absl::OkStatus();
  }
};

DeviceGradients::DeviceGradients(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceGradients::~DeviceGradients() {
  if (!impl_) return;
  absl::MutexLock lock(&impl_->mu);
  // Copies still in flight write into the store's blocks: wait before letting them go.
  for (Impl::Part& p : impl_->pending) (void)p.done->Wait();
}

absl::StatusOr<std::unique_ptr<DeviceGradients>> DeviceGradients::Create(
    OffloadedAdam* optimizer, const DeviceGradientsOptions& options) {
  if (optimizer == nullptr) return absl::InvalidArgumentError("device gradients: no optimizer");
  auto impl = std::make_unique<Impl>();
  impl->adam = optimizer;
  impl->o = options;
  const StateLayout& l = optimizer->layout();
  impl->max_inflight = options.max_inflight_bytes != 0
                           ? options.max_inflight_bytes
                           : 8 * l.MaxPartElements() * l.ElementBytes(StateKind::kGradient);
  MEMASCEND_ASSIGN_OR_RETURN(impl->engine,
                             train::MakeCopyEngine(options.device, options.emulate_on_host));
  {
    absl::MutexLock lock(&impl->mu);
    impl->offloaded.assign(l.groups.size(), false);
  }
  return std::unique_ptr<DeviceGradients>(new DeviceGradients(std::move(impl)));
}

absl::StatusOr<std::shared_ptr<ReuseFence>> DeviceGradients::Offload(std::size_t group,
                                                                     TensorView gradient,
                                                                     CudaStreamView producer) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  const StateLayout& l = m.adam->layout();
  if (group >= l.groups.size()) {
    return absl::OutOfRangeError(
        fmt::format("device gradients: no group {} ({} groups)", group, l.groups.size()));
  }
  if (gradient.elements != l.groups[group].elements || gradient.data == nullptr) {
    return absl::InvalidArgumentError(
        fmt::format("device gradients: group '{}' has {} elements, the gradient {}",
                    l.groups[group].name, l.groups[group].elements, gradient.elements));
  }
  if (gradient.dtype != l.grad_dtype) {
    return absl::InvalidArgumentError(fmt::format(
        "device gradients: group '{}' keeps {} gradients, this one is {}: convert it on the "
        "device first",
        l.groups[group].name, ToString(l.grad_dtype), ToString(gradient.dtype)));
  }
  if (m.offloaded[group]) {
    return absl::FailedPreconditionError(fmt::format(
        "device gradients: group '{}' offloaded twice in one step (accumulate on the device, "
        "or Finish and step between)",
        l.groups[group].name));
  }
  MEMASCEND_RETURN_IF_ERROR(m.ReapLocked());
  const CudaStreamView copy = m.o.copy_stream;
  MEMASCEND_ASSIGN_OR_RETURN(std::shared_ptr<CopyEvent> made, m.engine->Record(producer));
  MEMASCEND_RETURN_IF_ERROR(m.engine->MakeWait(copy, *made));
  const std::size_t element = SizeOf(gradient.dtype);
  const auto* src = static_cast<const std::byte*>(gradient.data);
  std::shared_ptr<CopyEvent> last;
  for (std::size_t part = 0; part < l.Parts(group); ++part) {
    const auto [begin, end] = l.PartRange(group, part);
    const std::size_t bytes = (end - begin) * element;
    while (!m.pending.empty() && m.inflight_bytes + bytes > m.max_inflight) {
      MEMASCEND_RETURN_IF_ERROR(m.FinishOldestLocked(true).status());
    }
    absl::StatusOr<StateBuffer> buffer;
    for (;;) {
      buffer = m.adam->BeginGradient(group, part);
      if (buffer.ok() || !absl::IsResourceExhausted(buffer.status()) || m.pending.empty()) break;
      MEMASCEND_RETURN_IF_ERROR(m.FinishOldestLocked(true).status());  // its block, freed
    }
    if (!buffer.ok()) return buffer.status();
    MEMASCEND_RETURN_IF_ERROR(m.engine->Copy(buffer->data, src + begin * element, bytes,
                                             prim::CopyDirection::kDeviceToHost, copy));
    absl::StatusOr<std::shared_ptr<CopyEvent>> done = m.engine->Record(copy);
    if (!done.ok()) {
      // The copy is queued with no event after it and writes `buffer`, which goes back to
      // the store on return: it ends first (an emulated copy has ended already).
      if (!m.engine->emulated()) {
        const prim::DeviceGuard on(m.o.device);  // Note [current device]
        (void)prim::SynchronizeStream(copy);
      }
      return done.status();
    }
    last = *std::move(done);
    m.pending.push_back(Impl::Part{group, part, bytes, *std::move(buffer), last});
    m.inflight_bytes += bytes;
    ++m.stats.parts;
    m.stats.bytes_from_device += bytes;
  }
  m.offloaded[group] = true;
  ++m.stats.groups;
  return std::shared_ptr<ReuseFence>(std::move(last));
}

absl::Status DeviceGradients::Finish() {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  absl::Status status;
  while (!m.pending.empty()) {
    absl::StatusOr<bool> r = m.FinishOldestLocked(true);
    if (!r.ok()) status.Update(r.status());
  }
  m.offloaded.assign(m.offloaded.size(), false);
  return status;
}

DeviceGradientsStats DeviceGradients::stats() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->stats;
}

}  // namespace memascend
