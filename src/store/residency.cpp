// The tensor store's host residency: blocks under the budget, evictions, loads and write-backs
// (store/tensor_store_impl.h).
#include <algorithm>
#include <cstring>

#include "store/tensor_store_impl.h"
#include "util/units.h"

namespace memascend {

using store::Clock;
using store::Since;

// Writes a resident tensor back; mu is released during the I/O.
// Note [write-back under a writer]: a tensor may be written back while a host lease that
// may write it is held (a Flush or WriteBack on another thread, or by the holder itself
// before it writes more). What is staged then is whatever the block held, and the holder's
// later writes (an AcquireForWrite lease, dirty from the start, calls no MarkDirty) must
// still reach the volume: the tensor stays dirty, so they are written before its memory
// is reused and by the next Flush. (It was left clean, and an eviction then dropped them.)
absl::Status TensorStore::Impl::WriteBackLocked(Tensor& t) {
  if (t.state != State::kResident || !t.dirty) return absl::OkStatus();
  const bool under_writer = t.host_writers > 0;
  t.state = State::kWriting;
  t.dirty = false;
  const auto start = Clock::now();
  // Durable tensors are staged: committed together at Flush (Note [staged puts]).
  // Staged objects keep their previous versions' extents until committed: when the
  // volume runs out of room, commit what is staged (freeing those) and try again. Other
  // write-backs in flight (Note [write-back depth]) hold extents no commit frees until
  // they are staged: wait for them first, then commit.
  const std::span<const std::byte> bytes{t.block.data(), t.spec.bytes};
  const auto put = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++puts_in_flight;
    mu.Unlock();
    absl::Status s = t.spec.durability == Durability::kDurable
                         ? volume->PutStaged(t.spec.name, bytes, store::Metadata(t.spec))
                         : volume->Put(t.spec.name, bytes, Durability::kScratch);
    mu.Lock();
    --puts_in_flight;
    cv.SignalAll();
    return s;
  };
  absl::Status s = put();
  for (std::size_t tries = 0; s.code() == absl::StatusCode::kResourceExhausted &&
                              commit_when_full.load() && tries <= TensorStore::kWriteBackDepth;
       ++tries) {
    while (puts_in_flight > 0) cv.Wait(&mu);
    mu.Unlock();
    absl::Status synced = volume->Sync();
    mu.Lock();
    if (!synced.ok()) break;
    s = put();
  }
  t.state = State::kResident;
  cv.SignalAll();
  if (!s.ok() || under_writer || t.host_writers > 0) t.dirty = true;
  if (!s.ok()) return s;
  t.stored = true;
  ++counters.write_backs;
  counters.bytes_written += t.spec.bytes;
  counters.write_seconds += Since(start);
  return absl::OkStatus();
}

