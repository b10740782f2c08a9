#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/io_scheduler.h>

#include "io/request_state.h"

namespace memascend {

std::string_view ToString(IoPriority priority) noexcept {
  switch (priority) {
    case IoPriority::kDemand:
      return "demand";
    case IoPriority::kPrefetch:
      return "prefetch";
    case IoPriority::kWriteBack:
      return "write_back";
  }
  return "unknown";
}

void LatencyHistogram::Record(double micros) {
  int bucket = micros < 1 ? 0 : static_cast<int>(std::log2(micros));
  bucket = std::clamp(bucket, 0, kBuckets - 1);
  ++buckets[static_cast<std::size_t>(bucket)];
  ++count;
  total_us += micros;
}

double LatencyHistogram::Percentile(double p) const {
  if (count == 0) return 0;
  const auto rank = static_cast<std::uint64_t>(std::ceil(p / 100.0 * static_cast<double>(count)));
  std::uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets[static_cast<std::size_t>(i)];
    if (seen >= std::max<std::uint64_t>(rank, 1)) return std::ldexp(1.0, i + 1);
  }
  return std::ldexp(1.0, kBuckets);
}

namespace {

double MicrosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

struct IoScheduler::Impl {
  struct Parent {
    std::shared_ptr<io_internal::RequestState> state;
    IoPriority priority;
    std::size_t chunks = 0;
    std::size_t dispatched = 0;
    std::size_t finished = 0;
    std::size_t bytes = 0;
    bool cancelled = false;
    absl::Status first_error;
    std::chrono::steady_clock::time_point start;
  };
  struct Chunk {
    std::shared_ptr<Parent> parent;
    IoRequest request;
  };

  IoEngine* engine = nullptr;
  IoSchedulerOptions options;

  mutable absl::Mutex mu;
  std::array<std::deque<Chunk>, kIoPriorityCount> queues ABSL_GUARDED_BY(mu);
  unsigned inflight ABSL_GUARDED_BY(mu) = 0;
  unsigned callbacks ABSL_GUARDED_BY(mu) = 0;  // chunk callbacks still running
  std::uint64_t open_requests ABSL_GUARDED_BY(mu) = 0;
  bool pumping ABSL_GUARDED_BY(mu) = false;
  bool repump ABSL_GUARDED_BY(mu) = false;
  IoSchedulerStats stats ABSL_GUARDED_BY(mu);

  // Dispatches chunks, most urgent first, while the queue depth allows. Re-entrant
  // calls (a synchronous engine completing inside Submit) hand their work to the
  // outermost call instead of recursing.
  void Pump() {
    {
      absl::MutexLock lock(&mu);
      if (pumping) {
        repump = true;
        return;
      }
      pumping = true;
    }
    for (;;) {
      std::vector<Chunk> batch;
      {
        absl::MutexLock lock(&mu);
        repump = false;
        for (auto& q : queues) {
          while (inflight < options.queue_depth && !q.empty()) {
            Chunk c = std::move(q.front());
            q.pop_front();
            if (c.parent->cancelled) {
              DropLocked(c);
              continue;
            }
            ++c.parent->dispatched;
            ++inflight;
            batch.push_back(std::move(c));
          }
        }
        if (batch.empty() && !repump) {
          pumping = false;
          return;
        }
      }
      for (Chunk& c : batch) {
        std::shared_ptr<Parent> parent = c.parent;
        engine
            ->Submit(c.request, [this, parent](const absl::Status& s,
                                               std::size_t n) { OnChunk(parent, s, n); })
            .Detach();
      }
    }
  }

  // A chunk that will never run: counts as finished for its parent.
  void DropLocked(Chunk& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++c.parent->finished;
    if (c.parent->finished == c.parent->chunks) FinishLocked(*c.parent);
  }

  void OnChunk(const std::shared_ptr<Parent>& parent, const absl::Status& s, std::size_t n) {
    {
      absl::MutexLock lock(&mu);
      --inflight;
      ++callbacks;
      ++parent->finished;
      parent->bytes += n;
      if (!s.ok() && parent->first_error.ok()) parent->first_error = s;
      if (parent->finished == parent->chunks) FinishLocked(*parent);
    }
    Pump();
    absl::MutexLock lock(&mu);
    --callbacks;  // the destructor waits for this: nothing touches *this afterwards
  }

  // Completion of a whole request. Its callback runs with mu released.
  void FinishLocked(Parent& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status status = p.first_error;
    if (status.ok() && p.cancelled) status = absl::CancelledError("cancelled by the caller");
    IoPriorityStats& ps = stats.priorities[static_cast<int>(p.priority)];
    ps.latency.Record(MicrosSince(p.start));
    if (!status.ok()) ++ps.failed;
    std::shared_ptr<io_internal::RequestState> state = std::move(p.state);
    const std::size_t bytes = status.ok() ? state->request.length : p.bytes;
    --open_requests;
    mu.Unlock();
    io_internal::CompleteRequest(*state, std::move(status), bytes);
    mu.Lock();
  }

