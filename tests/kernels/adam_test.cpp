#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/kernels.h>

#include "kernels/isa.h"
#include "kernels/kernel_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::KernelTest;
using ::memascend::testing::StatusIs;

// Note [adam] evaluated in double.
void ReferenceStep(const AdamConfig& c, std::vector<double>& p, std::vector<double>& m,
                   std::vector<double>& v, const std::vector<double>& grad) {
  const double bc1 = 1 - std::pow(static_cast<double>(c.beta1), static_cast<double>(c.step));
  const double bc2 = 1 - std::pow(static_cast<double>(c.beta2), static_cast<double>(c.step));
  const double b1 = c.beta1, b2 = c.beta2, lr = c.lr, wd = c.weight_decay, eps = c.eps;
  for (std::size_t i = 0; i < p.size(); ++i) {
    double g = grad[i] * static_cast<double>(c.grad_multiplier);
    if (!c.adamw) g += wd * p[i];
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    if (c.adamw) p[i] *= 1 - lr * wd;
    p[i] -= (lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
  }
}

struct Case {
  DType grad;
  DType out;
  bool adamw;
  float wd;
  float multiplier;  // 1 / loss scale x clip coefficient
};

class Adam : public KernelTest {};

TEST_P(Adam, MatchesTheDoubleReferenceOverManySteps) {
  const std::size_t n = 4099;  // not a multiple of any vector width
  for (const Case& k : {Case{DType::kF32, DType::kF32, true, 0.0f, 1.0f},
                        Case{DType::kBF16, DType::kBF16, true, 0.1f, 1.0f / 1024},
                        Case{DType::kF16, DType::kF16, false, 0.01f, 0.5f / 65536},
                        Case{DType::kF32, DType::kBF16, false, 0.0f, 0.7f}}) {
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
    for (float& x : p) x = normal(rng) * 0.1f;
    std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
    std::vector<std::uint16_t> g16(n), out16(n);
    std::vector<float> g32(n), out32(n);
    AdamConfig c;
    c.lr = 1e-3f;
    c.adamw = k.adamw;
    c.weight_decay = k.wd;
    c.grad_multiplier = k.multiplier;
    double worst_one_step = 0;
    for (int step = 1; step <= 100; ++step) {
      c.step = step;
      std::vector<double> grad(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float g = normal(rng) / k.multiplier * 0.01f;  // a scaled gradient
        if (k.grad == DType::kF32) {
          g32[i] = g;
          grad[i] = g;
        } else {
          g16[i] = k.grad == DType::kF16 ? FloatToHalf(g) : FloatToBFloat16(g);
          grad[i] = k.grad == DType::kF16 ? HalfToFloat(g16[i]) : BFloat16ToFloat(g16[i]);
        }
      }
      const TensorView gv = k.grad == DType::kF32 ? TensorView{g32.data(), n, k.grad}
                                                  : TensorView{g16.data(), n, k.grad};
      const MutableTensorView ov = k.out == DType::kF32 ? MutableTensorView{out32.data(), n, k.out}
                                                        : MutableTensorView{out16.data(), n, k.out};
      // One step from the same state measures the kernel's own error.
      std::vector<double> sp(p.begin(), p.end()), sm(m.begin(), m.end()), sv(v.begin(), v.end());
      ReferenceStep(c, sp, sm, sv, grad);
      ASSERT_OK(FusedAdam(c, p, m, v, gv, ov, options_));
      ReferenceStep(c, rp, rm, rv, grad);
      for (std::size_t i = 0; i < n; ++i) {
        worst_one_step = std::max(worst_one_step, std::fabs(static_cast<double>(p[i]) - sp[i]) /
                                                      std::max(std::fabs(sp[i]), 1e-3));
        // The working copy is the master weight rounded once.
        if (k.out == DType::kF32) {
          ASSERT_EQ(out32[i], p[i]);
        } else {
          ASSERT_EQ(out16[i], k.out == DType::kF16 ? FloatToHalf(p[i]) : FloatToBFloat16(p[i]));
        }
      }
    }
    EXPECT_LE(worst_one_step, 2e-6) << ToString(k.grad) << (k.adamw ? " adamw" : " adam");
    double worst = 0, worst_v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      worst = std::max(
          worst, std::fabs(static_cast<double>(p[i]) - rp[i]) / std::max(std::fabs(rp[i]), 1e-3));
      worst_v =
          std::max(worst_v, std::fabs(static_cast<double>(v[i]) - rv[i]) / std::max(rv[i], 1e-12));
    }
    EXPECT_LE(worst, 1e-4) << "100 steps, " << ToString(k.grad);
    EXPECT_LE(worst_v, 1e-4) << "second moment, " << ToString(k.grad);
  }
}

