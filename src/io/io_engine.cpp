// The backend-independent part of the I/O engine: validation, checked completions
// (Note [checked completions]), tickets, batches, and the choice of backend.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <absl/time/clock.h>
#include <absl/time/time.h>
#include <fmt/format.h>

#include <memascend/io_engine.h>

#include "io/backends.h"
#include "io/request_state.h"
#include "prim/file.h"

namespace memascend {

using io_internal::RequestState;

std::string_view ToString(IoOp op) noexcept { return op == IoOp::kRead ? "read" : "write"; }

namespace {

std::uint64_t NowNs() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

std::string Describe(const IoRequest& r) {
  return fmt::format("{} of {} bytes at offset {}", ToString(r.op), r.length, r.offset);
}

}  // namespace

struct IoEngine::Shared {
  mutable absl::Mutex files_mu;
  std::vector<FileInfo> files ABSL_GUARDED_BY(files_mu);

  absl::Mutex idle_mu;
  std::uint64_t outstanding ABSL_GUARDED_BY(idle_mu) = 0;

  std::atomic<std::uint64_t> submitted{0}, completed{0}, failed{0}, bytes_read{0}, bytes_written{0},
      resubmitted{0}, retried{0}, fixed{0};
};

IoEngine::IoEngine(IoBackendKind backend, const IoEngineOptions& options)
    : backend_(backend), options_(options), shared_(std::make_unique<Shared>()) {}

IoEngine::~IoEngine() { WaitIdle(); }

void IoEngine::WaitIdle() {
  absl::MutexLock lock(&shared_->idle_mu);
  shared_->idle_mu.Await(absl::Condition(
      +[](std::uint64_t* n) { return *n == 0; }, &shared_->outstanding));
}

absl::StatusOr<FileId> IoEngine::RegisterFile(int fd) {
  auto facts = prim::StatFile(fd);
  if (!facts.ok()) return facts.status();
  int index = -1;
  {
    absl::MutexLock lock(&shared_->files_mu);
    auto& files = shared_->files;
    for (std::size_t i = 0; i < files.size(); ++i) {
      if (!files[i].registered) {
        index = static_cast<int>(i);
        break;
      }
    }
    if (index < 0) {
      index = static_cast<int>(files.size());
      files.emplace_back();
    }
    files[static_cast<std::size_t>(index)] = FileInfo{fd, facts->dio_align, facts->direct, true};
  }
  if (absl::Status s = OnRegisterFile(index, fd); !s.ok()) {
    absl::MutexLock lock(&shared_->files_mu);
    shared_->files[static_cast<std::size_t>(index)] = FileInfo{};
    return s;
  }
  return FileId{index};
}

absl::Status IoEngine::UnregisterFile(FileId file) {
  {
    absl::MutexLock lock(&shared_->files_mu);
    auto& files = shared_->files;
    if (file.index < 0 || static_cast<std::size_t>(file.index) >= files.size() ||
        !files[static_cast<std::size_t>(file.index)].registered) {
      return absl::InvalidArgumentError(fmt::format("file {} is not registered", file.index));
    }
    files[static_cast<std::size_t>(file.index)] = FileInfo{};
  }
  OnUnregisterFile(file.index);
  return absl::OkStatus();
}

IoEngine::FileInfo IoEngine::File(FileId id) const {
  absl::ReaderMutexLock lock(&shared_->files_mu);
  const auto& files = shared_->files;
  if (id.index < 0 || static_cast<std::size_t>(id.index) >= files.size()) return FileInfo{};
  return files[static_cast<std::size_t>(id.index)];
}

absl::StatusOr<std::size_t> IoEngine::Alignment(FileId file) const {
  const FileInfo info = File(file);
  if (!info.registered) {
    return absl::InvalidArgumentError(fmt::format("file {} is not registered", file.index));
  }
  return info.direct ? info.align : 1;
}

absl::Status IoEngine::RegisterBuffers(std::span<const std::span<std::byte>> ranges) {
  return OnRegisterBuffers(ranges);
}

absl::Status IoEngine::OnCancel(RequestState& state) {
  (void)state;
  return absl::FailedPreconditionError("the request is already running");
}

IoTicket IoEngine::Submit(const IoRequest& request, IoCallback callback) {
  const IoRequest one[1] = {request};
  return std::move(SubmitInternal(one, std::move(callback)).front());
}

std::vector<IoTicket> IoEngine::SubmitBatch(std::span<const IoRequest> requests) {
  return SubmitInternal(requests, nullptr);
}

std::vector<IoTicket> IoEngine::SubmitInternal(std::span<const IoRequest> requests,
                                               IoCallback callback) {
  std::vector<IoTicket> tickets;
  std::vector<std::shared_ptr<RequestState>> valid;
  tickets.reserve(requests.size());
  valid.reserve(requests.size());
  const std::uint64_t now = NowNs();
  for (const IoRequest& r : requests) {
    auto state = std::make_shared<RequestState>();
    state->request = r;
    state->callback = callback;
    state->engine = this;
    state->submit_ns = now;
    tickets.push_back(IoTicket(state));
    {
      absl::MutexLock lock(&shared_->idle_mu);
      ++shared_->outstanding;
    }
    shared_->submitted.fetch_add(1, std::memory_order_relaxed);

    const FileInfo file = File(r.file);
    absl::Status invalid;
    if (!file.registered) {
      invalid = absl::InvalidArgumentError(fmt::format("file {} is not registered", r.file.index));
    } else if (r.length == 0 || r.buffer == nullptr) {
      invalid =
          absl::InvalidArgumentError(fmt::format("{}: empty request or null buffer", Describe(r)));
    } else if (r.offset + r.length < r.offset) {
      invalid = absl::InvalidArgumentError(fmt::format("{}: offset overflows", Describe(r)));
    } else if (file.direct && (r.offset % file.align != 0 || r.length % file.align != 0 ||
                               reinterpret_cast<std::uintptr_t>(r.buffer) % file.align != 0)) {
      invalid = absl::InvalidArgumentError(fmt::format(
          "{} into buffer {}: direct I/O needs offset, length and buffer aligned to {} bytes",
          Describe(r), static_cast<const void*>(r.buffer), file.align));
    }
    if (!invalid.ok()) {
      Finish(*state, std::move(invalid));
      continue;
    }
    state->fd = file.fd;
    valid.push_back(std::move(state));
  }
  if (!valid.empty()) Start(valid);
  return tickets;
}

absl::Status IoEngine::Flush(int fd, FlushKind kind, std::string_view what) const {
  int rc;
  do {
    rc = kind == FlushKind::kData ? ::fdatasync(fd) : ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  int result = rc == 0 ? 0 : -errno;
  if (options_.fault_injector != nullptr)
    result = options_.fault_injector->AdjustFlush(fd, kind, result);
  if (result == 0) return absl::OkStatus();
  return absl::ErrnoToStatus(
      -result, fmt::format("{}({})", kind == FlushKind::kData ? "fdatasync" : "fsync", what));
}

std::int64_t IoEngine::Adjust(const RequestState& state, std::int64_t result) const {
  if (options_.fault_injector == nullptr) return result;
  IoRequest attempt = state.request;
  attempt.offset = state.offset_now();
  attempt.buffer = state.buffer_now();
  attempt.length = state.remaining();
  return options_.fault_injector->Adjust(attempt, result);
}

bool IoEngine::Account(RequestState& state, std::int64_t raw) {
  const std::int64_t result = Adjust(state, raw);
  const IoRequest& r = state.request;
  if (result == -EAGAIN || result == -EINTR) {
    if (++state.retries > options_.max_retries) {
      Fail(state, absl::UnavailableError(fmt::format("{}: {} after {} retries", Describe(r),
                                                     std::strerror(static_cast<int>(-result)),
                                                     options_.max_retries)));
      return true;
    }
    shared_->retried.fetch_add(1, std::memory_order_relaxed);
  } else if (result < 0) {
    const int err = static_cast<int>(-result);
    Fail(state,
         absl::ErrnoToStatus(err, fmt::format("{} (after {} bytes)", Describe(r), state.done)));
    return true;
  } else if (result == 0) {
    if (r.op == IoOp::kRead) {
      Fail(state, absl::OutOfRangeError(
                      fmt::format("{}: end of file after {} bytes", Describe(r), state.done)));
    } else {
      Fail(state, absl::DataLossError(fmt::format("{}: the device accepted no bytes after {}",
                                                  Describe(r), state.done)));
    }
    return true;
  } else {
    state.done += std::min<std::uint64_t>(static_cast<std::uint64_t>(result), state.remaining());
    if (state.remaining() == 0) {
      Finish(state, absl::OkStatus());
      return true;
    }
    shared_->resubmitted.fetch_add(1, std::memory_order_relaxed);
  }
  if (state.cancel_requested.load(std::memory_order_acquire)) {
    Fail(state, absl::CancelledError(fmt::format("{}: cancelled", Describe(r))));
    return true;
  }
  return false;
}

void IoEngine::Fail(RequestState& state, absl::Status status) { Finish(state, std::move(status)); }

void IoEngine::NoteFixedBuffer() noexcept {
  shared_->fixed.fetch_add(1, std::memory_order_relaxed);
}

void IoEngine::Finish(RequestState& state, absl::Status status) {
  const bool ok = status.ok();
  const std::size_t bytes = ok ? state.request.length : static_cast<std::size_t>(state.done);
  if (ok) {
    (state.request.op == IoOp::kRead ? shared_->bytes_read : shared_->bytes_written)
        .fetch_add(bytes, std::memory_order_relaxed);
  } else {
    shared_->failed.fetch_add(1, std::memory_order_relaxed);
  }
  shared_->completed.fetch_add(1, std::memory_order_relaxed);
  io_internal::CompleteRequest(state, std::move(status), bytes);
  absl::MutexLock lock(&shared_->idle_mu);
  --shared_->outstanding;
}

namespace io_internal {

void CompleteRequest(RequestState& state, absl::Status status, std::size_t bytes) {
  // The callback runs before the ticket completes: once Wait() returns, it has run.
  if (IoCallback callback = std::move(state.callback); callback) callback(status, bytes);
  std::shared_ptr<BatchCounter> batch;
  {
    absl::MutexLock lock(&state.mu);
    state.complete = true;
    state.status = std::move(status);
    state.bytes = bytes;
    batch = state.batch;
    state.finished.store(true, std::memory_order_release);
    state.cv.SignalAll();
  }
  if (batch != nullptr) {
    absl::MutexLock lock(&batch->mu);
    ++batch->done;
    batch->cv.SignalAll();
  }
}

IoTicket TicketAccess::Make(std::shared_ptr<RequestState> state) {
  return IoTicket(std::move(state));
}

}  // namespace io_internal

IoEngineStats IoEngine::stats() const {
  IoEngineStats s;
  s.submitted = shared_->submitted.load();
  s.completed = shared_->completed.load();
  s.failed = shared_->failed.load();
  s.bytes_read = shared_->bytes_read.load();
  s.bytes_written = shared_->bytes_written.load();
  s.resubmitted_short = shared_->resubmitted.load();
  s.retried = shared_->retried.load();
  s.fixed_buffer_ops = shared_->fixed.load();
  return s;
}

// ---- Tickets -------------------------------------------------------------------------

IoTicket::IoTicket(std::shared_ptr<RequestState> state) noexcept : state_(std::move(state)) {}
IoTicket::IoTicket(IoTicket&&) noexcept = default;
IoTicket& IoTicket::operator=(IoTicket&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) (void)Wait();
    state_ = std::move(other.state_);
  }
  return *this;
}
IoTicket::~IoTicket() {
  if (state_ != nullptr) (void)Wait();
}

