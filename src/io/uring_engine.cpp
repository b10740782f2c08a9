// The io_uring backend. One engine thread owns the ring: it moves queued requests into
// submission entries (up to the queue depth), submits them in one system call with the
// wait for completions, checks each completion (Note [checked completions]) and
// resubmits remainders. Other threads queue requests and wake it through an eventfd
// that always has a read armed on the ring.
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/synchronization/mutex.h>
#include <fmt/format.h>
#include <liburing.h>

#include "io/backends.h"
#include "io/request_state.h"
#include "prim/file.h"
#include "prim/os.h"
#include "prim/uring.h"

namespace memascend::io_internal {
namespace {

constexpr int kMaxRegisteredFiles = 256;
constexpr std::uint64_t kEventTag = 1;  // user_data of the eventfd read (states are aligned)
constexpr std::size_t kMaxAttemptBytes = std::size_t{1} << 30;  // the kernel caps near 2 GiB

class UringEngine final : public IoEngine {
 public:
  UringEngine(const IoEngineOptions& options, prim::UringRing ring, prim::UniqueFd event)
      : IoEngine(IoBackendKind::kIoUring, options),
        ring_(std::move(ring)),
        event_(std::move(event)),
        depth_(options.queue_depth) {
    files_fixed_ = io_uring_register_files_sparse(ring_.get(), kMaxRegisteredFiles) == 0;
    thread_ = prim::StartThread("ma-uring", [this] { Run(); });
  }

  ~UringEngine() override {
    WaitIdle();
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    prim::SignalEventFd(event_.get());
    thread_.join();
  }

 protected:
  void Start(std::span<const std::shared_ptr<RequestState>> requests) override {
    {
      absl::ReaderMutexLock lock(&registry_mu_);
      for (const auto& s : requests) {
        const int index = s->request.file.index;
        if (files_fixed_ && index < kMaxRegisteredFiles &&
            slot_ok_[static_cast<std::size_t>(index)]) {
          s->file_slot = index;
        }
        const auto begin = reinterpret_cast<std::uintptr_t>(s->request.buffer);
        for (std::size_t i = 0; i < buffers_.size(); ++i) {
          const auto base = reinterpret_cast<std::uintptr_t>(buffers_[i].data());
          if (begin >= base && begin + s->request.length <= base + buffers_[i].size()) {
            s->fixed_buffer = static_cast<int>(i);
            break;
          }
        }
      }
    }
    {
      absl::MutexLock lock(&mu_);
      for (const auto& s : requests) queue_.push_back(s);
    }
    prim::SignalEventFd(event_.get());
  }

  absl::Status OnCancel(RequestState& state) override {
    std::shared_ptr<RequestState> found;
    {
      absl::MutexLock lock(&mu_);
      found = TakeQueued(queue_, state);
    }
    if (found == nullptr) {
      // In flight at the kernel: a direct read or write of a file is not interrupted.
      // cancel_requested stops any resubmission of a remainder.
      return absl::FailedPreconditionError("the request is in flight at the kernel");
    }
    Fail(*found, absl::CancelledError("cancelled before it was submitted"));
    return absl::OkStatus();
  }

  absl::Status OnRegisterFile(int index, int fd) override {
    if (!files_fixed_ || index >= kMaxRegisteredFiles) return absl::OkStatus();  // plain fd
    const int rc =
        io_uring_register_files_update(ring_.get(), static_cast<unsigned>(index), &fd, 1);
    absl::MutexLock lock(&registry_mu_);
    slot_ok_[static_cast<std::size_t>(index)] = rc == 1;
    return absl::OkStatus();
  }

  void OnUnregisterFile(int index) override {
    if (!files_fixed_ || index >= kMaxRegisteredFiles) return;
    int none = -1;
    io_uring_register_files_update(ring_.get(), static_cast<unsigned>(index), &none, 1);
    absl::MutexLock lock(&registry_mu_);
    slot_ok_[static_cast<std::size_t>(index)] = false;
  }

  absl::Status OnRegisterBuffers(std::span<const std::span<std::byte>> ranges) override {
    absl::MutexLock lock(&registry_mu_);
    if (!buffers_.empty()) {
      io_uring_unregister_buffers(ring_.get());
      buffers_.clear();
    }
    if (ranges.empty()) return absl::OkStatus();
    std::vector<iovec> iov;
    for (const auto& r : ranges) iov.push_back({r.data(), r.size()});
    const int rc =
        io_uring_register_buffers(ring_.get(), iov.data(), static_cast<unsigned>(iov.size()));
    if (rc < 0) {
      const std::string why = fmt::format("io_uring_register_buffers({} ranges): {}", ranges.size(),
                                          std::strerror(-rc));
      if (rc == -ENOMEM) {
        return absl::ResourceExhaustedError(
            why + " (registered buffers are locked memory: raise RLIMIT_MEMLOCK, `ulimit -l`)");
      }
      return absl::ErrnoToStatus(-rc, why);
    }
    buffers_.assign(ranges.begin(), ranges.end());
    return absl::OkStatus();
  }

