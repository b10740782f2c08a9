#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <system_error>
#include <thread>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>

#include "prim/os.h"
#include "store/tensor_store_impl.h"
#include "util/units.h"

namespace memascend {

absl::Status PrefetchTicket::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty prefetch ticket");
  absl::MutexLock lock(&state_->mu);
  while (!state_->done) state_->cv.Wait(&state_->mu);
  return state_->status;
}

bool PrefetchTicket::Poll() const { return state_ != nullptr && state_->finished.load(); }

using store::Clock;
using store::Since;

std::string store::Metadata(const TensorSpec& s) {
  std::string shape;
  for (std::size_t i = 0; i < s.shape.size(); ++i)
    shape += (i ? "," : "") + std::to_string(s.shape[i]);
  return fmt::format("dtype={};shape={};use={}", ToString(s.dtype), shape, ToString(s.use));
}

namespace {
// Note [one store per name]: the tensor names each volume's open stores registered, across
// the process: two stores registering one name would write one object, each over the
// other's. Released when the registering store is destroyed.
struct Claims {
  absl::Mutex mu;
  std::map<std::pair<const ObjectStore*, std::string>, const void*> owner;
};
Claims& VolumeClaims() {
  static Claims* c = new Claims();  // never destroyed: stores may outlive statics
  return *c;
}
void ReleaseClaims(const ObjectStore* volume, const void* store) {
  Claims& c = VolumeClaims();
  absl::MutexLock lock(&c.mu);
  for (auto it = c.owner.lower_bound({volume, std::string()});
       it != c.owner.end() && it->first.first == volume;) {
    it = it->second == store ? c.owner.erase(it) : std::next(it);
  }
}
}  // namespace

TensorStore::TensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TensorStore::~TensorStore() {
  ReleaseClaims(impl_->volume, impl_.get());
  if (!impl_->closed) {
    const absl::Status s = Close();
    if (!s.ok()) {
      std::fprintf(stderr,
                   "memascend: a tensor store was destroyed with dirty durable tensors it could "
                   "not write back (call TensorStore::Close() to see this as a status): %s\n",
                   std::string(s.message()).c_str());
    }
  }
}

absl::Status TensorStore::Close() {
  if (impl_->closed) return impl_->close_status;
  // Note [commit when full]: a caller that orders the commits makes its last one itself.
  impl_->close_status = impl_->commit_at_close.load() ? Flush() : absl::OkStatus();
  impl_->closed = true;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stop = true;
    impl_->RetryDeferredLocked();
    for (Impl::Job& job : impl_->jobs)
      if (job.ticket != nullptr) job.ticket->Finish(absl::CancelledError("the store is closing"));
    impl_->jobs.clear();
  }
  for (std::thread& w : impl_->workers) w.join();
  // Note [commit when full]: nor does anything staged outlive the store, once its workers
  // (a write-behind in flight) are done: no later commit on the volume carries it.
  if (!impl_->commit_at_close.load()) {
    std::vector<std::string> names;
    {
      absl::MutexLock lock(&impl_->mu);
      for (const auto& t : impl_->tensors)
        if (t->spec.durability == Durability::kDurable) names.push_back(t->spec.name);
    }
    (void)impl_->volume->DropStaged(names);
  }
  std::unique_ptr<store::DevicePool> device_pool;  // its cudaFree runs without mu
  {
    // The copies into the device read pinned blocks, and leases' work uses device blocks:
    // both end before the pools unmap and free them (asleep, mu released).
    std::vector<std::shared_ptr<prim::CudaEvent>> events;
    {
      absl::MutexLock lock(&impl_->mu);
      for (const auto& t : impl_->tensors) {
        std::vector<std::shared_ptr<prim::CudaEvent>> e = t->GpuEvents();
        events.insert(events.end(), e.begin(), e.end());
      }
    }
    for (const auto& e : events) (void)e->Synchronize();
  }
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->tensors.clear();  // blocks back to the pools before they go
    impl_->pool.reset();
    device_pool = std::move(impl_->device_pool);
  }
  device_pool.reset();
  return impl_->close_status;
}

