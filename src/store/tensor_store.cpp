#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>

#include "util/units.h"

namespace memascend {

struct PrefetchTicket::State {
  absl::Mutex mu;
  absl::CondVar cv;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::atomic<bool> finished{false};

  void Finish(absl::Status s) {
    absl::MutexLock lock(&mu);
    status = std::move(s);
    done = true;
    finished.store(true);
    cv.SignalAll();
  }
};

absl::Status PrefetchTicket::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty prefetch ticket");
  absl::MutexLock lock(&state_->mu);
  while (!state_->done) state_->cv.Wait(&state_->mu);
  return state_->status;
}

bool PrefetchTicket::Poll() const { return state_ != nullptr && state_->finished.load(); }

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string Metadata(const TensorSpec& s) {
  std::string shape;
  for (std::size_t i = 0; i < s.shape.size(); ++i)
    shape += (i ? "," : "") + std::to_string(s.shape[i]);
  return fmt::format("dtype={};shape={};use={}", ToString(s.dtype), shape, ToString(s.use));
}

}  // namespace

struct TensorStore::Impl {
  enum class State { kCold, kLoading, kResident, kWriting };
  struct Tensor {
    TensorSpec spec;
    State state = State::kCold;
    PinnedBlock block;
    int pins = 0;
    bool dirty = false;
    bool stored = false;  // the volume holds its bytes
    std::uint64_t last_use = 0;
  };

  Volume* volume = nullptr;
  TensorStoreOptions options;
  std::unique_ptr<MemoryLedger> own_ledger;
  MemoryLedger* ledger = nullptr;
  std::unique_ptr<HostArena> arena;

  mutable absl::Mutex mu;
  absl::CondVar cv;
  std::unique_ptr<PinnedPool> pool
      ABSL_GUARDED_BY(mu);  // made at first use, from the registered sizes
  std::vector<std::unique_ptr<Tensor>> tensors ABSL_GUARDED_BY(mu);
  std::map<std::string, TensorId, std::less<>> names ABSL_GUARDED_BY(mu);
  std::uint64_t tick ABSL_GUARDED_BY(mu) = 0;
  TensorStoreStats counters ABSL_GUARDED_BY(mu);

  std::deque<std::pair<TensorId, std::shared_ptr<PrefetchTicket::State>>> jobs ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::vector<std::thread> workers;