// A block for `bytes`, evicting unleased tensors while the budget is short, in
// EvictionRank order. For a prefetch (`prefetch`), never a wanted or kept one:
// kResourceExhausted instead.
absl::StatusOr<PinnedBlock> TensorStore::Impl::AllocateLocked(const Tensor& wanting,
                                                              bool prefetch) {
  MEMASCEND_RETURN_IF_ERROR(EnsurePool());
  for (;;) {
    auto block = pool->Allocate(wanting.spec.bytes, wanting.spec.use);
    if (block.ok() || block.status().code() != absl::StatusCode::kResourceExhausted) return block;
    candidates.resize(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = *tensors[i];
      store::EvictionCandidate& c = candidates[i];
      c.eligible = &t != &wanting && t.pins == 0;
      c.resident = t.state == State::kResident;
      c.writing = t.state == State::kWriting;
      c.rank = store::EvictionRank(t.wanted, t.retention == Retention::kKeep);
      c.last_use = t.last_use;
    }
    const store::EvictionChoice choice = store::ChooseVictim(candidates, prefetch);
    if (choice.action == store::EvictionAction::kWaitForWriteBack) {
      cv.Wait(&mu);
      continue;
    }
    if (choice.action == store::EvictionAction::kRefusePrefetch) {
      return absl::ResourceExhaustedError(fmt::format(
          "prefetch of '{}' dropped: the host budget holds only leased tensors and tensors "
          "prefetched earlier or kept",
          wanting.spec.name));
    }
    Tensor* victim =
        choice.action == store::EvictionAction::kEvict ? tensors[choice.victim].get() : nullptr;
    if (victim == nullptr) {
      // Loads and write-backs in flight end as unleased resident tensors, which can be
      // evicted: wait for them rather than fail a demand for memory a prefetch holds.
      bool transient = false;
      for (const auto& t : tensors) {
        transient |=
            t.get() != &wanting && (t->state == State::kLoading || t->state == State::kWriting);
      }
      if (transient) {
        cv.Wait(&mu);
        continue;
      }
      std::uint64_t held = 0;
      for (const auto& t : tensors) held += t->state == State::kCold ? 0 : t->block.capacity();
      const std::size_t need = pool->BlockBytesFor(wanting.spec.bytes);
      if (held + need <= options.host_budget_bytes) {
        // The budget has room, the pool none: its memory is fragmented around the
        // leased blocks, or growing it failed (mlock limit, mmap): its message says.
        return absl::ResourceExhaustedError(fmt::format(
            "tensor '{}' needs a block of {}: the host budget of {} has {} outside leased "
            "tensors, but the pool cannot provide it ({}; largest free extent {}); a budget "
            "further above the leased peak avoids fragmentation",
            wanting.spec.name, util::FormatBytes(need),
            util::FormatBytes(options.host_budget_bytes),
            util::FormatBytes(options.host_budget_bytes - held),
            std::string(block.status().message()),
            util::FormatBytes(arena->stats().largest_free_extent)));
      }
      return absl::ResourceExhaustedError(
          fmt::format("tensor '{}' needs {} but the host budget of {} is held by leased or loading "
                      "tensors ({}); {} short",
                      wanting.spec.name, util::FormatBytes(wanting.spec.bytes),
                      util::FormatBytes(options.host_budget_bytes), util::FormatBytes(held),
                      util::FormatBytes(held + need - options.host_budget_bytes)));
    }
    MEMASCEND_RETURN_IF_ERROR(WriteBackLocked(*victim));
    if (victim->state != State::kResident || victim->pins != 0) continue;  // changed while writing
    victim->block.Reset();
    victim->state = State::kCold;
    victim->wanted = false;  // a prefetch evicted before its use ends there (as Evict)
    ++counters.evictions;
    cv.SignalAll();
  }
}

// Starts making a cold `t` resident (without pinning it). Making room may release mu:
// if another thread took the tensor meanwhile, the block goes back and the caller
// looks at the tensor's state again.
absl::Status TensorStore::Impl::LoadLocked(Tensor& t, bool prefetch) {
  MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, AllocateLocked(t, prefetch));
  if (t.state != State::kCold) return absl::OkStatus();
  t.block = std::move(block);
  t.state = State::kLoading;
  const auto start = Clock::now();
  mu.Unlock();
  absl::Status s;
  if (t.stored) {
    auto n = volume->Get(t.spec.name, {t.block.data(), t.block.capacity()});
    s = n.status();
  } else {
    std::memset(t.block.data(), 0, t.spec.bytes);  // never written: zeros
  }
  mu.Lock();
  if (!s.ok()) {
    t.block.Reset();
    t.state = State::kCold;
    cv.SignalAll();
    return s;
  }
  if (t.stored) {
    counters.bytes_read += t.spec.bytes;
    counters.read_seconds += Since(start);
  }
  t.state = State::kResident;
  t.last_use = ++tick;
  cv.SignalAll();
  return absl::OkStatus();
}

// Makes `t` resident in host memory without pinning it (no counters); for a prefetch,
// only if that evicts nothing wanted (AllocateLocked).
absl::Status TensorStore::Impl::MakeResidentLocked(Tensor& t, bool* loaded_here, bool prefetch) {
  for (;;) {
    if (t.state == State::kResident) break;
    if (t.state == State::kCold) {
      if (loaded_here != nullptr) *loaded_here = true;
      MEMASCEND_RETURN_IF_ERROR(LoadLocked(t, prefetch));
      continue;
    }
    cv.Wait(&mu);  // loading (a prefetch) or being written back
  }
  return absl::OkStatus();
}

// Makes `t` resident and pins it (Acquire's loop, without counters): a use.
absl::Status TensorStore::Impl::HostResidentLocked(Tensor& t, bool* loaded_here) {
  t.wanted = false;
  MEMASCEND_RETURN_IF_ERROR(MakeResidentLocked(t, loaded_here));
  ++t.pins;
  return absl::OkStatus();
}

}  // namespace memascend