absl::StatusOr<std::unique_ptr<TensorStore>> TensorStore::Open(ObjectStore* volume,
                                                               const TensorStoreOptions& options) {
  if (volume == nullptr) return absl::InvalidArgumentError("tensor store: volume is null");
  if (options.host_budget_bytes == 0)
    return absl::InvalidArgumentError("tensor store: host_budget_bytes is 0");
  if (options.write_back_depth > kMaxWriteBackDepth) {
    return absl::InvalidArgumentError(
        fmt::format("tensor store: write_back_depth {} (at most {}; 0 for the default, {})",
                    options.write_back_depth, kMaxWriteBackDepth, kWriteBackDepth));
  }
  if (options.prefetch_threads < 1 || options.prefetch_threads > kMaxPrefetchThreads) {
    return absl::InvalidArgumentError(fmt::format("tensor store: prefetch_threads {} (1 to {})",
                                                  options.prefetch_threads, kMaxPrefetchThreads));
  }
  auto impl = std::make_unique<Impl>();
  impl->volume = volume;
  impl->options = options;
  if (options.ledger == nullptr) {
    impl->own_ledger = std::make_unique<MemoryLedger>();
    impl->ledger = impl->own_ledger.get();
  } else {
    impl->ledger = options.ledger;
  }
  HostArenaOptions ao;
  ao.budget_bytes = options.host_budget_bytes;
  // kAuto registers the budget with CUDA only for a store with a GPU tier: registering
  // creates a CUDA context (about 100 MiB of host memory on an H100 machine), which a CPU
  // user of the store must not pay for.
  ao.backing = options.host_backing == ArenaBacking::kAuto && options.gpu_budget_bytes == 0
                   ? ArenaBacking::kMlock
                   : options.host_backing;
  // Note [store regions]: the budget is used for the whole run, so the arena maps it in
  // few large regions: evicted blocks coalesce inside them and serve other sizes without
  // unmapping and re-locking memory, and a tight budget does not fragment across many
  // small regions (a block needs one free extent inside one region). Up to 256 MiB the
  // budget is one region; beyond, regions of 256 MiB or an eighth of the budget.
  const std::size_t budget = options.host_budget_bytes / 4096 * 4096;
  ao.chunk_bytes =
      budget <= (256u << 20) ? budget : std::max<std::size_t>(256u << 20, budget / 8) / 4096 * 4096;
  ao.ledger = impl->ledger;
  MEMASCEND_ASSIGN_OR_RETURN(impl->arena, HostArena::Create(ao));
  Impl* m = impl.get();
  for (int i = 0; i < options.prefetch_threads; ++i) {
    m->workers.push_back(prim::StartThread("ma-store-io", [m] { m->Work(); }));
  }
  return std::unique_ptr<TensorStore>(new TensorStore(std::move(impl)));
}

absl::StatusOr<TensorId> TensorStore::Register(const TensorSpec& spec) {
  Impl& m = *impl_;
  if (m.closed) return absl::FailedPreconditionError("tensor store: Register after Close()");
  if (spec.bytes == 0)
    return absl::InvalidArgumentError(fmt::format("tensor '{}' has 0 bytes", spec.name));
  if (!spec.shape.empty()) {  // a shape, where given, is of these bytes
    std::uint64_t bytes = SizeOf(spec.dtype);
    bool fits = true;
    for (const std::int64_t d : spec.shape)
      fits =
          fits && d >= 0 && !__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes);
    if (!fits || bytes != spec.bytes) {
      return absl::InvalidArgumentError(fmt::format("tensor '{}': shape [{}] of {} is not {} bytes",
                                                    spec.name, fmt::join(spec.shape, ", "),
                                                    ToString(spec.dtype), spec.bytes));
    }
  }
  if (spec.name.empty() || spec.name.size() > 255) {
    return absl::InvalidArgumentError("tensor names are 1..255 bytes");
  }
  if (spec.bytes > m.options.host_budget_bytes) {
    return absl::ResourceExhaustedError(
        fmt::format("tensor '{}' needs {}, more than the host budget of {}", spec.name,
                    util::FormatBytes(spec.bytes), util::FormatBytes(m.options.host_budget_bytes)));
  }
  {
    absl::MutexLock lock(&m.mu);
    if (m.names.contains(spec.name)) {
      return absl::AlreadyExistsError(fmt::format("tensor '{}' is registered already", spec.name));
    }
  }
  auto stored = m.volume->Stat(spec.name);
  const bool durable_copy = stored.ok() && stored->durability == Durability::kDurable &&
                            spec.durability == Durability::kDurable;
  if (durable_copy && stored->size != spec.bytes) {
    return absl::FailedPreconditionError(
        fmt::format("tensor '{}': the volume holds {} bytes, {} registered", spec.name,
                    stored->size, spec.bytes));
  }
  absl::MutexLock lock(&m.mu);
  if (m.names.contains(spec.name)) {
    return absl::AlreadyExistsError(fmt::format("tensor '{}' is registered already", spec.name));
  }
  {
    Claims& c = VolumeClaims();
    absl::MutexLock claims(&c.mu);
    auto [it, fresh] = c.owner.emplace(std::make_pair(m.volume, spec.name), &m);
    if (!fresh && it->second != &m) {
      return absl::AlreadyExistsError(fmt::format(
          "tensor '{}' is registered by another tensor store open on this volume: the two "
          "would overwrite each other's object; close that store, or give the tensor another "
          "name",
          spec.name));
    }
  }
  auto t = std::make_unique<Impl::Tensor>();
  t->spec = spec;
  t->stored = durable_copy;
  const auto id = static_cast<TensorId>(m.tensors.size());
  m.tensors.push_back(std::move(t));
  m.names.emplace(spec.name, id);
  return id;
}

