// io/request_state.h: the shared state of one request, between its ticket, its batch
// and the engine that runs it.
#ifndef MEMASCEND_SRC_IO_REQUEST_STATE_H_
#define MEMASCEND_SRC_IO_REQUEST_STATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include <absl/status/status.h>
#include <absl/synchronization/mutex.h>

#include <memascend/io_engine.h>

namespace memascend::io_internal {

struct BatchCounter {
  absl::Mutex mu;
  absl::CondVar cv;
  std::size_t done ABSL_GUARDED_BY(mu) = 0;
};

struct RequestState {
  IoRequest request;
  IoCallback callback;
  IoEngine* engine = nullptr;                 // runs the request; null for scheduler tickets
  std::function<absl::Status()> cancel_hook;  // cancels a request no engine runs
  int fd = -1;                                // resolved at submission
  int fixed_buffer = -1;                      // io_uring fixed-buffer index, or -1
  int file_slot = -1;                         // io_uring registered-file slot, or -1 (use fd)
  std::uint64_t submit_ns = 0;                // steady clock at submission

  // Engine side: progress of a request that may take several attempts.
  std::uint64_t done = 0;
  int retries = 0;
  std::atomic<bool> cancel_requested{false};

  // Completion.
  std::atomic<bool> finished{false};  // lock-free Poll()
  absl::Mutex mu;
  absl::CondVar cv;
  bool complete ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::size_t bytes ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<BatchCounter> batch ABSL_GUARDED_BY(mu);

  // The part still to transfer.
  std::uint64_t offset_now() const { return request.offset + done; }
  std::byte* buffer_now() const { return request.buffer + done; }
  std::size_t remaining() const { return request.length - static_cast<std::size_t>(done); }
};

// Removes `state` from a backend's queue of requests not yet started; null if absent.
template <typename Queue>
std::shared_ptr<RequestState> TakeQueued(Queue& queue, const RequestState& state) {
  for (auto it = queue.begin(); it != queue.end(); ++it) {
    if (it->get() == &state) {
      std::shared_ptr<RequestState> found = std::move(*it);
      queue.erase(it);
      return found;
    }
  }
  return nullptr;
}

// Completes a request: runs its callback, then marks it complete, wakes its waiters and
// counts it in its batch. For code that completes tickets no engine runs.
void CompleteRequest(RequestState& state, absl::Status status, std::size_t bytes);

// Tickets for requests completed by CompleteRequest() (the I/O scheduler's).
struct TicketAccess {
  static IoTicket Make(std::shared_ptr<RequestState> state);
};

}  // namespace memascend::io_internal

#endif  // MEMASCEND_SRC_IO_REQUEST_STATE_H_