TEST_P(Adam, RejectsBadArguments) {
  std::vector<float> p(10), m(10), v(9), g(10);
  AdamConfig c;
  EXPECT_THAT(FusedAdam(c, p, m, v, {g.data(), 10, DType::kF32}, {}, options_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  v.resize(10);
  c.step = 0;
  EXPECT_THAT(FusedAdam(c, p, m, v, {g.data(), 10, DType::kF32}, {}, options_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  c.step = 1;
  c.beta2 = 1.0f;
  EXPECT_THAT(FusedAdam(c, p, m, v, {g.data(), 10, DType::kF32}, {}, options_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  c.beta2 = 0.999f;
  EXPECT_OK(FusedAdam(c, p, m, v, {g.data(), 10, DType::kF32}, {}, options_));
}

MEMASCEND_INSTANTIATE_KERNEL_TEST(Adam);

// Note [kernel grain]: a part of memascend.torch's default size (2^20 elements) gives every
// thread of a large pool several tasks; one thread, or a call large enough, keeps 2^18.
TEST(ElementwiseGrain, GivesEveryThreadOfThePoolTasks) {
  constexpr std::size_t kPart = std::size_t{1} << 20;
  EXPECT_EQ(kernels::ElementwiseGrain(1, kPart), std::size_t{1} << 18);
  EXPECT_EQ(kernels::ElementwiseGrain(16, std::size_t{1} << 30), std::size_t{1} << 18);
  for (int threads : {2, 3, 4, 8, 16, 64, 256}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{4099}, std::size_t{1} << 16,
                          std::size_t{1} << 18, kPart, kPart + 77, std::size_t{1} << 22}) {
      const std::size_t grain = kernels::ElementwiseGrain(threads, n);
      EXPECT_EQ(grain % 4096, 0u) << threads << " threads, " << n;
      EXPECT_GE(grain, std::size_t{1} << 14) << threads << " threads, " << n;
      EXPECT_LE(grain, std::size_t{1} << 18) << threads << " threads, " << n;
      const std::size_t tasks = (n + grain - 1) / grain;
      // As many tasks as the pool has threads, unless the call is too small for them.
      EXPECT_GE(tasks, std::min<std::size_t>(static_cast<std::size_t>(threads),
                                             n / (std::size_t{1} << 14)))
          << threads << " threads, " << n;
    }
  }
  EXPECT_GE(kPart / kernels::ElementwiseGrain(16, kPart), 32u);  // was 4 (2^18 a task)
}

// The grain changes who computes an element, never its value: the update and the working
// copy are the same bits on one thread, on pools of any size, whole or part by part.
TEST(FusedAdam, IsBitIdenticalWhateverTheThreadsAndParts) {
  const std::size_t n = (std::size_t{1} << 20) + 77;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n);
  std::vector<std::uint16_t> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = normal(rng) * 0.1f;
    g[i] = FloatToBFloat16(normal(rng) * 0.01f);
  }
  struct Run {
    std::vector<float> p, m, v;
    std::vector<std::uint16_t> out;
  };
  const auto run = [&](KernelThreads* threads, std::size_t part) {
    Run r{p0, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f),
          std::vector<std::uint16_t>(n)};
    AdamConfig c;
    c.weight_decay = 0.01f;
    for (int step = 1; step <= 2; ++step) {
      c.step = step;
      for (std::size_t b = 0; b < n; b += part) {
        const std::size_t k = std::min(part, n - b);
        EXPECT_OK(FusedAdam(c, std::span(r.p).subspan(b, k), std::span(r.m).subspan(b, k),
                            std::span(r.v).subspan(b, k), {g.data() + b, k, DType::kBF16},
                            {r.out.data() + b, k, DType::kBF16}, {threads}));
      }
    }
    return r;
  };
  const Run want = run(nullptr, n);
  KernelThreads three(3), sixteen(16);
  for (KernelThreads* threads : {&three, &sixteen}) {
    // Parts whose sizes are multiples of the vector width (a part's tail that is not runs
    // on the scalar unit, whose last bit may differ): 2^20 (memascend.torch's), 2^18, and
    // 3 x 2^14, which puts the task boundaries elsewhere than the whole call's.
    for (std::size_t part : {n, std::size_t{1} << 20, std::size_t{1} << 18, std::size_t{3} << 14}) {
      const Run got = run(threads, part);
      EXPECT_EQ(std::memcmp(got.p.data(), want.p.data(), n * 4), 0)
          << threads->size() << " " << part;
      EXPECT_EQ(std::memcmp(got.m.data(), want.m.data(), n * 4), 0)
          << threads->size() << " " << part;
      EXPECT_EQ(std::memcmp(got.v.data(), want.v.data(), n * 4), 0)
          << threads->size() << " " << part;
      EXPECT_EQ(got.out, want.out) << threads->size() << " threads, parts of " << part;
    }
  }
}

TEST(SumOfSquares, AndClipCoefficient) {
  std::vector<float> a(100001, 0.5f);
  std::vector<std::uint16_t> b(777, FloatToBFloat16(2.0f));
  KernelThreads pool(3);
  const TensorView list[] = {{a.data(), a.size(), DType::kF32}, {b.data(), b.size(), DType::kBF16}};
  for (KernelThreads* t : {static_cast<KernelThreads*>(nullptr), &pool}) {
    EXPECT_DOUBLE_EQ(SumOfSquares(list, {t}), 100001 * 0.25 + 777 * 4.0);
  }
  EXPECT_FLOAT_EQ(ClipCoefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(std::nan(""), 1.0), 1.0f);
}

TEST(SumOfSquares, IsBitIdenticalWhateverTheThreads) {
  // Values of very different magnitudes, so a different order of additions would show.
  std::mt19937 rng(3);
  std::vector<float> a(5'000'000);
  for (float& x : a)
    x = std::ldexp(static_cast<float>(rng() % 1000) / 7.0f, static_cast<int>(rng() % 40) - 20);
  const TensorView list[] = {{a.data(), a.size(), DType::kF32}, {a.data(), 12345, DType::kF32}};
  const double alone = SumOfSquares(list, {nullptr});
  for (int threads : {2, 3, 5}) {
    KernelThreads pool(threads);
    for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(SumOfSquares(list, {&pool}), alone) << threads;
  }
}

// A gradient held in slices at multiples of 2^16 elements (the sum's task, Note [sum
// tasks]; the trainer's parts are multiples of 2^18) sums,
// slice by slice with a running total, to the bits of one call over the whole.
TEST(SumOfSquares, SlicesContinuingARunningTotalGiveTheBitsOfOneCall) {
  std::mt19937 rng(5);
  std::vector<float> a((std::size_t{5} << 18) + 777);
  for (float& x : a)
    x = std::ldexp(static_cast<float>(rng() % 1000) / 7.0f, static_cast<int>(rng() % 40) - 20);
  std::vector<std::uint16_t> b(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) b[i] = FloatToBFloat16(a[i]);
  KernelThreads pool(3);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const void* data = dtype == DType::kF32 ? static_cast<const void*>(a.data()) : b.data();
    const std::size_t bytes = SizeOf(dtype);
    const double earlier = 123.456;  // what earlier groups left in the total
    const TensorView whole[] = {{data, a.size(), dtype}};
    const double one = SumOfSquares(whole, {&pool}, earlier);
    const double alone = SumOfSquares(whole, {&pool});
    EXPECT_NEAR(one, alone + earlier, 1e-9 * alone);  // the total is really continued
    for (std::size_t slice : {std::size_t{1} << 16, std::size_t{3} << 16, std::size_t{1} << 18,
                              std::size_t{2} << 18, std::size_t{3} << 18}) {
      double total = earlier;
      bool threaded = true;  // alternately, to show the threads do not matter either
      for (std::size_t begin = 0; begin < a.size(); begin += slice, threaded = !threaded) {
        const TensorView part[] = {{static_cast<const std::byte*>(data) + begin * bytes,
                                    std::min(slice, a.size() - begin), dtype}};
        total = SumOfSquares(part, {threaded ? &pool : nullptr}, total);
      }
      EXPECT_EQ(total, one) << ToString(dtype) << " slices of " << slice;
    }
  }
}