absl::StatusOr<TensorId> TensorStore::Find(std::string_view name) const {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->names.find(name);
  if (it == impl_->names.end()) return absl::NotFoundError(fmt::format("no tensor '{}'", name));
  return it->second;
}

absl::StatusOr<TensorSpec> TensorStore::Spec(TensorId id) const {
  absl::MutexLock lock(&impl_->mu);
  MEMASCEND_RETURN_IF_ERROR(impl_->CheckId(id));
  return impl_->tensors[id]->spec;
}

std::vector<std::string> TensorStore::StoredTensors() const {
  std::vector<std::string> out;
  for (const ObjectInfo& o : impl_->volume->List()) {
    if (o.durability == Durability::kDurable) out.push_back(o.name);
  }
  return out;
}

absl::StatusOr<TensorLease> TensorStore::Acquire(TensorId id) {
  return Acquire(id, Tier::kPinnedHost);
}

absl::StatusOr<TensorLease> TensorStore::AcquireForWrite(TensorId id, Tier tier,
                                                         CudaStreamView stream) {
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, Acquire(id, tier, stream));
  lease.MarkDirty();
  return lease;
}

absl::StatusOr<TensorLease> TensorStore::Acquire(TensorId id, Tier tier, CudaStreamView stream) {
  if (impl_->closed) return absl::FailedPreconditionError("tensor store: Acquire after Close()");
  if (tier == Tier::kPinnedHost) return AcquireHost(id, /*read_only=*/false, stream);
  if (tier != Tier::kGpu) {
    return absl::InvalidArgumentError(
        fmt::format("tensor store: Acquire in tier {} (host or GPU only)", ToString(tier)));
  }
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  t.wanted = false;
  const bool hit = t.gpu != nullptr && t.gpu_valid;
  MEMASCEND_RETURN_IF_ERROR(m.GpuResidentLocked(t, stream, /*pin=*/true));
  (hit ? m.counters.prefetch_hits : m.counters.prefetch_misses)++;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.gpu, t.spec.bytes, Tier::kGpu, stream);
}

absl::StatusOr<TensorLease> TensorStore::AcquireForRead(TensorId id) {
  if (impl_->closed) return absl::FailedPreconditionError("tensor store: Acquire after Close()");
  return AcquireHost(id, /*read_only=*/true, {});
}

absl::StatusOr<TensorLease> TensorStore::AcquireHost(TensorId id, bool read_only,
                                                     CudaStreamView stream) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  bool loaded_here = false;
  if (read_only && t.state == Impl::State::kWriting && !(t.gpu != nullptr && t.gpu_dirty)) {
    // Note [reads during write-back]: the block is the tensor's bytes (a dirty device
    // copy would be newer: that waits as Acquire does).
    t.wanted = false;
    ++t.pins;
    t.last_use = ++m.tick;
    ++m.counters.prefetch_hits;
    m.counters.stall_seconds += Since(start);
    return TensorLease(this, id, t.block.data(), t.spec.bytes, Tier::kPinnedHost, {},
                       /*read_only=*/true);
  }
  MEMASCEND_RETURN_IF_ERROR(m.HostResidentLocked(t, &loaded_here));
  if (t.gpu != nullptr) {
    // A dirty device copy is the newest (Note [gpu tier]).
    if (absl::Status s = m.CopyBackLocked(t); !s.ok()) {
      --t.pins;
      m.cv.SignalAll();
      return s;
    }
  }
  if (!read_only) {
    m.WaitCopyFromHostLocked(t);
    ++t.host_writers;
  }
  t.last_use = ++m.tick;
  (loaded_here ? m.counters.prefetch_misses : m.counters.prefetch_hits)++;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.block.data(), t.spec.bytes, Tier::kPinnedHost, stream, read_only);
}

