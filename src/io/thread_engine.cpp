// The portable backends: pread/pwrite on a pool of threads, or on the caller's thread.
#include <deque>
#include <thread>
#include <vector>

#include <absl/synchronization/mutex.h>

#include "io/backends.h"
#include "io/request_state.h"
#include "prim/file.h"
#include "prim/os.h"

namespace memascend::io_internal {
namespace {

// One attempt of the remaining part of a request: bytes or -errno.
std::int64_t Attempt(const RequestState& s) {
  return s.request.op == IoOp::kRead
             ? prim::PreadOnce(s.fd, s.buffer_now(), s.remaining(), s.offset_now())
             : prim::PwriteOnce(s.fd, s.buffer_now(), s.remaining(), s.offset_now());
}

class ThreadPoolEngine final : public IoEngine {
 public:
  explicit ThreadPoolEngine(const IoEngineOptions& options)
      : IoEngine(IoBackendKind::kThreadPool, options) {
    for (unsigned i = 0; i < options.threads; ++i) {
      workers_.push_back(prim::StartThread("ma-io", [this] { Work(); }));
    }
  }

  ~ThreadPoolEngine() override {
    WaitIdle();
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

 protected:
  void Start(std::span<const std::shared_ptr<RequestState>> requests) override {
    absl::MutexLock lock(&mu_);
    for (const auto& r : requests) queue_.push_back(r);
  }

  absl::Status OnCancel(RequestState& state) override {
    std::shared_ptr<RequestState> found;
    {
      absl::MutexLock lock(&mu_);
      found = TakeQueued(queue_, state);
    }
    if (found == nullptr) return absl::FailedPreconditionError("the request is already running");
    Fail(*found, absl::CancelledError("cancelled before it started"));
    return absl::OkStatus();
  }

 private:
  void Work() {
    for (;;) {
      std::shared_ptr<RequestState> s;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ThreadPoolEngine* e) { return e->stop_ || !e->queue_.empty(); }, this));
        if (queue_.empty()) return;  // stop_ and nothing left
        s = std::move(queue_.front());
        queue_.pop_front();
      }
      while (!Account(*s, Attempt(*s))) {
      }
    }
  }

  absl::Mutex mu_;
  std::deque<std::shared_ptr<RequestState>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

class SyncEngine final : public IoEngine {
 public:
  explicit SyncEngine(const IoEngineOptions& options) : IoEngine(IoBackendKind::kSync, options) {}
  ~SyncEngine() override { WaitIdle(); }

 protected:
  void Start(std::span<const std::shared_ptr<RequestState>> requests) override {
    for (const auto& s : requests) {
      while (!Account(*s, Attempt(*s))) {
      }
    }
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> MakeThreadPoolEngine(const IoEngineOptions& options) {
  return std::unique_ptr<IoEngine>(new ThreadPoolEngine(options));
}

absl::StatusOr<std::unique_ptr<IoEngine>> MakeSyncEngine(const IoEngineOptions& options) {
  return std::unique_ptr<IoEngine>(new SyncEngine(options));
}

}  // namespace memascend::io_internal