TEST(DynamicLossScaler, BacksOffAfterHysteresisAndGrowsAfterTheInterval) {
  DynamicLossScaler::Options o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  o.hysteresis = 2;
  DynamicLossScaler s(o);
  EXPECT_FALSE(s.Update(true));  // first overflow: hysteresis absorbs it
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_TRUE(s.Update(false));
  EXPECT_FALSE(s.Update(true));  // second (non-consecutive) overflow: back off
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_TRUE(s.Update(false));
  EXPECT_TRUE(s.Update(false));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_TRUE(s.Update(false));  // third good step in a row
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.skipped_steps(), 2);
  // Bounds.
  o.initial_scale = 2;
  o.hysteresis = 1;
  o.min_scale = 1;
  DynamicLossScaler low(o);
  low.Update(true);
  low.Update(true);
  EXPECT_EQ(low.scale(), 1);
  o.initial_scale = 16777216.0f;
  o.growth_interval = 1;
  DynamicLossScaler high(o);
  high.Update(false);
  EXPECT_EQ(high.scale(), 16777216.0f);
}

TEST(DynamicLossScaler, ConsecutiveHysteresisRestoresAfterAGoodStep) {
  DynamicLossScaler::Options o;
  o.initial_scale = 256;
  o.hysteresis = 2;
  o.consecutive_hysteresis = true;
  DynamicLossScaler s(o);
  s.Update(true);
  s.Update(false);  // restores the hysteresis
  s.Update(true);
  EXPECT_EQ(s.scale(), 256);
  s.Update(true);  // two in a row
  EXPECT_EQ(s.scale(), 128);
}

TEST(DynamicLossScaler, RestoredStateContinuesExactlyAsTheOriginal) {
  DynamicLossScaler::Options o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  DynamicLossScaler a(o);
  const bool pattern[] = {true, false, false, true, true, false, false, false, false, true};
  for (int i = 0; i < 5; ++i) a.Update(pattern[i]);
  DynamicLossScaler b(o);
  ASSERT_OK(b.Restore(a.state()));
  for (int i = 5; i < 10; ++i) {
    EXPECT_EQ(a.Update(pattern[i]), b.Update(pattern[i])) << i;
    EXPECT_EQ(a.scale(), b.scale()) << i;
    EXPECT_EQ(a.hysteresis_left(), b.hysteresis_left()) << i;
    EXPECT_EQ(a.skipped_steps(), b.skipped_steps()) << i;
  }
  DynamicLossScaler::State bad = a.state();
  bad.scale = 0.5f;  // below min_scale
  EXPECT_THAT(b.Restore(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(b.scale(), a.scale());
}

}  // namespace
}  // namespace memascend