 private:
  // A free submission entry. The ring has room for the queue depth plus the eventfd
  // read, so this never waits in practice; if it were full, submitting frees it.
  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe;
    while ((sqe = io_uring_get_sqe(ring_.get())) == nullptr) io_uring_submit(ring_.get());
    return sqe;
  }

  void ArmEventRead() {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_read(sqe, event_.get(), &event_value_, sizeof(event_value_), 0);
    io_uring_sqe_set_data64(sqe, kEventTag);
  }

  void Prepare(RequestState& s) {
    io_uring_sqe* sqe = GetSqe();
    const int fd = s.file_slot >= 0 ? s.file_slot : s.fd;
    const auto length = static_cast<unsigned>(std::min(s.remaining(), kMaxAttemptBytes));
    const bool read = s.request.op == IoOp::kRead;
    if (s.fixed_buffer >= 0) {
      if (read) {
        io_uring_prep_read_fixed(sqe, fd, s.buffer_now(), length, s.offset_now(), s.fixed_buffer);
      } else {
        io_uring_prep_write_fixed(sqe, fd, s.buffer_now(), length, s.offset_now(), s.fixed_buffer);
      }
      NoteFixedBuffer();
    } else if (read) {
      io_uring_prep_read(sqe, fd, s.buffer_now(), length, s.offset_now());
    } else {
      io_uring_prep_write(sqe, fd, s.buffer_now(), length, s.offset_now());
    }
    if (s.file_slot >= 0) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, &s);
  }

  void Run() {
    io_uring* ring = ring_.get();
    absl::flat_hash_map<RequestState*, std::shared_ptr<RequestState>> inflight;
    std::deque<std::shared_ptr<RequestState>> again;  // remainders and retries
    ArmEventRead();
    for (;;) {
      std::size_t room = depth_ - inflight.size();
      bool stopping = false;
      while (room > 0 && !again.empty()) {
        Prepare(*again.front());
        inflight.emplace(again.front().get(), std::move(again.front()));
        again.pop_front();
        --room;
      }
      {
        absl::MutexLock lock(&mu_);
        while (room > 0 && !queue_.empty()) {
          Prepare(*queue_.front());
          inflight.emplace(queue_.front().get(), std::move(queue_.front()));
          queue_.pop_front();
          --room;
        }
        stopping = stop_ && queue_.empty();
      }
      if (stopping && inflight.empty() && again.empty()) break;

      const int rc = io_uring_submit_and_wait(ring, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        std::fprintf(stderr, "memascend: io_uring_submit_and_wait: %s\n", std::strerror(-rc));
      }
      bool rearm = false;
      unsigned head = 0;
      unsigned seen = 0;
      io_uring_cqe* cqe = nullptr;
      io_uring_for_each_cqe(ring, head, cqe) {
        ++seen;
        if (io_uring_cqe_get_data64(cqe) == kEventTag) {
          rearm = true;
          continue;
        }
        auto* s = static_cast<RequestState*>(io_uring_cqe_get_data(cqe));
        auto it = inflight.find(s);
        std::shared_ptr<RequestState> keep = std::move(it->second);
        inflight.erase(it);
        if (!Account(*s, cqe->res)) again.push_back(std::move(keep));
      }
      io_uring_cq_advance(ring, seen);
      if (rearm) ArmEventRead();
    }
  }

  prim::UringRing ring_;
  prim::UniqueFd event_;
  std::uint64_t event_value_ = 0;
  const std::size_t depth_;
  bool files_fixed_ = false;
  std::thread thread_;

  absl::Mutex mu_;
  std::deque<std::shared_ptr<RequestState>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  absl::Mutex registry_mu_;
  std::vector<std::span<std::byte>> buffers_ ABSL_GUARDED_BY(registry_mu_);
  std::array<bool, kMaxRegisteredFiles> slot_ok_ ABSL_GUARDED_BY(registry_mu_){};
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> MakeUringEngine(const IoEngineOptions& options) {
  const unsigned entries = std::bit_ceil(options.queue_depth + 2);
  auto ring = prim::UringRing::Create(entries, options.sqpoll ? IORING_SETUP_SQPOLL : 0);
  if (!ring.ok()) return ring.status();
  auto event = prim::MakeEventFd();
  if (!event.ok()) return event.status();
  return std::unique_ptr<IoEngine>(new UringEngine(options, *std::move(ring), *std::move(event)));
}

}  // namespace memascend::io_internal
