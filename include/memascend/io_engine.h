// memascend/io_engine.h: asynchronous direct I/O with a checked result per request.
//
// An IoEngine reads and writes caller buffers at file offsets and hands back a
// move-only ticket per request. Backends, picked at run time and reported:
//   kIoUring     one io_uring driven by an engine thread: batched submission, registered
//                files, fixed (registered) buffers, optional SQPOLL;
//   kThreadPool  pread/pwrite on worker threads, for kernels where io_uring is missing or
//                disabled (sysctl, seccomp);
//   kSync        pread/pwrite inside Submit(), for tests and simple clients.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto engine, memascend::IoEngine::Create({}));
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::FileId file, engine->RegisterFile(fd));
//   memascend::IoTicket t = engine->Submit({memascend::IoOp::kRead, file, 0, buf, 1 << 20});
//   MEMASCEND_ASSIGN_OR_RETURN(std::size_t n, t.Wait());  // n == 1 << 20, or an error
//
// Note [checked completions]: every completion's result is checked. A short transfer is
// resubmitted for the remainder; EAGAIN and EINTR are retried (up to max_retries, then
// kUnavailable); a read that reaches the end of the file is kOutOfRange; any other
// error is the errno mapped with absl::ErrnoToStatus (ENOSPC: kResourceExhausted, EIO:
// kUnavailable...), naming the operation, offset and length, on that request's ticket
// only. For a file opened with O_DIRECT, offset, length and buffer address must be
// multiples of the file's direct-I/O alignment: Submit() checks them up front and the
// ticket carries kInvalidArgument without any I/O.
//
// Thread-safety: every IoEngine method may be called from any thread. A ticket is used
// by one thread at a time. Callbacks run on an engine thread (or inside Submit() for
// kSync): they must be short and must not wait on tickets; they may submit.
// Lifetime: a request's buffer belongs to the engine from Submit() until its ticket
// completes. Destroying a ticket waits for its request (see Detach()). Registered files
// must stay open until unregistered. The engine waits for all requests when destroyed.
#ifndef MEMASCEND_IO_ENGINE_H_
#define MEMASCEND_IO_ENGINE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/system.h>

namespace memascend {

enum class IoOp : std::uint8_t { kRead, kWrite };
std::string_view ToString(IoOp op) noexcept;

// A file registered with an engine.
struct FileId {
  int index = -1;
  friend bool operator==(FileId, FileId) = default;
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file;                  // from IoEngine::RegisterFile
  std::uint64_t offset = 0;     // bytes into the file
  std::byte* buffer = nullptr;  // the caller's; owned by the engine until completion
  std::size_t length = 0;       // bytes; > 0
};

// Called once per request when it completes, with its status and bytes transferred,
// before the request's ticket reports completion.
using IoCallback = std::function<void(const absl::Status& status, std::size_t bytes)>;

// What IoEngine::Flush makes durable: a file's data and what reading it back needs
// (fdatasync(2)), or that and all its metadata, a directory's entries among them (fsync(2)).
enum class FlushKind : std::uint8_t { kData, kAll };

// Changes what the kernel returned, beneath the engine's checks (tests: EIO, ENOSPC,
// short transfers, failed flushes). Adjust is called once per attempt with the bytes or
// -errno the attempt produced; returns what the engine sees. AdjustFlush is called once
// per IoEngine::Flush with 0 or -errno; by default it changes nothing. Must be thread-safe.
class FaultInjector {
 public:
  virtual ~FaultInjector() = default;
  virtual std::int64_t Adjust(const IoRequest& attempt, std::int64_t result) = 0;
  virtual int AdjustFlush(int fd, FlushKind kind, int result) {
    (void)fd;
    (void)kind;
    return result;
  }
};

namespace io_internal {
struct RequestState;
struct TicketAccess;
}  // namespace io_internal

class IoEngine;

// The handle of one submitted request. Move-only.
class IoTicket {
 public:
  IoTicket() noexcept = default;
  IoTicket(IoTicket&&) noexcept;
  IoTicket& operator=(IoTicket&&) noexcept;
  IoTicket(const IoTicket&) = delete;
  IoTicket& operator=(const IoTicket&) = delete;
  ~IoTicket();  // waits for the request unless detached

  // Blocks until the request completes; bytes transferred (== length) or its error.
  absl::StatusOr<std::size_t> Wait();
  // As Wait(), giving up after `timeout` with kDeadlineExceeded (the request goes on).
  absl::StatusOr<std::size_t> WaitFor(std::chrono::nanoseconds timeout);
  // True once the request has completed (successfully or not).
  bool Poll() const;
  // Asks the engine to cancel the request. OK if it will complete with kCancelled;
  // kFailedPrecondition if it has already completed or can no longer be stopped.
  absl::Status Cancel();
  // Lets the request run on without this ticket (its callback still runs).
  void Detach() noexcept;

  bool valid() const noexcept { return state_ != nullptr; }

 private:
  friend class IoEngine;
  friend class IoBatch;
  friend struct io_internal::TicketAccess;
  explicit IoTicket(std::shared_ptr<io_internal::RequestState> state) noexcept;
  std::shared_ptr<io_internal::RequestState> state_;
};

// Waits on many tickets at once.
class IoBatch {
 public:
  IoBatch();
  ~IoBatch();  // waits for every ticket
  IoBatch(const IoBatch&) = delete;
  IoBatch& operator=(const IoBatch&) = delete;