absl::StatusOr<TensorLease> TensorStore::AcquireForOverwrite(TensorId id) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  t.wanted = false;
  while (t.gpu_busy) m.cv.Wait(&m.mu);
  bool fresh = false;  // a block allocated here: not the one the last copy in read
  for (;;) {
    if (t.state == Impl::State::kResident) break;
    if (t.state == Impl::State::kCold) {
      MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, m.AllocateLocked(t));
      if (t.state == Impl::State::kCold) {  // nobody loaded it while room was made
        t.block = std::move(block);
        t.state = Impl::State::kResident;
        fresh = true;
        ++m.counters.overwrites;
      }
      continue;
    }
    m.cv.Wait(&m.mu);  // loading or being written back
  }
  ++t.pins;
  ++t.host_writers;
  if (!fresh) m.WaitCopyFromHostLocked(t);
  t.dirty = true;
  t.gpu_valid = false;
  t.gpu_dirty = false;
  t.last_use = ++m.tick;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.block.data(), t.spec.bytes, Tier::kPinnedHost, {});
}

absl::StatusOr<TensorLease> TensorStore::AcquireCopy(TensorId from, TensorId to) {
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(from));
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(to));
  Impl::Tensor& src = *m.tensors[from];
  Impl::Tensor& dst = *m.tensors[to];
  if (from == to || src.spec.bytes != dst.spec.bytes) {
    return absl::InvalidArgumentError(fmt::format("AcquireCopy '{}' -> '{}': {}", src.spec.name,
                                                  dst.spec.name,
                                                  from == to ? "the same tensor" : "sizes differ"));
  }
  const auto settled = [](const Impl::Tensor& t) {
    return !t.gpu_busy && t.state != Impl::State::kLoading && t.state != Impl::State::kWriting;
  };
  src.wanted = false;
  dst.wanted = false;
  for (;;) {
    while (!settled(src) || !settled(dst)) m.cv.Wait(&m.mu);
    if (dst.pins > 0 || dst.gpu_pins > 0) {
      return absl::FailedPreconditionError(
          fmt::format("AcquireCopy: tensor '{}' is leased", dst.spec.name));
    }
    if (src.gpu != nullptr && src.gpu_dirty) {  // the device holds the newest bytes
      MEMASCEND_RETURN_IF_ERROR(m.CopyBackLocked(src));
      continue;
    }
    if (src.state == Impl::State::kResident && src.pins == 0 && !src.dirty &&
        dst.state == Impl::State::kCold) {
      if (m.WaitCopyFromHostLocked(src)) continue;  // Note [host writes after a copy]
      // Hand the clean block over: the volume keeps the source's bytes.
      dst.block = std::move(src.block);
      src.state = Impl::State::kCold;
      dst.state = Impl::State::kResident;
      ++m.counters.handovers;
      ++m.counters.prefetch_hits;
      break;
    }
    // Note [host writes after a copy]: its own block, written below (a block allocated
    // here is not the one its last copy read: that one waits in the pool behind its fence).
    if (dst.state == Impl::State::kResident && m.WaitCopyFromHostLocked(dst)) continue;
    if (dst.state == Impl::State::kCold) {
      MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, m.AllocateLocked(dst));
      if (dst.state != Impl::State::kCold || !settled(src)) continue;  // changed meanwhile
      dst.block = std::move(block);
      dst.state = Impl::State::kResident;
    }
    if (src.state == Impl::State::kResident) {
      std::memcpy(dst.block.data(), src.block.data(), dst.spec.bytes);
      ++m.counters.prefetch_hits;
      break;
    }
    // The source is cold: read it from the volume into the destination's block.
    dst.state = Impl::State::kLoading;
    ++src.pins;  // keeps its state still while mu is released
    const auto read_start = Clock::now();
    m.mu.Unlock();
    absl::Status s;
    if (src.stored) {
      s = m.volume->Get(src.spec.name, {dst.block.data(), dst.block.capacity()}).status();
    } else {
      std::memset(dst.block.data(), 0, dst.spec.bytes);
    }
    m.mu.Lock();
    --src.pins;
    dst.state = Impl::State::kResident;
    m.cv.SignalAll();
    MEMASCEND_RETURN_IF_ERROR(s);
    ++m.counters.prefetch_misses;
    if (src.stored) {
      m.counters.bytes_read += src.spec.bytes;
      m.counters.read_seconds += Since(read_start);
    }
    break;
  }
  ++dst.pins;
  ++dst.host_writers;
  dst.dirty = true;
  dst.gpu_valid = false;
  dst.gpu_dirty = false;
  dst.last_use = ++m.tick;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, to, dst.block.data(), dst.spec.bytes, Tier::kPinnedHost, {});
}