  absl::Status CheckId(TensorId id) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (id >= tensors.size())
      return absl::InvalidArgumentError(fmt::format("no tensor with id {}", id));
    return absl::OkStatus();
  }

  absl::Status EnsurePool() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (pool != nullptr) return absl::OkStatus();
    PinnedPoolOptions po;
    po.reuse_free_regions = true;  // a fixed budget, used for the whole run
    po.expected_sizes = options.expected_sizes;
    for (const auto& t : tensors) po.expected_sizes.push_back(t->spec.bytes);
    MEMASCEND_ASSIGN_OR_RETURN(pool, PinnedPool::Create(arena.get(), po));
    return absl::OkStatus();
  }

  // Writes a resident tensor back; mu is released during the I/O.
  absl::Status WriteBackLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (t.state != State::kResident || !t.dirty) return absl::OkStatus();
    t.state = State::kWriting;
    t.dirty = false;
    const auto start = Clock::now();
    mu.Unlock();
    absl::Status s = volume->Put(t.spec.name, {t.block.data(), t.spec.bytes}, t.spec.durability,
                                 Metadata(t.spec));
    mu.Lock();
    t.state = State::kResident;
    cv.SignalAll();
    if (!s.ok()) {
      t.dirty = true;
      return s;
    }
    t.stored = true;
    ++counters.write_backs;
    counters.bytes_written += t.spec.bytes;
    counters.write_seconds += Since(start);
    return absl::OkStatus();
  }

  // A block for `bytes`, evicting unleased tensors (least recently used first) while the
  // budget is short (Note [residency]).
  absl::StatusOr<PinnedBlock> AllocateLocked(const Tensor& wanting)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_RETURN_IF_ERROR(EnsurePool());
    for (;;) {
      auto block = pool->Allocate(wanting.spec.bytes, wanting.spec.use);
      if (block.ok() || block.status().code() != absl::StatusCode::kResourceExhausted) return block;
      Tensor* victim = nullptr;
      for (const auto& t : tensors) {
        if (t.get() != &wanting && t->state == State::kResident && t->pins == 0 &&
            (victim == nullptr || t->last_use < victim->last_use)) {
          victim = t.get();
        }
      }
      if (victim == nullptr) {
        std::uint64_t held = 0;
        for (const auto& t : tensors) held += t->state == State::kCold ? 0 : t->block.capacity();
        return absl::ResourceExhaustedError(fmt::format(
            "tensor '{}' needs {} but the host budget of {} is held by leased or loading tensors "
            "({}); "
            "{} short",
            wanting.spec.name, util::FormatBytes(wanting.spec.bytes),
            util::FormatBytes(options.host_budget_bytes), util::FormatBytes(held),
            util::FormatBytes(
                held + pool->BlockBytesFor(wanting.spec.bytes) > options.host_budget_bytes
                    ? held + pool->BlockBytesFor(wanting.spec.bytes) - options.host_budget_bytes
                    : pool->BlockBytesFor(wanting.spec.bytes))));
      }
      MEMASCEND_RETURN_IF_ERROR(WriteBackLocked(*victim));
      if (victim->state != State::kResident || victim->pins != 0)
        continue;  // changed while writing
      victim->block.Reset();
      victim->state = State::kCold;
      ++counters.evictions;
      cv.SignalAll();
    }
  }

  // Starts making a cold `t` resident (without pinning it). Making room may release mu:
  // if another thread took the tensor meanwhile, the block goes back and the caller
  // looks at the tensor's state again.
  absl::Status LoadLocked(Tensor& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block, AllocateLocked(t));
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

  void Work() {
    for (;;) {
      std::pair<TensorId, std::shared_ptr<PrefetchTicket::State>> job;
      absl::Status s;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Impl* m)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->mu) { return m->stop || !m->jobs.empty(); },
            this));
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
        Tensor& t = *tensors[job.first];
        for (;;) {
          while (t.state == State::kLoading || t.state == State::kWriting) cv.Wait(&mu);
          if (t.state != State::kCold || !s.ok()) break;
          s = LoadLocked(t);
        }
      }
      job.second->Finish(std::move(s));
    }
  }
};

TensorStore::TensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TensorStore::~TensorStore() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stop = true;
    for (auto& [id, ticket] : impl_->jobs)
      ticket->Finish(absl::CancelledError("the store is closing"));
    impl_->jobs.clear();
  }
  for (std::thread& w : impl_->workers) w.join();
  absl::MutexLock lock(&impl_->mu);
  impl_->tensors.clear();  // blocks back to the pool before it goes
  impl_->pool.reset();
}

absl::StatusOr<std::unique_ptr<TensorStore>> TensorStore::Open(Volume* volume,
                                                               const TensorStoreOptions& options) {
  if (volume == nullptr) return absl::InvalidArgumentError("tensor store: volume is null");
  if (options.host_budget_bytes == 0)
    return absl::InvalidArgumentError("tensor store: host_budget_bytes is 0");
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
  // Regions of a quarter of the budget (at most 64 MiB): evicted blocks coalesce inside
  // them and serve other sizes without unmapping and re-locking memory.
  ao.chunk_bytes = std::min<std::size_t>(64u << 20, options.host_budget_bytes / 4) / 4096 * 4096;
  ao.ledger = impl->ledger;
  MEMASCEND_ASSIGN_OR_RETURN(impl->arena, HostArena::Create(ao));
  Impl* m = impl.get();
  for (int i = 0; i < std::max(options.prefetch_threads, 1); ++i)
    m->workers.emplace_back([m] { m->Work(); });
  return std::unique_ptr<TensorStore>(new TensorStore(std::move(impl)));
}

