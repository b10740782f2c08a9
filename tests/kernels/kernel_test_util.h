// tests/kernels/kernel_test_util.h: run each kernel test on every instruction set this
// CPU has, with and without worker threads.
#ifndef MEMASCEND_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define MEMASCEND_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <memory>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include <memascend/kernels.h>
#include <memascend/system.h>

namespace memascend::testing {

inline bool CpuHas(SimdLevel level) {
  static const SimdLevel best = ProbeSystem(ProbeOptions{}).simd;
  return static_cast<int>(level) <= static_cast<int>(best);
}

class KernelTest : public ::testing::TestWithParam<std::tuple<SimdLevel, int>> {
 protected:
  void SetUp() override {
    const SimdLevel level = std::get<0>(GetParam());
    if (!CpuHas(level)) GTEST_SKIP() << "this CPU lacks " << ToString(level);
    if (std::get<1>(GetParam()) > 1)
      threads_ = std::make_unique<KernelThreads>(std::get<1>(GetParam()));
    options_.threads = threads_.get();
    options_.max_simd = level;
  }
  std::unique_ptr<KernelThreads> threads_;
  KernelOptions options_;
};

inline std::string KernelTestName(
    const ::testing::TestParamInfo<std::tuple<SimdLevel, int>>& info) {
  return std::string(ToString(std::get<0>(info.param))) + "_threads" +
         std::to_string(std::get<1>(info.param));
}

#define MEMASCEND_INSTANTIATE_KERNEL_TEST(suite)                                                  \
  INSTANTIATE_TEST_SUITE_P(Isa, suite,                                                            \
                           ::testing::Combine(::testing::Values(::memascend::SimdLevel::kScalar,  \
                                                                ::memascend::SimdLevel::kAvx2,    \
                                                                ::memascend::SimdLevel::kAvx512), \
                                              ::testing::Values(1, 3)),                           \
                           ::memascend::testing::KernelTestName)

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