  void Add(IoTicket ticket);
  // Blocks until at least `min_completions` tickets (clamped to size()) have completed;
  // returns how many have.
  std::size_t Wait(std::size_t min_completions);
  std::size_t WaitAll() { return Wait(size()); }
  std::size_t size() const noexcept { return tickets_.size(); }
  // The first error among completed tickets (in order of Add), or OK.
  absl::Status FirstError();
  std::vector<IoTicket>& tickets() noexcept { return tickets_; }

 private:
  struct Counter;
  std::shared_ptr<Counter> counter_;
  std::vector<IoTicket> tickets_;
};

enum class IoBackendChoice {
  kAuto,     // io_uring if the probe says it works, else threads (with a notice)
  kIoUring,  // io_uring or kFailedPrecondition
  kThreadPool,
  kSync,
};

struct IoEngineOptions {
  IoBackendChoice backend = IoBackendChoice::kAuto;
  unsigned queue_depth = 64;  // requests in flight at the kernel (io_uring)
  unsigned threads = 4;       // workers (kThreadPool)
  bool sqpoll = false;        // io_uring: a kernel thread polls the submission queue
  int max_retries = 16;       // EAGAIN/EINTR retries per request
  std::shared_ptr<FaultInjector> fault_injector;
  // Receives the notice of a fallback (io_uring unavailable); null: stderr.
  std::function<void(std::string_view)> notice;
};

struct IoEngineStats {
  std::uint64_t submitted = 0;
  std::uint64_t completed = 0;
  std::uint64_t failed = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t resubmitted_short = 0;  // short transfers completed by resubmission
  std::uint64_t retried = 0;            // EAGAIN/EINTR retries
  std::uint64_t fixed_buffer_ops = 0;   // io_uring READ_FIXED/WRITE_FIXED
};

class IoEngine {
 public:
  static absl::StatusOr<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& options);
  virtual ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  IoBackendKind backend() const noexcept { return backend_; }

  // Registers an open file descriptor (the caller keeps it open). Learns whether it is
  // O_DIRECT and, if so, its alignment (statx STATX_DIOALIGN, or the device's logical
  // block size, or 4096).
  absl::StatusOr<FileId> RegisterFile(int fd);
  absl::Status UnregisterFile(FileId file);
  // The offset/length and memory alignment Submit() enforces for `file` (1 if buffered).
  absl::StatusOr<std::size_t> Alignment(FileId file) const;

  // Registers memory ranges as io_uring fixed buffers (no-op for other backends); I/O
  // inside them then skips the per-request page pinning. Call while no I/O is in
  // flight; replaces an earlier registration. kResourceExhausted names RLIMIT_MEMLOCK.
  absl::Status RegisterBuffers(std::span<const std::span<std::byte>> ranges);

  // Starts a request. Never blocks on I/O (kSync excepted). Invalid requests complete
  // at once with kInvalidArgument.
  IoTicket Submit(const IoRequest& request, IoCallback callback = nullptr);
  // Starts several requests with one wake-up of the engine.
  std::vector<IoTicket> SubmitBatch(std::span<const IoRequest> requests);

  IoEngineStats stats() const;

  // Note [flushes]: fdatasync(2) or fsync(2) of `fd` (any open file or directory, registered
  // or not) on the calling thread, retried on EINTR, its result passed through the fault
  // injector; an error names `what`. Not a request: no ticket, and it orders nothing
  // against requests in flight (wait for the writes it should cover first). The stores'
  // durability points go through it, so a test can fail each of them.
  absl::Status Flush(int fd, FlushKind kind, std::string_view what) const;

 protected:
  struct FileInfo {
    int fd = -1;
    std::size_t align = 1;
    bool direct = false;
    bool registered = false;
  };
  explicit IoEngine(IoBackendKind backend, const IoEngineOptions& options);

  // Backend hooks. Start() hands over validated requests; the backend completes each
  // with Complete*(). File and buffer hooks may refuse with a status.
  virtual void Start(std::span<const std::shared_ptr<io_internal::RequestState>> requests) = 0;
  virtual absl::Status OnRegisterFile(int index, int fd) {
    (void)index;
    (void)fd;
    return absl::OkStatus();
  }
  virtual void OnUnregisterFile(int index) { (void)index; }
  virtual absl::Status OnRegisterBuffers(std::span<const std::span<std::byte>> ranges) {
    (void)ranges;
    return absl::OkStatus();
  }
  virtual absl::Status OnCancel(io_internal::RequestState& state);

  // Completion plumbing shared by the backends (Note [checked completions]).
  std::int64_t Adjust(const io_internal::RequestState& state, std::int64_t result) const;
  // Accounts for one attempt's result. Returns true if the request is finished (it has
  // then been completed), false if it must be resubmitted for its remainder.
  bool Account(io_internal::RequestState& state, std::int64_t result);
  void Fail(io_internal::RequestState& state, absl::Status status);
  FileInfo File(FileId id) const;
  const IoEngineOptions& options() const noexcept { return options_; }
  void NoteFixedBuffer() noexcept;
  // Blocks until every submitted request has completed. Backends call it first thing in
  // their destructors, before stopping their threads.
  void WaitIdle();

 private:
  friend class IoTicket;
  struct Shared;
  std::vector<IoTicket> SubmitInternal(std::span<const IoRequest> requests, IoCallback callback);
  void Finish(io_internal::RequestState& state, absl::Status status);

  IoBackendKind backend_;
  IoEngineOptions options_;
  std::unique_ptr<Shared> shared_;
};

// The engine a caller would get from Create(options), without creating it: which
// backend, and why (for reports).
struct IoBackendDecision {
  IoBackendKind backend;
  std::string reason;
};
IoBackendDecision DecideIoBackend(IoBackendChoice choice, const SystemInfo& info);

}  // namespace memascend

#endif  // MEMASCEND_IO_ENGINE_H_