absl::StatusOr<TensorId> TensorStore::Register(const TensorSpec& spec) {
  Impl& m = *impl_;
  if (spec.bytes == 0)
    return absl::InvalidArgumentError(fmt::format("tensor '{}' has 0 bytes", spec.name));
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
  Impl& m = *impl_;
  const auto start = Clock::now();
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
  bool loaded_here = false;
  for (;;) {
    if (t.state == Impl::State::kResident) break;
    if (t.state == Impl::State::kCold) {
      loaded_here = true;
      MEMASCEND_RETURN_IF_ERROR(m.LoadLocked(t));
      continue;
    }
    m.cv.Wait(&m.mu);  // loading (a prefetch) or being written back
  }
  ++t.pins;
  t.last_use = ++m.tick;
  (loaded_here ? m.counters.prefetch_misses : m.counters.prefetch_hits)++;
  m.counters.stall_seconds += Since(start);
  return TensorLease(this, id, t.block.data(), t.spec.bytes);
}

PrefetchTicket TensorStore::Prefetch(TensorId id) {
  auto state = std::make_shared<PrefetchTicket::State>();
  absl::MutexLock lock(&impl_->mu);
  if (absl::Status s = impl_->CheckId(id); !s.ok()) {
    state->Finish(s);
  } else if (impl_->tensors[id]->state != Impl::State::kCold) {
    state->Finish(absl::OkStatus());
  } else {
    impl_->jobs.emplace_back(id, state);
  }
  return PrefetchTicket(state);
}

absl::Status TensorStore::WriteBack(TensorId id) {
  absl::MutexLock lock(&impl_->mu);
  MEMASCEND_RETURN_IF_ERROR(impl_->CheckId(id));
  Impl::Tensor& t = *impl_->tensors[id];
  while (t.state == Impl::State::kLoading || t.state == Impl::State::kWriting)
    impl_->cv.Wait(&impl_->mu);
  return impl_->WriteBackLocked(t);
}

absl::Status TensorStore::Evict(TensorId id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  MEMASCEND_RETURN_IF_ERROR(m.CheckId(id));
  Impl::Tensor& t = *m.tensors[id];
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
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TensorStore::Flush() {
  std::size_t count;
  {
    absl::MutexLock lock(&impl_->mu);
    count = impl_->tensors.size();
  }
  absl::Status first;
  for (TensorId id = 0; id < count; ++id) first.Update(WriteBack(id));
  return first;
}

TensorStoreStats TensorStore::stats() const {
  absl::MutexLock lock(&impl_->mu);
  TensorStoreStats s = impl_->counters;
  s.tensors = impl_->tensors.size();
  for (const auto& t : impl_->tensors) {
    if (t->state != Impl::State::kCold) {
      ++s.resident;
      s.resident_bytes += t->spec.bytes;
    }
  }
  s.ledger = impl_->ledger->Snapshot();
  return s;
}

void TensorStore::Unpin(TensorId id) noexcept {
  absl::MutexLock lock(&impl_->mu);
  Impl::Tensor& t = *impl_->tensors[id];
  --t.pins;
  t.last_use = ++impl_->tick;
  impl_->cv.SignalAll();
}

void TensorStore::Dirty(TensorId id) noexcept {
  absl::MutexLock lock(&impl_->mu);
  impl_->tensors[id]->dirty = true;
}

// ---- TensorLease ---------------------------------------------------------------------

TensorLease::TensorLease(TensorLease&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)),
      id_(o.id_),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

TensorLease& TensorLease::operator=(TensorLease&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = std::exchange(o.store_, nullptr);
    id_ = o.id_;
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

TensorLease::~TensorLease() { Release(); }

void TensorLease::MarkDirty() noexcept {
  if (store_ != nullptr) store_->Dirty(id_);
}

void TensorLease::Release() noexcept {
  if (store_ == nullptr) return;
  std::exchange(store_, nullptr)->Unpin(id_);
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
