#include "store_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include <memascend/block_target.h>
#include <memascend/host_arena.h>
#include <memascend/io_engine.h>
#include <memascend/status.h>
#include <memascend/tensor_store.h>
#include <memascend/volume.h>
#include <memascend/workload.h>

#include "prim/memory.h"

namespace memascend::cli {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
constexpr double kGiB = 1024.0 * 1024 * 1024;
constexpr std::size_t kRequest = 4u << 20;  // the volume's request size (kRequestBytes)
constexpr int kConcurrency = 2;             // the store's prefetch threads

// The same objects, read straight through an engine made as the volume makes its own,
// in the volume's request size, `kConcurrency` objects at a time, into pinned memory.
absl::StatusOr<double> RawRead(const std::string& path, Volume& volume,
                               const std::vector<std::string>& names) {
  std::vector<ObjectInfo> objects;
  std::size_t largest = 0;
  for (const std::string& n : names) {
    MEMASCEND_ASSIGN_OR_RETURN(ObjectInfo o, volume.Stat(n));
    largest = std::max<std::size_t>(largest, (o.size + 4095) / 4096 * 4096);
    objects.push_back(std::move(o));
  }
  MEMASCEND_ASSIGN_OR_RETURN(BlockTarget target, BlockTarget::Open(path, {}));
  IoEngineOptions eo;
  eo.notice = [](std::string_view) {};
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, IoEngine::Create(eo));
  MEMASCEND_ASSIGN_OR_RETURN(FileId file, engine->RegisterFile(target.fd()));
  HostArenaOptions ao;
  ao.budget_bytes = kConcurrency * largest;
  ao.chunk_bytes = 0;
  MEMASCEND_ASSIGN_OR_RETURN(auto arena, HostArena::Create(ao));
  std::vector<std::byte*> buffers;
  for (int i = 0; i < kConcurrency; ++i) {
    MEMASCEND_ASSIGN_OR_RETURN(ArenaAllocation a, arena->Allocate(largest));
    buffers.push_back(a.data);
  }
  std::atomic<std::size_t> next{0};
  absl::Status first;
  std::mutex first_mu;
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kConcurrency; ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i; (i = next.fetch_add(1)) < objects.size();) {
        IoBatch batch;
        std::size_t at = 0;
        for (const VolumeExtent& e : objects[i].extents) {
          const std::uint64_t want =
              std::min<std::uint64_t>(e.bytes, (objects[i].size + 4095) / 4096 * 4096 - at);
          for (std::uint64_t done = 0; done < want; done += kRequest) {
            const std::size_t n =
                static_cast<std::size_t>(std::min<std::uint64_t>(kRequest, want - done));
            batch.Add(engine->Submit({IoOp::kRead, file, e.offset + done,
                                      buffers[static_cast<std::size_t>(t)] + at + done, n}));
          }
          at += static_cast<std::size_t>(want);
        }
        batch.WaitAll();
        if (absl::Status s = batch.FirstError(); !s.ok()) {
          std::lock_guard<std::mutex> lock(first_mu);
          first.Update(s);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const double seconds = Since(start);
  MEMASCEND_RETURN_IF_ERROR(first);
  std::uint64_t bytes = 0;
  for (const ObjectInfo& o : objects) bytes += o.size;
  return static_cast<double>(bytes) / seconds / kGiB;
}

}  // namespace