PrefetchTicket TensorStore::Prefetch(TensorId id) { return Prefetch(id, Tier::kPinnedHost); }

PrefetchTicket TensorStore::Prefetch(TensorId id, Tier tier, CudaStreamView stream) {
  auto state = std::make_shared<PrefetchTicket::State>();
  absl::MutexLock lock(&impl_->mu);
  if (absl::Status s = impl_->CheckId(id); !s.ok()) {
    state->Finish(s);
  } else if (tier != Tier::kPinnedHost && tier != Tier::kGpu) {
    state->Finish(absl::InvalidArgumentError(
        fmt::format("tensor store: Prefetch to tier {} (host or GPU only)", ToString(tier))));
  } else if (tier == Tier::kGpu) {
    if (absl::Status usable = impl_->GpuUsableLocked(); !usable.ok()) {
      state->Finish(usable);
    } else {
      impl_->jobs.push_back({id, tier, stream, state});
    }
  } else {
    Impl::Tensor& t = *impl_->tensors[id];
    t.wanted = true;
    if (t.state != Impl::State::kCold) {
      state->Finish(absl::OkStatus());
    } else {
      impl_->jobs.push_back({id, tier, stream, state});
    }
  }
  return PrefetchTicket(state);
}

absl::Status TensorStore::WriteBack(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  if (t.gpu != nullptr) MEMASCEND_RETURN_IF_ERROR(m.CopyBackLocked(t));
  while (t.state == Impl::State::kLoading || t.state == Impl::State::kWriting) m.cv.Wait(&m.mu);
  return m.WriteBackLocked(t);
}

absl::Status TensorStore::WriteBehind(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  const Impl::Tensor& t = *m.tensors[id];
  if (t.pins == 0 && t.dirty && t.gpu == nullptr && t.spec.durability == Durability::kDurable &&
      t.state == Impl::State::kResident) {
    m.jobs.push_back({id, Tier::kPinnedHost, {}, nullptr});  // Note [write-behind]
  }
  return absl::OkStatus();
}

bool TensorStore::WritePending(TensorId id) const {
  const Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (!m.CheckId(id).ok()) return false;
  const Impl::Tensor& t = *m.tensors[id];
  return t.dirty || t.state == Impl::State::kWriting;
}

absl::Status TensorStore::WriteBack(std::span<const TensorId> ids) {
  // Note [write-back depth]: workers take the next id in turn; WriteBackLocked releases mu
  // during each put, so their I/O overlaps.
  const std::size_t depth =
      impl_->options.write_back_depth == 0 ? kWriteBackDepth : impl_->options.write_back_depth;
  const std::size_t workers = std::min(ids.size(), depth);
  if (workers <= 1) {
    absl::Status first;
    for (TensorId id : ids) first.Update(WriteBack(id));
    return first;
  }
  std::atomic<std::size_t> next{0};
  absl::Mutex mu;
  absl::Status first;
  const auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < ids.size();) {
      absl::Status s = WriteBack(ids[i]);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        first.Update(std::move(s));
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (std::size_t w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads to be had (a pids limit): those made do the rest
    }
  }
  work();
  for (std::thread& t : threads) t.join();
  return first;
}