  absl::Status Cancel(const std::weak_ptr<Parent>& weak) {
    std::shared_ptr<Parent> p = weak.lock();
    absl::MutexLock lock(&mu);
    if (p == nullptr || p->state == nullptr) {
      return absl::FailedPreconditionError("the request has already completed");
    }
    if (p->dispatched == p->chunks) {
      return absl::FailedPreconditionError("every chunk of the request is in flight");
    }
    p->cancelled = true;
    // Drop its queued chunks now, so an idle scheduler completes it at once.
    auto& q = queues[static_cast<int>(p->priority)];
    std::vector<Chunk> dropped;
    for (auto it = q.begin(); it != q.end();) {
      if (it->parent == p) {
        dropped.push_back(std::move(*it));
        it = q.erase(it);
      } else {
        ++it;
      }
    }
    // After the walk: finishing the request releases mu, and the queue may change.
    for (Chunk& c : dropped) DropLocked(c);
    return absl::OkStatus();
  }
};

IoScheduler::IoScheduler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

IoScheduler::~IoScheduler() {
  absl::MutexLock lock(&impl_->mu);
  impl_->mu.Await(absl::Condition(
      +[](Impl* m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->mu) {
        return m->open_requests == 0 && m->inflight == 0 && m->callbacks == 0;
      },
      impl_.get()));
}

absl::StatusOr<std::unique_ptr<IoScheduler>> IoScheduler::Create(
    IoEngine* engine, const IoSchedulerOptions& options) {
  if (engine == nullptr) return absl::InvalidArgumentError("io scheduler: engine is null");
  if (options.chunk_bytes == 0 || options.chunk_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        fmt::format("io scheduler: chunk_bytes must be a positive multiple of 4096, got {}",
                    options.chunk_bytes));
  }
  if (options.queue_depth == 0) return absl::InvalidArgumentError("io scheduler: queue_depth is 0");
  auto impl = std::make_unique<Impl>();
  impl->engine = engine;
  impl->options = options;
  return std::unique_ptr<IoScheduler>(new IoScheduler(std::move(impl)));
}

IoTicket IoScheduler::Submit(const IoRequest& request, IoPriority priority, IoCallback callback) {
  Impl& m = *impl_;
  auto state = std::make_shared<io_internal::RequestState>();
  state->request = request;
  state->callback = std::move(callback);
  IoTicket ticket = io_internal::TicketAccess::Make(state);

  absl::Status invalid;
  const absl::StatusOr<std::size_t> align = m.engine->Alignment(request.file);
  if (!align.ok()) {
    invalid = align.status();
  } else if (request.length == 0 || request.buffer == nullptr) {
    invalid = absl::InvalidArgumentError("empty request or null buffer");
  } else if (request.offset % *align != 0 || request.length % *align != 0 ||
             reinterpret_cast<std::uintptr_t>(request.buffer) % *align != 0) {
    invalid = absl::InvalidArgumentError(
        fmt::format("{} of {} bytes at offset {}: direct I/O needs offset, length and buffer "
                    "aligned to {} bytes",
                    ToString(request.op), request.length, request.offset, *align));
  } else if (m.options.chunk_bytes % *align != 0) {
    invalid = absl::InvalidArgumentError(
        fmt::format("chunk size {} is not a multiple of the file's alignment {}",
                    m.options.chunk_bytes, *align));
  }
  if (!invalid.ok()) {
    io_internal::CompleteRequest(*state, std::move(invalid), 0);
    return ticket;
  }

  auto parent = std::make_shared<Impl::Parent>();
  parent->state = state;
  parent->priority = priority;
  parent->start = std::chrono::steady_clock::now();
  parent->chunks = (request.length + m.options.chunk_bytes - 1) / m.options.chunk_bytes;
  state->cancel_hook = [&m, weak = std::weak_ptr<Impl::Parent>(parent)] { return m.Cancel(weak); };
  {
    absl::MutexLock lock(&m.mu);
    IoPriorityStats& ps = m.stats.priorities[static_cast<int>(priority)];
    ++ps.requests;
    ps.chunks += parent->chunks;
    ps.bytes += request.length;
    ++m.open_requests;
    auto& q = m.queues[static_cast<int>(priority)];
    for (std::size_t done = 0; done < request.length; done += m.options.chunk_bytes) {
      IoRequest c = request;
      c.offset += done;
      c.buffer += done;
      c.length = std::min(m.options.chunk_bytes, request.length - done);
      q.push_back({parent, c});
    }
  }
  m.Pump();
  return ticket;
}

IoSchedulerStats IoScheduler::stats() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->stats;
}

}  // namespace memascend