absl::StatusOr<StoreBenchResult> RunStoreBench(const StoreBenchConfig& config) {
  StoreBenchConfig c = config;
  // A scratch volume of our own unless the caller names one.
  const bool own_volume = c.volume.empty();
  if (own_volume) {
    c.volume = (std::filesystem::temp_directory_path() / "memascend_store_bench.vol").string();
  }
  struct Remove {
    bool active;
    std::string path;
    ~Remove() {
      std::error_code ec;
      if (active) std::filesystem::remove(path, ec);
    }
  } remove_after{own_volume, c.volume};
  MEMASCEND_ASSIGN_OR_RETURN(Workload w, LoadWorkload(c.workload));
  if (c.scale == 0) return absl::InvalidArgumentError("--scale must be positive");
  StoreBenchResult r;
  r.workload = w.name;
  std::vector<TensorSpec> specs;
  for (const WorkloadTensor& t : w.tensors) {
    TensorSpec s;
    s.name = t.name;
    s.bytes = std::max<std::size_t>(4096, static_cast<std::size_t>(t.numel / c.scale) * 2);  // fp16
    s.dtype = DType::kF16;
    s.use = Use::kParameters;
    specs.push_back(std::move(s));
    r.bytes += specs.back().bytes;
  }
  r.tensors = specs.size();
  VolumeFormatOptions f;
  f.size = r.bytes + r.bytes / 4 + (256u << 20);
  // Note [bench targets]: a volume the user names is formatted over what it holds only
  // with --destroy-data; the check names that flag (Volume::Format's would name --force).
  std::error_code missing;
  if (!own_volume && !c.destroy && std::filesystem::exists(c.volume, missing)) {
    BlockTargetOptions check;
    check.check_signatures = true;
    check.override_hint = "--destroy-data to let bench store format its --volume";
    MEMASCEND_RETURN_IF_ERROR(BlockTarget::Open(c.volume, check).status());
  }
  f.force = own_volume || c.destroy;
  MEMASCEND_RETURN_IF_ERROR(Volume::Format(c.volume, f));
  VolumeOpenOptions vo;
  vo.verify_checksums = c.verify_checksums;
  MEMASCEND_ASSIGN_OR_RETURN(auto volume, Volume::Open(c.volume, vo));
  r.io_backend = std::string(ToString(volume->engine()->backend()));
  MemoryLedger ledger;
  TensorStoreOptions so;
  so.host_budget_bytes = c.host_budget;
  so.ledger = &ledger;
  so.prefetch_threads = kConcurrency;
  MEMASCEND_ASSIGN_OR_RETURN(auto store, TensorStore::Open(volume.get(), so));
  std::vector<TensorId> order;
  std::vector<std::string> names;
  for (const TensorSpec& s : specs) {
    MEMASCEND_ASSIGN_OR_RETURN(TensorId id, store->Register(s));
    order.push_back(id);
    names.push_back(s.name);
  }
  // Lay every tensor out on the volume, then start cold.
  for (TensorId id : order) {
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, store->Acquire(id));
    std::memset(lease.data(), static_cast<int>(id & 0xff), lease.size());
    lease.MarkDirty();
  }
  MEMASCEND_RETURN_IF_ERROR(store->Flush());
  // Forward: stream every tensor in order with `window` prefetched ahead.
  const auto store_pass = [&]() -> absl::StatusOr<double> {
    for (TensorId id : order) MEMASCEND_RETURN_IF_ERROR(store->Evict(id));
    const TensorStoreStats before = store->stats();
    TensorStream stream(store.get(), order, c.window);
    const auto start = Clock::now();
    for (std::size_t i = 0; i < order.size(); ++i) {
      MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, stream.Next());
      if (lease.data()[0] != static_cast<std::byte>(order[i] & 0xff)) {
        return absl::DataLossError("the store returned the wrong bytes");
      }
    }
    const double seconds = Since(start);
    const TensorStoreStats after = store->stats();
    const double read = static_cast<double>(r.bytes) / seconds / kGiB;
    if (read > r.store_read_gib_per_s) {
      r.store_read_gib_per_s = read;
      r.stall_seconds = after.stall_seconds - before.stall_seconds;
    }
    r.prefetch_hits += after.prefetch_hits - before.prefetch_hits;
    r.prefetch_misses += after.prefetch_misses - before.prefetch_misses;
    r.prefetch_dropped += after.prefetch_dropped - before.prefetch_dropped;
    return read;
  };
  for (int rep = 0; rep < c.reps; ++rep) {
    double raw = 0, read = 0;
    if (rep % 2 == 0) {
      MEMASCEND_ASSIGN_OR_RETURN(raw, RawRead(c.volume, *volume, names));
      MEMASCEND_ASSIGN_OR_RETURN(read, store_pass());
    } else {
      MEMASCEND_ASSIGN_OR_RETURN(read, store_pass());
      MEMASCEND_ASSIGN_OR_RETURN(raw, RawRead(c.volume, *volume, names));
    }
    r.raw_read_gib_per_s = std::max(r.raw_read_gib_per_s, raw);
    r.read_ratios.push_back(read / raw);
  }
  std::vector<double> sorted = r.read_ratios;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t mid = sorted.size() / 2;
  r.read_ratio_median = sorted.size() % 2 == 1 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  // Backward: every tensor modified, in reverse, written back as it is evicted and flushed.
  const TensorStoreStats before = store->stats();
  TensorStream back(store.get(), order, c.window);
  back.Reverse();
  const auto start = Clock::now();
  for (std::size_t i = 0; i < order.size(); ++i) {
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, back.Next());
    lease.data()[0] = std::byte{1};
    lease.MarkDirty();
  }
  MEMASCEND_RETURN_IF_ERROR(store->Flush());
  const double seconds = Since(start);
  r.write_gib_per_s =
      static_cast<double>(store->stats().bytes_written - before.bytes_written) / seconds / kGiB;
  r.peak_pinned_bytes =
      static_cast<std::uint64_t>(ledger.Snapshot().tier(Tier::kPinnedHost).reserved_peak);
  r.peak_rss_bytes = prim::PeakRssBytes();
  return r;
}

}  // namespace memascend::cli
