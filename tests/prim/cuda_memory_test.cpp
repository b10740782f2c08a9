// The CUDA primitives under the store's GPU tier and the device training paths
// (prim/cuda_memory.h). Without a CUDA device (or a CUDA build) the waits are skipped and
// only the build's refusals are checked.
#include "prim/cuda_memory.h"

#include <gtest/gtest.h>

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
}

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