absl::Status TensorStore::Evict(TensorId id, Tier tier) {
  if (tier == Tier::kPinnedHost) return Evict(id);
  if (tier != Tier::kGpu) {
    return absl::InvalidArgumentError(
        fmt::format("tensor store: Evict from tier {} (host or GPU only)", ToString(tier)));
  }
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  return m.EvictGpuLocked(*m.tensors[id]);
}

absl::Status TensorStore::Evict(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  if (t.gpu != nullptr) MEMASCEND_RETURN_IF_ERROR(m.EvictGpuLocked(t));
  t.wanted = false;
  for (;;) {
    while (t.state == Impl::State::kLoading || t.state == Impl::State::kWriting) m.cv.Wait(&m.mu);
    if (t.pins > 0)
      return absl::FailedPreconditionError(fmt::format("tensor '{}' is leased", t.spec.name));
    if (t.state == Impl::State::kCold) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(m.WriteBackLocked(t));
    if (t.state == Impl::State::kResident && t.pins == 0 && !t.dirty) break;
  }
  t.block.Reset();
  t.state = Impl::State::kCold;
  ++m.counters.evictions;
  m.RetryDeferredLocked();
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TensorStore::Discard(TensorId id) {
  Impl& m = *impl_;
  std::shared_ptr<prim::CudaEvent> ready;  // let go of after the lock (Note [store locking])
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  while (t.gpu_busy || t.state == Impl::State::kLoading || t.state == Impl::State::kWriting)
    m.cv.Wait(&m.mu);
  if (t.pins > 0 || t.gpu_pins > 0)
    return absl::FailedPreconditionError(fmt::format("tensor '{}' is leased", t.spec.name));
  t.wanted = false;
  if (t.gpu != nullptr) {
    // The copy in and the device leases' work end before the block is reused: waited for
    // with the tensor claimed and mu released (Note [store locking]).
    m.ClaimGpuLocked(t);
    m.WaitGpuWorkLocked(t);
    m.UnclaimGpuLocked(t);
    if (t.pins > 0 || t.gpu_pins > 0)
      return absl::FailedPreconditionError(fmt::format("tensor '{}' is leased", t.spec.name));
    if (t.gpu != nullptr) MEMASCEND_RETURN_IF_ERROR(m.FreeGpuBlockLocked(t, &ready));
  }
  if (t.state == Impl::State::kResident) {
    t.block.Reset();
    t.state = Impl::State::kCold;
  }
  t.dirty = false;
  ++m.counters.discards;
  m.RetryDeferredLocked();
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TensorStore::SetRetention(TensorId id, Retention retention) {
  absl::MutexLock lock(&impl_->mu);
  MEMASCEND_RETURN_IF_ERROR(impl_->CheckId(id));
  impl_->tensors[id]->retention = retention;
  return absl::OkStatus();
}

absl::Status TensorStore::Flush() {
  if (impl_->closed) return absl::FailedPreconditionError("tensor store: Flush after Close()");
  // Durable tensors only: a scratch tensor's bytes are not committed and survive no
  // crash, so writing them here would cost I/O for nothing, and could race with a
  // holder still writing them (a Flush on another thread).
  std::vector<TensorId> durable;
  {
    absl::MutexLock lock(&impl_->mu);
    for (TensorId id = 0; id < impl_->tensors.size(); ++id) {
      if (impl_->tensors[id]->spec.durability == Durability::kDurable) durable.push_back(id);
    }
  }
  absl::Status first = WriteBack(durable);
  if (first.ok()) first = impl_->volume->Sync();  // one commit for everything written back
  return first;
}

void TensorStore::SetCommitWhenFull(bool commit) noexcept { impl_->commit_when_full = commit; }
void TensorStore::SetCommitAtClose(bool commit) noexcept { impl_->commit_at_close = commit; }

TensorStoreStats TensorStore::stats() const {
  absl::MutexLock lock(&impl_->mu);
  TensorStoreStats s = impl_->counters;
  s.tensors = impl_->tensors.size();
  for (const auto& t : impl_->tensors) {
    if (t->state != Impl::State::kCold) {
      ++s.resident;
      s.resident_bytes += t->spec.bytes;
    }
    if (t->gpu != nullptr) {
      ++s.gpu_resident;
      s.gpu_resident_bytes += t->spec.bytes;
    }
  }
  s.ledger = impl_->ledger->Snapshot();
  return s;
}

void TensorStore::Unpin(TensorId id, Tier tier, CudaStreamView stream, bool read_only) noexcept {
  // The block is reused only after the work the lease's holder queued on its stream: an
  // event recorded there, made before taking mu (Note [store locking]).
  std::shared_ptr<prim::CudaEvent> idle;
  if (tier == Tier::kGpu) {
    const prim::DeviceGuard on(impl_->options.gpu_device);  // Note [current device]
    auto event = prim::CudaEvent::Create();
    if (on.status().ok() && event.ok() && event->Record(stream).ok()) {
      idle = std::make_shared<prim::CudaEvent>(*std::move(event));
    } else {
      (void)prim::SynchronizeStream(stream);  // no event: wait for the work here instead
    }
  }
  absl::MutexLock lock(&impl_->mu);
  Impl::Tensor& t = *impl_->tensors[id];
  if (tier == Tier::kGpu) {
    // Kept beside the other leases' (Note [gpu tier]): a later lease on another stream,
    // or the block's reuse, waits for all of them.
    if (idle != nullptr) t.gpu_uses.push_back(std::move(idle));
    --t.gpu_pins;
    t.gpu_last_use = ++impl_->tick;
  } else {
    --t.pins;
    if (!read_only) --t.host_writers;
    t.last_use = ++impl_->tick;
    if (t.pins == 0) impl_->RetryDeferredLocked();  // an evictable tensor, maybe
    if (impl_->options.write_behind && t.pins == 0 && t.dirty && t.gpu == nullptr &&
        t.spec.durability == Durability::kDurable && t.spec.use != Use::kGradients &&
        t.state == Impl::State::kResident) {
      impl_->jobs.push_back({id, Tier::kPinnedHost, {}, nullptr});
    }
  }
  impl_->cv.SignalAll();
}

void TensorStore::Dirty(TensorId id, Tier tier) noexcept {
  absl::MutexLock lock(&impl_->mu);
  Impl::Tensor& t = *impl_->tensors[id];
  if (tier == Tier::kGpu) {
    t.gpu_dirty = true;
    return;
  }
  t.dirty = true;
  t.gpu_valid = false;  // the device copy is stale now: the next GPU acquire copies again
  t.gpu_dirty = false;
}

// ---- TensorLease ---------------------------------------------------------------------

TensorLease::TensorLease(TensorLease&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)),
      id_(o.id_),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      tier_(o.tier_),
      stream_(o.stream_),
      read_only_(o.read_only_) {}

TensorLease& TensorLease::operator=(TensorLease&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = std::exchange(o.store_, nullptr);
    id_ = o.id_;
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    tier_ = o.tier_;
    stream_ = o.stream_;
    read_only_ = o.read_only_;
  }
  return *this;
}

