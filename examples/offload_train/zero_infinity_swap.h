// The ZeRO-Infinity baseline's swap machinery (Note [zero rules] in zero_infinity.h):
// DeepNVMe's way of moving a tensor to and from its file (Aio), the files' names, and the
// sizes of the buffers the rules allocate (Layout).
//
// Thread-safety: Aio's Submit and Wait from any thread; the rest is plain data.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_SWAP_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_SWAP_H_

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <absl/status/status.h>
#include <fmt/format.h>

#include "backend.h"
#include "trainer.h"

namespace offload_train::zero_infinity {

inline std::size_t Pow2(std::size_t n) { return std::bit_ceil(std::max<std::size_t>(n, 1)); }
inline std::size_t Round4k(std::size_t n) { return (n + 4095) / 4096 * 4096; }

// DeepNVMe's shape: O_DIRECT, one open() per transfer, the transfer cut into
// block-sized requests, queue_depth of them in flight (here on as many threads).
class Aio {
 public:
  struct Op {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t pending = 0;
    absl::Status status;
    int fd = -1;
    ~Op() {
      if (fd >= 0) ::close(fd);
    }
  };

  Aio(std::size_t block, std::size_t depth) : block_(block) {
    for (std::size_t i = 0; i < std::max<std::size_t>(depth, 1); ++i)
      threads_.emplace_back([this] { Work(); });
  }
  ~Aio() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // `bytes` is a multiple of 4096 and `buf` 4096-aligned (O_DIRECT).
  std::shared_ptr<Op> Submit(const std::string& path, std::byte* buf, std::size_t bytes,
                             bool write) {
    auto op = std::make_shared<Op>();
    op->fd =
        ::open(path.c_str(), (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_DIRECT | O_CLOEXEC, 0600);
    if (op->fd < 0) {
      op->status = absl::InternalError(fmt::format("open {}: {}", path, std::strerror(errno)));
      return op;
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t off = 0; off < bytes; off += block_) {
      jobs_.push_back({op, buf + off, off, std::min(block_, bytes - off), write, path});
      ++op->pending;
    }
    cv_.notify_all();
    return op;
  }

  static absl::Status Wait(const std::shared_ptr<Op>& op) {
    std::unique_lock<std::mutex> lock(op->mu);
    op->cv.wait(lock, [&] { return op->pending == 0; });
    return op->status;
  }

  // Waits for every request, then empties the list: the first failure.
  static absl::Status WaitAll(std::vector<std::shared_ptr<Op>>* ops) {
    absl::Status s;
    for (const auto& op : *ops) {
      const absl::Status w = Wait(op);
      if (s.ok()) s = w;
    }
    ops->clear();
    return s;
  }

  std::uint64_t read_bytes() const { return read_.load(); }
  std::uint64_t write_bytes() const { return written_.load(); }

 private:
  struct Job {
    std::shared_ptr<Op> op;
    std::byte* buf;
    std::size_t offset, length;
    bool write;
    std::string path;
  };

  void Work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      absl::Status s;
      std::size_t done = 0;
      while (done < job.length) {
        const ssize_t n = job.write ? ::pwrite(job.op->fd, job.buf + done, job.length - done,
                                               static_cast<off_t>(job.offset + done))
                                    : ::pread(job.op->fd, job.buf + done, job.length - done,
                                              static_cast<off_t>(job.offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          s = absl::DataLossError(fmt::format("{} {} at {}: {}", job.write ? "write" : "read",
                                              job.path, job.offset + done,
                                              n == 0 ? "short transfer" : std::strerror(errno)));
          break;
        }
        done += static_cast<std::size_t>(n);
      }
      (job.write ? written_ : read_) += done;
      std::lock_guard<std::mutex> lock(job.op->mu);
      if (!s.ok() && job.op->status.ok()) job.op->status = s;
      if (--job.op->pending == 0) job.op->cv.notify_all();
    }
  }

  std::size_t block_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
  std::atomic<std::uint64_t> read_{0}, written_{0};
};

// <root>/params/rank0/<g>_param.tensor.swp and the optimizer's beside it, as DeepSpeed names
// them (root: <nvme_path>/zero_stage_3/<dtype>params).
std::string SwapPath(const std::string& root, Kind k, std::size_t g);

struct Layout {
  std::size_t groups = 0;
  std::vector<std::size_t> numel, offset;  // per group; offset into the flat gradient
  std::size_t total = 0, largest = 0;
  std::vector<std::vector<std::size_t>> sub_groups;  // consecutive groups
  std::size_t largest_sub_group = 0;                 // elements
  std::size_t param_buffer_elements = 0;
  std::size_t param_buffer_bytes = 0;  // one buffer, padded for O_DIRECT
  std::size_t optimizer_buffer_bytes = 0;
  // Note [zero rules]: max_in_cpu's pinned flat buffer, which groups live in it, and the
  // buffer that carries a sub-group's new parameters to NVMe (0: none on NVMe).
  std::size_t flat_param_elements = 0;
  std::vector<bool> param_in_cpu;
  std::size_t partitioned_swap_bytes = 0;
};

// The rules' sizes for this model (Note [zero rules]).
Layout MakeLayout(const TrainOptions& o);

}  // namespace offload_train::zero_infinity

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_ZERO_INFINITY_SWAP_H_
