// memascend/io_scheduler.h: priorities, chunking and a full queue over an IoEngine.
//
// A training step issues three kinds of I/O: reads it is waiting for right now
// (demand), reads of what it will need next (prefetch) and writes of what it is done
// with (write-back). The scheduler cuts every request into chunks, keeps
// `queue_depth` chunks in flight at the engine, and always dispatches the next chunk
// of the most urgent class, so a demand read never waits behind a long write-back:
// at most the chunks already in flight.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto sched, memascend::IoScheduler::Create(engine.get(), {}));
//   memascend::IoTicket w = sched->Submit(write_1gib, memascend::IoPriority::kWriteBack);
//   memascend::IoTicket r = sched->Submit(read_layer, memascend::IoPriority::kDemand);
//   MEMASCEND_RETURN_IF_ERROR(r.Wait().status());  // served ahead of the write-back
//
// A request's ticket completes when all its chunks have; its status is the first
// chunk error (Note [checked completions] in io_engine.h applies to every chunk).
//
// Thread-safety: Submit() and stats() may be called from any thread.
// Lifetime: the engine must outlive the scheduler; destroying the scheduler waits for
// every request it accepted. Buffers belong to the scheduler until the ticket completes.
#ifndef MEMASCEND_IO_SCHEDULER_H_
#define MEMASCEND_IO_SCHEDULER_H_

#include <array>
#include <cstdint>
#include <memory>

#include <absl/status/statusor.h>

#include <memascend/io_engine.h>

namespace memascend {

enum class IoPriority : int { kDemand = 0, kPrefetch = 1, kWriteBack = 2 };
inline constexpr int kIoPriorityCount = 3;
std::string_view ToString(IoPriority priority) noexcept;

// Latencies in power-of-two buckets of microseconds: bucket i counts [2^i, 2^(i+1)) us
// (bucket 0 also counts everything under 1 us).
struct LatencyHistogram {
  static constexpr int kBuckets = 32;
  std::array<std::uint64_t, kBuckets> buckets{};
  std::uint64_t count = 0;
  double total_us = 0;

  void Record(double micros);
  // Upper bound, in microseconds, of the bucket holding the p-th percentile (0..100).
  double Percentile(double p) const;
  double MeanMicros() const { return count == 0 ? 0 : total_us / static_cast<double>(count); }
};

struct IoPriorityStats {
  std::uint64_t requests = 0;
  std::uint64_t chunks = 0;
  std::uint64_t bytes = 0;
  std::uint64_t failed = 0;
  LatencyHistogram latency;  // submission to completion of whole requests
};

struct IoSchedulerStats {
  std::array<IoPriorityStats, kIoPriorityCount> priorities{};
  const IoPriorityStats& of(IoPriority p) const { return priorities[static_cast<int>(p)]; }
};

struct IoSchedulerOptions {
  std::size_t chunk_bytes = 1 << 20;  // a multiple of every file's direct-I/O alignment
  unsigned queue_depth = 32;          // chunks in flight at the engine
};

class IoScheduler {
 public:
  // kInvalidArgument for a chunk that is not a positive multiple of 4096 or a zero
  // queue depth.
  static absl::StatusOr<std::unique_ptr<IoScheduler>> Create(IoEngine* engine,
                                                             const IoSchedulerOptions& options);
  ~IoScheduler();
  IoScheduler(const IoScheduler&) = delete;
  IoScheduler& operator=(const IoScheduler&) = delete;

  // Starts a request at a priority. Invalid requests complete at once with
  // kInvalidArgument. Cancel() on the ticket drops the chunks not yet dispatched; the
  // request then completes with kCancelled.
  IoTicket Submit(const IoRequest& request, IoPriority priority, IoCallback callback = nullptr);

  IoSchedulerStats stats() const;

 private:
  struct Impl;
  explicit IoScheduler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_IO_SCHEDULER_H_
