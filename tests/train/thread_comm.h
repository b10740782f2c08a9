// Ranks as threads of one process, for the trainer's data-parallel tests: comm.h's
// collectives over shared memory, each a rendezvous of every rank, with sums in rank
// order (as MPI's for two ranks). Poison() (a rank that failed) makes every rendezvous,
// now and later, fail, as MPI_Abort stops an MPI job.
//
// Thread-safety: one thread per rank; Poison() from any thread.
#ifndef MEMASCEND_TESTS_TRAIN_THREAD_COMM_H_
#define MEMASCEND_TESTS_TRAIN_THREAD_COMM_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <absl/status/status.h>

#include <memascend/status.h>

#include "comm.h"

namespace offload_train::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), slots_(static_cast<std::size_t>(world)) {}
  int world() const { return world_; }
  // Waits for every rank; false once poisoned.
  bool Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    if (poisoned_) return false;
    const std::uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lock, [&] { return poisoned_ || generation_ != generation; });
    return !poisoned_ || generation_ != generation;
  }
  void Poison() {
    std::lock_guard<std::mutex> lock(mu_);
    poisoned_ = true;
    cv_.notify_all();
  }
  std::vector<void*>& slots() { return slots_; }

 private:
  const int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool poisoned_ = false;
  std::vector<void*> slots_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup* group, int rank) : g_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->world(); }
  int local_size() const override { return g_->world(); }

  absl::Status ReduceSum(float* data, std::size_t n, int root) override {
    return Exchange(data, [&] {
      if (rank_ != root) {
        bytes_sent_ += n * sizeof(float);
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < size(); ++r) sum += Slot<float>(r)[i];
        data[i] = sum;
      }
    });
  }
  absl::Status AllGather(void* data, std::size_t element_bytes, std::span<const std::size_t> counts,
                         std::span<const std::size_t> offsets) override {
    bytes_sent_ += counts[static_cast<std::size_t>(rank_)] * element_bytes *
                   static_cast<std::uint64_t>(size() - 1);
    return Exchange(data, [&] {
      for (int r = 0; r < size(); ++r) {
        const std::size_t i = static_cast<std::size_t>(r);
        if (r != rank_) {
          std::memcpy(static_cast<std::byte*>(data) + offsets[i] * element_bytes,
                      Slot<std::byte>(r) + offsets[i] * element_bytes, counts[i] * element_bytes);
        }
      }
    });
  }
  absl::Status AllReduceSum(std::span<double> values) override {
    return Reduced(values, [](double a, double b) { return a + b; });
  }
  absl::Status AllReduceMin(std::span<std::uint64_t> values) override {
    return Reduced(values, [](std::uint64_t a, std::uint64_t b) { return std::min(a, b); });
  }
  absl::Status GatherToRoot(std::span<const double> mine, std::span<double> all) override {
    return Exchange(const_cast<double*>(mine.data()), [&] {
      if (rank_ != 0) return;
      for (int r = 0; r < size(); ++r)
        std::copy_n(Slot<const double>(r), mine.size(), all.data() + r * mine.size());
    });
  }
  absl::Status Barrier() override { return g_->Arrive() ? absl::OkStatus() : Stopped(); }
  [[noreturn]] void Abort(int) override { std::abort(); }

 private:
  static absl::Status Stopped() { return absl::AbortedError("another rank stopped"); }
  template <typename T>
  T* Slot(int r) {
    return static_cast<T*>(g_->slots()[static_cast<std::size_t>(r)]);
  }
  // Publishes `data`, waits for every rank, runs `work` (reading the others' data), and
  // waits again so that no rank changes its data before every rank has read it.
  absl::Status Exchange(void* data, const std::function<void()>& work) {
    g_->slots()[static_cast<std::size_t>(rank_)] = data;
    if (!g_->Arrive()) return Stopped();
    work();
    return g_->Arrive() ? absl::OkStatus() : Stopped();
  }
  template <typename T, typename F>
  absl::Status Reduced(std::span<T> values, F op) {
    std::vector<T> out(values.size());
    bytes_sent_ += values.size() * sizeof(T);
    MEMASCEND_RETURN_IF_ERROR(Exchange(values.data(), [&] {
      for (std::size_t i = 0; i < values.size(); ++i) {
        T acc = Slot<T>(0)[i];
        for (int r = 1; r < size(); ++r) acc = op(acc, Slot<T>(r)[i]);
        out[i] = acc;
      }
    }));
    std::copy(out.begin(), out.end(), values.begin());
    return absl::OkStatus();
  }

  ThreadGroup* g_;
  int rank_;
};

// Runs fn(rank, comm) on `world` threads; a rank whose fn fails poisons the group, so the
// others stop as an MPI job's would. Returns each rank's result.
template <typename R>
std::vector<R> RunRanks(int world, const std::function<R(int, Communicator*)>& fn,
                        const std::function<bool(const R&)>& ok) {
  ThreadGroup group(world);
  std::vector<R> results(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(&group, r);
      results[static_cast<std::size_t>(r)] = fn(r, &comm);
      if (!ok(results[static_cast<std::size_t>(r)])) group.Poison();
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

}  // namespace offload_train::testing

#endif  // MEMASCEND_TESTS_TRAIN_THREAD_COMM_H_
