// memascend/tensor_store.h: tensors kept on a volume and brought into pinned host memory
// on demand, under a hard byte budget.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto store, memascend::TensorStore::Open(volume.get(), options));
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::TensorId w, store->Register({"layers.0.w", bytes,
//       memascend::DType::kBF16, {4096, 4096}, memascend::Use::kParameters,
//       memascend::Durability::kDurable}));
//   auto next = store->Prefetch(w1);                      // starts the read, does not block
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::TensorLease lease, store->Acquire(w));
//   Compute(lease.data(), lease.size());
//   lease.MarkDirty();                                     // written back before its memory is
//   reused
//
// Note [residency]: a tensor is on the volume, loading, or resident in a pinned block.
// A lease pins it resident. To make room, the store evicts unleased resident tensors,
// least recently used first, writing dirty ones back to the volume first; the bytes it
// holds never pass host_budget_bytes. A tensor prefetched and not used since (acquired,
// discarded or evicted) is wanted soon: it goes only after every other unleased tensor
// (kept ones too, Note [retention]), and a prefetch never evicts one. A prefetch that
// finds no other room is dropped (its ticket reports kResourceExhausted,
// stats().prefetch_dropped counts it, and Acquire then reads the tensor itself); so a
// prefetch window larger than the budget cannot evict what it prefetched before it is
// used. With options.defer_prefetches it waits for room instead
// (stats().prefetch_deferred counts it): it is tried again, earliest first, whenever a
// lease ends or a tensor is discarded or evicted, and its ticket completes once the
// tensor is resident, or when the tensor was used, discarded or evicted first (an
// Acquire then read it itself). A window larger than the budget then loses none of its
// reads: they start as the earlier tensors are used and released. A deferred prefetch
// holds nothing, and nobody waits on it but its ticket's holder, who must not wait
// while everything that could make room waits too (a caller that waits on tickets
// leaves the option off). When everything resident is leased, Acquire fails
// with kResourceExhausted saying how many bytes are missing. A tensor never written
// reads as zeros. Durable tensors are written back as staged objects (Note [staged puts]
// in volume.h); Flush() writes every dirty durable tensor and commits everything written back
// since the last Flush in one journal commit; a store reopened on the same volume then
// finds them. After a crash, durable tensors hold what the last Flush committed.
// Note [reads during write-back]: a write-back reads the tensor's block while its put is
// in flight, with the store's lock released. Acquire waits for it to end, since its
// lease may write (MarkDirty) and a write meanwhile would leave torn bytes on the volume.
// AcquireForRead does not wait: its lease is for reading, as the write-back is, so it
// pins the block during the put (no eviction takes it when the put ends). A commit
// writes a whole state back a few tensors at a time, each a put's time (milliseconds at
// a disk's rate), and whatever sweeps the state meanwhile (a forward pass reading each
// part of the parameters, then the backward pass again) would otherwise meet the commit
// on every sweep and wait for each put it meets.
// Note [commit when full]: a write-back that finds the volume full commits what is staged
// (freeing the extents it replaces) and tries once more. A caller that orders the commits
// itself, because what each commit holds matters (a training state updated in place,
// Note [state in place] in training_state.h), turns this off with SetCommitWhenFull(false);
// the write-back then fails with kResourceExhausted and its tensor stays dirty. Such a
// caller also turns off the commit at close (SetCommitAtClose(false)): Close() and the
// destructor then write back and commit nothing, and once the store's threads are done
// they drop the staged objects of its durable tensors (ObjectStore::DropStaged: what is
// dirty or staged of them is gone, and the volume keeps its last commit, in this process
// too), since a commit the caller did not order could hold half of what it orders (a
// training state's parts of a step without its record).
//
// Note [gpu tier]: with options.gpu_budget_bytes > 0 and a CUDA device, Acquire(id,
// Tier::kGpu, stream) gives a lease on a device copy. The store takes one device slab of
// the GPU budget at the first GPU acquire (cudaMalloc synchronises the device, so it is
// never called per tensor) and carves it best-fit. The copy from the pinned host block
// is queued on the caller's stream: work the caller queues on that stream after Acquire
// sees the bytes; another stream is made to wait for the copy's event. The host block
// goes back to the pool only after that event completes. A released GPU lease leaves an
// event on its stream: a later GPU lease's stream waits for those not yet complete (it
// sees earlier leases' writes, and writes after their reads), and nothing reuses or
// copies back the block before all of them and the copy in have completed. A GPU lease
// marked dirty makes the device copy the newest: WriteBack, Flush, Evict and a host
// Acquire first copy it back, after that work. A host lease marked dirty makes the
// device copy stale: the next GPU Acquire copies again. Device blocks are evicted least
// recently used first. Without a device, or with a zero GPU budget, the GPU tier reports
// kFailedPrecondition and everything else works.
//
// Thread-safety: every method may be called from any thread. Several leases of one
// tensor may be held at once (readers coordinate their writes themselves).
// Lifetime: the volume must outlive the store; leases must not outlive the store. A
// prefetch ticket may: one still pending when the store closes reports kCancelled.
#ifndef MEMASCEND_TENSOR_STORE_H_
#define MEMASCEND_TENSOR_STORE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/cuda.h>
#include <memascend/host_arena.h>
#include <memascend/kernels.h>
#include <memascend/memory_ledger.h>
#include <memascend/pinned_pool.h>
#include <memascend/volume.h>

namespace memascend {

using TensorId = std::uint32_t;

struct TensorSpec {
  std::string name;
  std::size_t bytes = 0;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  Use use = Use::kParameters;
  Durability durability = Durability::kDurable;
};

struct TensorStoreOptions {
  std::size_t host_budget_bytes = 0;  // pinned host bytes the store may hold (required)
  // Sizes the pool should expect besides the registered tensors' (which it learns).
  std::vector<std::size_t> expected_sizes;
  // Threads that read tensors ahead (Prefetch) and run the write-behinds, each I/O at a
  // time: the store's I/O in flight besides its callers' own. Open refuses fewer than 1 or
  // more than TensorStore::kMaxPrefetchThreads.
  int prefetch_threads = 2;
  // Tensors written back at once by WriteBack(ids) (Note [write-back depth]); 0: the
  // default, kWriteBackDepth. Open refuses more than kMaxWriteBackDepth.
  std::size_t write_back_depth = 0;
  // Note [write-behind]: a durable tensor released dirty is written back by the prefetch
  // threads at once, not when its memory is next needed: evictions then find clean
  // tensors and the writes overlap the caller's work. Worth it when each version is
  // written back anyway (a training step's new states); wasteful for a tensor dirtied
  // again and again while resident. Gradients (Use::kGradients) are not written behind:
  // read once by the update and discarded, they are written only when evicted or asked
  // (WriteBack, Flush).
  bool write_behind = false;
  // A prefetch that finds no room waits for some rather than being dropped (Note
  // [residency]): for a caller that prefetches a window ahead and never waits on tickets.
  bool defer_prefetches = false;
  // How the pinned pool sizes its blocks: the workload-adaptive classes (the default),
  // or powers of two as PyTorch's caching host allocator does (for ablations).
  PoolPolicy pool_policy = PoolPolicy::kAdaptive;
  // How the host budget is page-locked. kAuto: registered with CUDA (true DMA to and from
  // the GPU) when the store has a GPU tier (gpu_budget_bytes > 0) and a device is present,
  // else mlock'ed: a CPU-only user gets no CUDA context (about 100 MiB of host memory on
  // an H100 machine).
  ArenaBacking host_backing = ArenaBacking::kAuto;
  // Device bytes of the GPU tier (Note [gpu tier]); 0: no GPU tier.
  std::size_t gpu_budget_bytes = 0;
  int gpu_device = 0;
  MemoryLedger* ledger = nullptr;  // null: the store keeps its own
};

struct TensorStoreStats {
  std::uint64_t tensors = 0;
  std::uint64_t resident = 0;
  std::uint64_t resident_bytes = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  double read_seconds = 0;
  double write_seconds = 0;
  // Acquire found the tensor resident or loading (AcquireCopy: the source resident).
  std::uint64_t prefetch_hits = 0;
  std::uint64_t prefetch_misses = 0;   // ... had to start the read itself
  std::uint64_t prefetch_dropped = 0;  // a Prefetch found no room (Note [residency])
  // A Prefetch found no room and waits for some (defer_prefetches); each retry that
  // finds none counts again.
  std::uint64_t prefetch_deferred = 0;
  std::uint64_t overwrites = 0;  // AcquireForOverwrite calls that skipped a read
  std::uint64_t handovers = 0;   // AcquireCopy calls that took the source's block
  double stall_seconds = 0;      // time callers waited in Acquire, AcquireForOverwrite, AcquireCopy
  std::uint64_t evictions = 0;
  std::uint64_t write_backs = 0;
  std::uint64_t discards = 0;
  std::uint64_t gpu_resident = 0;
  std::uint64_t gpu_resident_bytes = 0;
  std::uint64_t bytes_to_gpu = 0;    // host-to-device copies
  std::uint64_t bytes_from_gpu = 0;  // device-to-host copies of dirty device tensors
  std::uint64_t gpu_evictions = 0;
  LedgerSnapshot ledger;
};

// Note [retention]: a hint for a caller that knows its access pattern. A trainer visits
// every tensor once per step in the same order; when the state is larger than the
// budget, least-recently-used eviction then keeps nothing from one step to the next (each
// tensor is evicted before its next use). Marking a fixed subset kKeep makes it stay:
// kept tensors are evicted only after every tensor that is neither kept nor wanted, and
// a prefetch never evicts one, so the subset is read once and then served from memory
// each step. Kept tensors are still written back (write-behind, Flush) as any other.
enum class Retention { kNormal, kKeep };

class TensorStore;

// Keeps a tensor resident while held. Move-only.
class TensorLease {
 public:
  TensorLease() noexcept = default;
  TensorLease(TensorLease&& other) noexcept;
  TensorLease& operator=(TensorLease&& other) noexcept;
  TensorLease(const TensorLease&) = delete;
  TensorLease& operator=(const TensorLease&) = delete;
  ~TensorLease();

  // Pinned host bytes, or device bytes for a lease of Tier::kGpu.
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  // The bytes as elements of T (size() / sizeof(T) of them): lease.as<float>()[i].
  template <typename T>
  std::span<T> as() const noexcept {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }
  TensorId id() const noexcept { return id_; }
  Tier tier() const noexcept { return tier_; }
  // The tensor's bytes changed: write them back before the memory is reused. A lease
  // from AcquireForWrite is dirty from the start and needs no call; one from
  // AcquireForRead must not be written: MarkDirty on it stops the process.
  void MarkDirty() noexcept;
  bool read_only() const noexcept { return read_only_; }
  void Release() noexcept;

 private:
  friend class TensorStore;
  TensorLease(TensorStore* store, TensorId id, std::byte* data, std::size_t size, Tier tier,
              CudaStreamView stream, bool read_only = false) noexcept
      : store_(store),
        id_(id),
        data_(data),
        size_(size),
        tier_(tier),
        stream_(stream),
        read_only_(read_only) {}
  TensorStore* store_ = nullptr;
  TensorId id_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  Tier tier_ = Tier::kPinnedHost;
  CudaStreamView stream_;
  bool read_only_ = false;  // from AcquireForRead
};

// The completion of a Prefetch(): OK once the tensor is resident (or was used, discarded
// or evicted before it could be loaded); the read's error otherwise; kCancelled when the
// store closes first.
class PrefetchTicket {
 public:
  PrefetchTicket() = default;
  absl::Status Wait();
  bool Poll() const;

 private:
  friend class TensorStore;
  struct State;
  explicit PrefetchTicket(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class TensorStore {
 public:
  // `volume`: where tensors live, a Volume or any ObjectStore (a FileObjectStore:
  // memascend/object_store.h); it must outlive the store. kInvalidArgument for a zero
  // budget.
  static absl::StatusOr<std::unique_ptr<TensorStore>> Open(ObjectStore* volume,
                                                           const TensorStoreOptions& options);
  // Closes the store if Close() was not called. Dirty durable tensors are never dropped
  // silently: they are written back and committed as by Close(), and if that fails the
  // error is printed to stderr with the tensors it concerns.
  ~TensorStore();
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  // Registers a tensor. If the volume holds a durable object of that name (a tensor
  // stored by an earlier run), its size must match and its contents are the tensor's.
  // kAlreadyExists for a name registered twice; kInvalidArgument for 0 bytes or a bad name.
  absl::StatusOr<TensorId> Register(const TensorSpec& spec);
  absl::StatusOr<TensorId> Find(std::string_view name) const;
  absl::StatusOr<TensorSpec> Spec(TensorId id) const;
  // The names of the durable tensors stored on the volume (by earlier runs or this one).
  std::vector<std::string> StoredTensors() const;

  // Makes the tensor resident in pinned host memory and pins it (Note [residency]).
  absl::StatusOr<TensorLease> Acquire(TensorId id);
  // The same in `tier`: Tier::kPinnedHost, or Tier::kGpu with the copy queued on
  // `stream` (Note [gpu tier]). kInvalidArgument for another tier; kFailedPrecondition
  // for the GPU without a device or GPU budget; kResourceExhausted when every device
  // block is leased.
  absl::StatusOr<TensorLease> Acquire(TensorId id, Tier tier, CudaStreamView stream = {});
  // A host lease for reading only, granted at once while the tensor is being written back
  // (Note [reads during write-back]); otherwise as Acquire. Its holder must not write the
  // bytes: MarkDirty on it is a programming error that stops the process (the bytes may
  // be on their way to the volume). Errors as Acquire.
  absl::StatusOr<TensorLease> AcquireForRead(TensorId id);
  // Acquire with write intent: the lease starts dirty (its bytes are written back before
  // the memory is reused, and a device copy of a host lease becomes stale), so there is
  // no MarkDirty to forget. Errors as Acquire.
  absl::StatusOr<TensorLease> AcquireForWrite(TensorId id, Tier tier = Tier::kPinnedHost,
                                              CudaStreamView stream = {});
  // A host lease for a caller that overwrites every byte: a cold tensor gets a block
  // without a read (its bytes are unspecified until written). The lease starts dirty,
  // and a device copy becomes stale.
  absl::StatusOr<TensorLease> AcquireForOverwrite(TensorId id);
  // A host lease on `to` holding a copy of `from`'s current bytes (the sizes must
  // match): a new version of a tensor written without holding the old one too. When
  // `from` is resident, clean and unleased its block is handed over whole (no copy, and
  // `from` becomes cold: the volume has its bytes); when resident otherwise, the bytes
  // are copied; when cold, they are read from the volume straight into `to`'s block.
  // The lease starts dirty. kInvalidArgument for sizes that differ or from == to;
  // kFailedPrecondition while `to` is leased.
  absl::StatusOr<TensorLease> AcquireCopy(TensorId from, TensorId to);
  // Starts making the tensor resident without pinning it or blocking.
  PrefetchTicket Prefetch(TensorId id);
  PrefetchTicket Prefetch(TensorId id, Tier tier, CudaStreamView stream = {});
  // Writes the tensor back if dirty (copying a dirty device copy back first). A tensor
  // with a host lease that may write it (any but AcquireForRead's) stays dirty: what is
  // staged is what its block held then, and its holder's later writes are written too
  // (Note [write-back under a writer] in src/store/residency.cpp); Flush likewise. A device
  // lease is not so followed: writes through it after a WriteBack or Flush that copied it
  // back need MarkDirty on it again (nothing in the SDK writes through device leases).
  absl::Status WriteBack(TensorId id);
  // Queues the tensor's write-back on the prefetch threads and returns at once, as
  // write_behind does for a durable tensor released dirty (Note [write-behind]), for any
  // durable tensor, a gradient included: for a caller that knows this version will be
  // written anyway (a training state's redo record). A no-op unless the tensor is
  // resident on the host, dirty, unleased and not on the device. A write that fails leaves
  // it dirty: the next WriteBack, Evict or Flush retries it and returns the error.
  // kInvalidArgument for an unknown id.
  absl::Status WriteBehind(TensorId id);
  // Whether the tensor's host bytes are not yet staged on the volume: dirty, or being
  // written back. False for an unknown id.
  bool WritePending(TensorId id) const;
  // Writes back each of `ids` that is dirty, write_back_depth at a time (Note [write-back
  // depth]), and returns once all are written: the first error, after the others ended.
  absl::Status WriteBack(std::span<const TensorId> ids);
  // Note [write-back depth]: one write-back is one tensor's put, a request of a few MiB
  // at a time, which leaves a device's queue nearly empty (an H200 machine's disk wrote
  // 1.7 GB/s so, 3.6 GiB/s with 32 requests in flight). A commit writes many tensors, so
  // it writes them this many at once, each on a thread of its own for the call. With the
  // default, a commit of a whole state in memory wrote about 2.2-3.5 GB/s on the H200
  // machines (reckoned from the commit steps' waits, not timed apart), whose disk takes
  // 3.6 GiB/s through io_uring and 4.7 through threads: the option
  // (options.write_back_depth) is there to measure more (bench/commit.py).
  static constexpr std::size_t kWriteBackDepth = 8;
  static constexpr std::size_t kMaxWriteBackDepth = 256;
  static constexpr int kMaxPrefetchThreads = 64;  // TensorStoreOptions::prefetch_threads
  // Writes back if dirty and frees its memory in every tier. kFailedPrecondition while
  // leased.
  absl::Status Evict(TensorId id);
  // Frees its memory in `tier` only; evicting Tier::kGpu copies a dirty device copy to
  // the host first.
  absl::Status Evict(TensorId id, Tier tier);
  // Drops the tensor's bytes in every tier without writing them back: the volume keeps
  // what it last stored (zeros if nothing). For values that are dead, such as gradients
  // after the optimizer step. kFailedPrecondition while leased.
  absl::Status Discard(TensorId id);

  // How long the tensor stays resident once unleased (Note [retention]); kNormal at
  // registration. kInvalidArgument for an unknown id.
  absl::Status SetRetention(TensorId id, Retention retention);

  // Writes back every dirty durable tensor and commits every durable write-back (Note
  // [residency]). Scratch tensors are not written: nothing of them is committed, and a
  // dirty one stays resident until its memory is needed. May run on one thread while
  // others use the store, provided no durable tensor is written meanwhile (a lease
  // writing one while it is written back leaves the volume with torn bytes).
  absl::Status Flush();

  // Note [commit when full]; true at open. Any thread.
  void SetCommitWhenFull(bool commit) noexcept;
  // Note [commit when full]: whether Close() (and the destructor) writes back and commits;
  // true at open. Any thread.
  void SetCommitAtClose(bool commit) noexcept;

  // Writes back and commits every dirty durable tensor (as Flush; nothing with
  // SetCommitAtClose(false)), cancels the prefetches still queued (their tickets report
  // kCancelled) and stops the store's threads. No lease may be held. After Close only
  // stats() and the destructor may be called; a second Close returns the first one's status.
  absl::Status Close();

  TensorStoreStats stats() const;

 private:
  friend class TensorLease;
  struct Impl;
  explicit TensorStore(std::unique_ptr<Impl> impl);
  void Unpin(TensorId id, Tier tier, CudaStreamView stream, bool read_only) noexcept;
  void Dirty(TensorId id, Tier tier) noexcept;
  absl::StatusOr<TensorLease> AcquireHost(TensorId id, bool read_only, CudaStreamView stream);
  std::unique_ptr<Impl> impl_;
};

// Layer-wise streaming: hands out the tensors of `order` one after another, keeping the
// next `window` of them prefetched. Reverse() walks the same order backwards (forward,
// then backward pass). Thread-safety: one thread at a time.
class TensorStream {
 public:
  TensorStream(TensorStore* store, std::vector<TensorId> order, std::size_t window);
  // The next tensor's lease; kOutOfRange when the walk is over.
  absl::StatusOr<TensorLease> Next();
  void Reverse();
  void Restart();

 private:
  void Fill();
  TensorStore* store_;
  std::vector<TensorId> order_;
  std::size_t window_;
  std::size_t position_ = 0;
  std::size_t prefetched_ = 0;  // order_[position_, prefetched_) have been prefetched
};

}  // namespace memascend

#endif  // MEMASCEND_TENSOR_STORE_H_
