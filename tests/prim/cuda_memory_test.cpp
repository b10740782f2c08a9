// The CUDA primitives under the store's GPU tier and the device training paths
// (prim/cuda_memory.h). Without a CUDA device (or a CUDA build) the waits are skipped and
// only the build's refusals are checked.
#include "prim/cuda_memory.h"

#include <gtest/gtest.h>

#include "prim/os.h"
#include "testing/cuda_wait.h"
#include "testing/status_matchers.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace memascend::prim {
namespace {

using ::memascend::testing::StatusIs;
#if MEMASCEND_HAVE_CUDA
using ::memascend::testing::HoldStream;
using ::memascend::testing::TimeWait;
using ::memascend::testing::Waited;
#endif

TEST(CudaMemory, WithoutADeviceTheCallsReportIt) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
#if !MEMASCEND_HAVE_CUDA
  EXPECT_THAT(CudaEvent::Create(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(SynchronizeStream(CudaStreamView{}), StatusIs(absl::StatusCode::kFailedPrecondition));
#endif
  EXPECT_TRUE(CudaEvent().Ready());  // a default event: nothing to wait for
#if !MEMASCEND_HAVE_CUDA
  EXPECT_THAT(DeviceGuard(0).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
#endif
}

#if MEMASCEND_HAVE_CUDA
int Current() { return testing::CurrentCudaDevice(); }

// Note [current device]: a guard makes its device current for its life and the thread's
// previous one after; an allocation on a device leaves the caller's current device.
TEST(CudaMemory, ADeviceGuardMakesItsDeviceCurrentAndGivesTheOldOneBack) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    const DeviceGuard same(0);
    EXPECT_OK(same.status());
    EXPECT_EQ(Current(), 0);
  }
  EXPECT_EQ(Current(), 0);
  {
    const DeviceGuard none(devices);  // no such device: reported, nothing switched
    EXPECT_FALSE(none.status().ok());
  }
  EXPECT_EQ(Current(), 0);
  if (devices < 2) GTEST_SKIP() << "one CUDA device: no other to switch to";
  {
    const DeviceGuard other(1);
    EXPECT_OK(other.status());
    EXPECT_EQ(Current(), 1);
  }
  EXPECT_EQ(Current(), 0);
  {
    ASSERT_OK_AND_ASSIGN(DeviceAllocation a, DeviceAllocation::Allocate(1, 1 << 20));
    EXPECT_EQ(Current(), 0);
    cudaPointerAttributes at{};
    ASSERT_EQ(cudaPointerGetAttributes(&at, a.data()), cudaSuccess);
    EXPECT_EQ(at.device, 1);
  }
  EXPECT_EQ(Current(), 0);
  // The SDK's own threads keep the guard's device: going back to device 0 would make its
  // primary context on a thread that never used it.
  int after = -1;
  StartThread("ma-test", [&] {
    { const DeviceGuard other(1); }
    after = Current();
  }).join();
  EXPECT_EQ(after, 1);
}
#endif

#if MEMASCEND_HAVE_CUDA
// Note [blocking events]: a host wait sleeps in the driver. A busy-wait takes the CPU
// for the whole wait (cpu ~ wall); the margin is wide either way.
TEST(CudaMemory, AHostWaitOnAnEventSleepsUntilTheWorkIsDone) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  for (const bool timing : {false, true}) {
    HoldStream(s, 400);
    ASSERT_OK_AND_ASSIGN(CudaEvent e, timing ? CudaEvent::CreateTiming() : CudaEvent::Create());
    ASSERT_OK(e.Record(CudaStreamView(s)));
    EXPECT_FALSE(e.Ready());
    const Waited w = TimeWait([&] { EXPECT_OK(e.Synchronize()); });
    EXPECT_TRUE(e.Ready());
    EXPECT_GE(w.wall, 0.3) << "timing " << timing;
    EXPECT_LT(w.cpu, 0.25 * w.wall) << "timing " << timing << ": the wait spun";
  }
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST(CudaMemory, SynchronizeStreamSleepsToo) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  HoldStream(s, 400);
  const Waited w = TimeWait([&] { EXPECT_OK(SynchronizeStream(CudaStreamView(s))); });
  EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
  EXPECT_GE(w.wall, 0.3);
  EXPECT_LT(w.cpu, 0.25 * w.wall) << "the wait spun";
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}
#endif

}  // namespace
}  // namespace memascend::prim