absl::StatusOr<std::size_t> IoTicket::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty ticket");
  RequestState& s = *state_;
  absl::MutexLock lock(&s.mu);
  while (!s.complete) s.cv.Wait(&s.mu);
  if (!s.status.ok()) return s.status;
  return s.bytes;
}

absl::StatusOr<std::size_t> IoTicket::WaitFor(std::chrono::nanoseconds timeout) {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty ticket");
  RequestState& s = *state_;
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  absl::MutexLock lock(&s.mu);
  while (!s.complete) {
    if (s.cv.WaitWithDeadline(&s.mu, deadline) && !s.complete) {
      return absl::DeadlineExceededError("the request is still in flight");
    }
  }
  if (!s.status.ok()) return s.status;
  return s.bytes;
}

bool IoTicket::Poll() const {
  return state_ != nullptr && state_->finished.load(std::memory_order_acquire);
}

absl::Status IoTicket::Cancel() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty ticket");
  if (Poll()) return absl::FailedPreconditionError("the request has already completed");
  state_->cancel_requested.store(true, std::memory_order_release);
  if (state_->engine != nullptr) return state_->engine->OnCancel(*state_);
  if (state_->cancel_hook) return state_->cancel_hook();
  return absl::FailedPreconditionError("the request cannot be cancelled");
}