TensorLease::~TensorLease() { Release(); }

void TensorLease::MarkDirty() noexcept {
  if (store_ == nullptr) return;
  if (read_only_) {
    // Its bytes may be on their way to the volume (Note [reads during write-back]).
    fmt::print(stderr,
               "memascend: MarkDirty on a lease from AcquireForRead (tensor {}): a read lease "
               "must not be written; use Acquire or AcquireForWrite\n",
               id_);
    std::abort();
  }
  store_->Dirty(id_, tier_);
}

void TensorLease::Release() noexcept {
  if (store_ == nullptr) return;
  std::exchange(store_, nullptr)->Unpin(id_, tier_, stream_, read_only_);
  data_ = nullptr;
  size_ = 0;
}

// ---- TensorStream --------------------------------------------------------------------

TensorStream::TensorStream(TensorStore* store, std::vector<TensorId> order, std::size_t window)
    : store_(store), order_(std::move(order)), window_(window) {}

void TensorStream::Fill() {
  if (prefetched_ < position_ + 1) prefetched_ = position_ + 1;  // the current one is acquired
  while (prefetched_ < order_.size() && prefetched_ <= position_ + window_) {
    (void)store_->Prefetch(order_[prefetched_++]);  // its completion is seen through Acquire
  }
}

absl::StatusOr<TensorLease> TensorStream::Next() {
  if (position_ >= order_.size()) return absl::OutOfRangeError("the stream is over");
  Fill();
  return store_->Acquire(order_[position_++]);
}

void TensorStream::Reverse() {
  std::reverse(order_.begin(), order_.end());
  Restart();
}

void TensorStream::Restart() {
  position_ = 0;
  prefetched_ = 0;
}

}  // namespace memascend
