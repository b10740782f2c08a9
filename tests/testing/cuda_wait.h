// tests/testing/cuda_wait.h: whether a host wait on the GPU sleeps (Note [blocking events],
// prim/cuda_memory.cpp). A stream is held by a host function for a known time; the
// waiting thread's CPU time against the wall time tells a sleep (cpu ~ 0) from a
// busy-wait (cpu ~ wall).
//
//   HoldStream(stream, 400);
//   const Waited w = TimeWait([&] { EXPECT_OK(event.Synchronize()); });
//   EXPECT_LT(w.cpu, 0.25 * w.wall);
#ifndef MEMASCEND_TESTS_TESTING_CUDA_WAIT_H_
#define MEMASCEND_TESTS_TESTING_CUDA_WAIT_H_

#if MEMASCEND_HAVE_CUDA
#include <chrono>
#include <cstdint>
#include <thread>
#include <time.h>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace memascend::testing {

// The calling thread's current CUDA device (Note [current device], prim/cuda_memory.h).
inline int CurrentCudaDevice() {
  int d = -1;
  EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
  return d;
}

inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// The work queued on `stream` after this call waits `ms` milliseconds (a host function the
// stream runs in order).
inline void HoldStream(cudaStream_t stream, int ms) {
  const cudaHostFn_t sleep = [](void* arg) {
    std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<std::intptr_t>(arg)));
  };
  ASSERT_EQ(cudaLaunchHostFunc(stream, sleep, reinterpret_cast<void*>(std::intptr_t{ms})),
            cudaSuccess);
}

struct Waited {
  double wall = 0;  // seconds
  double cpu = 0;   // the calling thread's CPU seconds meanwhile
};

template <typename F>
Waited TimeWait(F wait) {
  const double cpu = ThreadCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  wait();
  return Waited{std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                ThreadCpuSeconds() - cpu};
}

}  // namespace memascend::testing

#endif  // MEMASCEND_HAVE_CUDA
#endif  // MEMASCEND_TESTS_TESTING_CUDA_WAIT_H_