void IoTicket::Detach() noexcept { state_.reset(); }

// ---- Batches -------------------------------------------------------------------------

struct IoBatch::Counter : io_internal::BatchCounter {};

IoBatch::IoBatch() : counter_(std::make_shared<Counter>()) {}
IoBatch::~IoBatch() { WaitAll(); }

void IoBatch::Add(IoTicket ticket) {
  if (ticket.state_ != nullptr) {
    RequestState& s = *ticket.state_;
    bool already = false;
    {
      absl::MutexLock lock(&s.mu);
      if (s.complete) {
        already = true;
      } else {
        s.batch = counter_;
      }
    }
    if (already) {
      absl::MutexLock lock(&counter_->mu);
      ++counter_->done;
    }
  }
  tickets_.push_back(std::move(ticket));
}

std::size_t IoBatch::Wait(std::size_t min_completions) {
  min_completions = std::min(min_completions, tickets_.size());
  absl::MutexLock lock(&counter_->mu);
  while (counter_->done < min_completions) counter_->cv.Wait(&counter_->mu);
  return counter_->done;
}

absl::Status IoBatch::FirstError() {
  for (IoTicket& t : tickets_) {
    if (!t.Poll()) continue;
    absl::StatusOr<std::size_t> r = t.Wait();
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

// ---- Choosing and creating a backend --------------------------------------------------

IoBackendDecision DecideIoBackend(IoBackendChoice choice, const SystemInfo& info) {
  switch (choice) {
    case IoBackendChoice::kSync:
      return {IoBackendKind::kSync, "asked for"};
    case IoBackendChoice::kThreadPool:
      return {IoBackendKind::kThreadPool, "asked for"};
    case IoBackendChoice::kIoUring:
      return {IoBackendKind::kIoUring,
              info.io_uring.available ? "asked for" : info.io_uring.unavailable_reason};
    case IoBackendChoice::kAuto:
      break;
  }
  if (info.io_uring.available) {
    return {IoBackendKind::kIoUring, info.io_backend_reason.empty()
                                         ? "io_uring works on this kernel"
                                         : info.io_backend_reason};
  }
  return {IoBackendKind::kThreadPool,
          fmt::format("io_uring unavailable ({}); using the thread-pool backend",
                      info.io_uring.unavailable_reason)};
}

absl::StatusOr<std::unique_ptr<IoEngine>> IoEngine::Create(const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError(
        fmt::format("queue_depth must be in 1..4096, got {}", options.queue_depth));
  }
  if (options.threads == 0 || options.threads > 256) {
    return absl::InvalidArgumentError(
        fmt::format("threads must be in 1..256, got {}", options.threads));
  }
  ProbeOptions probe = ProbeOptions::FromEnvironment();
  probe.disable_cuda = true;  // not needed to pick an I/O backend
  const SystemInfo info = ProbeSystem(probe);
  const IoBackendDecision d = DecideIoBackend(options.backend, info);
  if (d.backend == IoBackendKind::kIoUring) {
    if (!info.io_uring.available) {
      return absl::FailedPreconditionError(
          fmt::format("io_uring backend asked for, but {}", d.reason));
    }
    return io_internal::MakeUringEngine(options);
  }
  if (options.backend == IoBackendChoice::kAuto) {
    if (options.notice) {
      options.notice(d.reason);
    } else {
      std::fprintf(stderr, "memascend: %s\n", d.reason.c_str());
    }
  }
  if (d.backend == IoBackendKind::kSync) return io_internal::MakeSyncEngine(options);
  return io_internal::MakeThreadPoolEngine(options);
}

}  // namespace memascend
