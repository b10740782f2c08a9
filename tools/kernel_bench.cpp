// memascend bench kernels: the fused kernels against the unfused ways of computing the
// same thing, and against the machine's memory-bandwidth ceilings, in one run.
#include "kernel_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <memascend/kernels.h>
#include <memascend/status.h>
#include <memascend/system.h>

#include "alloc_counter.h"
#include "kernels/isa.h"

namespace memascend::cli {
namespace {

constexpr std::size_t kChunk = 1u << 18;

template <typename F>
double BestSeconds(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <typename F>
void Chunks(KernelThreads& pool, std::size_t n, F&& f) {
  pool.ParallelFor((n + kChunk - 1) / kChunk,
                   [&](std::size_t c) { f(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

// The baselines get the best code generation a framework's vectorised element-wise
// ops get (AVX2 + FMA, -O3, no errno): they are slower for the passes and temporaries
// they make, not for weaker code. Used only where the CPU has AVX2 (checked below).
#define MEMASCEND_BASELINE_CODEGEN [[gnu::target("avx2,fma"), gnu::optimize("O3", "no-math-errno")]]

MEMASCEND_BASELINE_CODEGEN void IsInfPass(const std::uint32_t* x, std::uint8_t* mask, std::size_t b,
                                          std::size_t e) {
  for (std::size_t i = b; i < e; ++i) mask[i] = (x[i] & 0x7fffffffu) == 0x7f800000u;
}
MEMASCEND_BASELINE_CODEGEN void IsNanPass(const std::uint32_t* x, std::uint8_t* mask, std::size_t b,
                                          std::size_t e) {
  for (std::size_t i = b; i < e; ++i) mask[i] = (x[i] & 0x7fffffffu) > 0x7f800000u;
}
MEMASCEND_BASELINE_CODEGEN std::uint8_t AnyPass(const std::uint8_t* mask, std::size_t b,
                                                std::size_t e) {
  std::uint8_t acc = 0;
  for (std::size_t i = b; i < e; ++i) acc |= mask[i];
  return acc;
}
MEMASCEND_BASELINE_CODEGEN void UnscalePass(const std::uint16_t* g16, float* g, float mul,
                                            std::size_t b, std::size_t e) {
  for (std::size_t i = b; i < e; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(g16[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    g[i] = f * mul;
  }
}
MEMASCEND_BASELINE_CODEGEN void MomentPass(float* m, const float* g, float b1, std::size_t b,
                                           std::size_t e) {
  for (std::size_t i = b; i < e; ++i) m[i] = b1 * m[i] + (1 - b1) * g[i];
}
MEMASCEND_BASELINE_CODEGEN void SecondMomentPass(float* v, const float* g, float b2, std::size_t b,
                                                 std::size_t e) {
  for (std::size_t i = b; i < e; ++i) v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
}
MEMASCEND_BASELINE_CODEGEN void UpdatePass(float* p, const float* m, const float* v, float decay,
                                           float step_size, float isb2, float eps, std::size_t b,
                                           std::size_t e) {
  for (std::size_t i = b; i < e; ++i)
    p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * isb2 + eps);
}

// ZeRO's check: isinf(flat).any() and isnan(flat).any(), each building a bool tensor
// (allocated per call, as a framework allocates a fresh result tensor each step).
bool BaselineOverflow(KernelThreads& pool, const float* x, std::size_t n) {
  const auto* bits = reinterpret_cast<const std::uint32_t*>(x);
  bool any = false;
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<std::uint8_t> mask(n);  // the temporary
    Chunks(pool, n, [&](std::size_t b, std::size_t e) {
      if (kind == 0) {
        IsInfPass(bits, mask.data(), b, e);
      } else {
        IsNanPass(bits, mask.data(), b, e);
      }
    });
    std::vector<std::uint8_t> partial((n + kChunk - 1) / kChunk);
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { partial[b / kChunk] = AnyPass(mask.data(), b, e); });
    for (std::uint8_t p : partial) any |= p != 0;
  }
  return any;
}

}  // namespace

absl::StatusOr<KernelBenchResult> RunKernelBench(std::size_t n, int threads, int reps) {
  if (n < (1u << 16)) return absl::InvalidArgumentError("--elements must be at least 65536");
  if (!ProbeSystem(ProbeOptions{}).cpu.avx2) {
    return absl::FailedPreconditionError("the baselines are built for AVX2, which this CPU lacks");
  }
  KernelBenchResult r;
  r.elements = n;
  r.threads = threads;
  KernelThreads pool(threads);
  KernelOptions opt{&pool};
  const kernels::Isa& isa = kernels::PickIsa(SimdLevel::kAvx512);
  r.simd = std::string(ToString(isa.level));

  std::vector<float> grad32(n), master(n), m(n, 0.0f), v(n, 0.0f), copy_dst(n);
  std::vector<std::uint16_t> grad16(n), out16(n);
  for (std::size_t i = 0; i < n; ++i) {
    grad32[i] = static_cast<float>(static_cast<long>(i % 1999) - 999) * 1e-3f;
    master[i] = static_cast<float>(i % 977) * 1e-4f;
    grad16[i] = FloatToBFloat16(grad32[i]);
  }
  const double bytes32 = 4.0 * static_cast<double>(n);

  // Ceilings: a vectorised read of the same bytes, and a copy (read + write).
  std::atomic<std::uint64_t> sink{0};
  const double t_read = BestSeconds(reps, [&] {
    Chunks(pool, n, [&](std::size_t b, std::size_t e) {
      sink ^= isa.read_fold(reinterpret_cast<const std::byte*>(grad32.data() + b), (e - b) * 4);
    });
  });
  r.read_ceiling_gbps = bytes32 / t_read / 1e9;
  const auto copy_with = [&](auto&& copy) {
    return BestSeconds(reps, [&] {
      Chunks(pool, n, [&](std::size_t b, std::size_t e) {
        copy(reinterpret_cast<std::byte*>(copy_dst.data() + b),
             reinterpret_cast<const std::byte*>(grad32.data() + b), (e - b) * 4);
      });
    });
  };
  const double t_memcpy =
      copy_with([](std::byte* d, const std::byte* s, std::size_t k) { std::memcpy(d, s, k); });
  const double t_vcopy = copy_with(isa.copy);
  r.copy_ceiling_gbps = 2 * bytes32 / std::min(t_memcpy, t_vcopy) / 1e9;

  // Overflow check: fused vs the two bool temporaries.
  const TensorView g32[] = {{grad32.data(), n, DType::kF32}};
  bool found = false;
  std::uint64_t before = AllocatedBytes();
  const double t_fused = BestSeconds(reps, [&] { found |= HasOverflow(g32, opt); });
  r.overflow_fused_extra_bytes = (AllocatedBytes() - before) / static_cast<std::uint64_t>(reps);
  r.overflow_fused_gbps = bytes32 / t_fused / 1e9;
  before = AllocatedBytes();
  const double t_base =
      BestSeconds(reps, [&] { found |= BaselineOverflow(pool, grad32.data(), n); });
  r.overflow_baseline_extra_bytes = (AllocatedBytes() - before) / static_cast<std::uint64_t>(reps);
  r.overflow_baseline_gbps = bytes32 / t_base / 1e9;
  const TensorView g16[] = {{grad16.data(), n, DType::kBF16}};
  const double t_fused16 = BestSeconds(reps, [&] { found |= HasOverflow(g16, opt); });
  r.overflow_fused_bf16_gbps = 2.0 * static_cast<double>(n) / t_fused16 / 1e9;
  if (found)
    return absl::InternalError("the benchmark's gradients are finite; a check said otherwise");

  // Adam: fused (bf16 grad in, bf16 working copy out) vs separate passes.
  AdamConfig c;
  c.weight_decay = 0.01f;
  c.grad_multiplier = 1.0f / 1024;
  absl::Status status;
  r.adam_fused_bytes_per_element = 4 + 4 + 4 + 2 + 4 + 4 + 4 + 2;  // read p m v g; write p m v out
  const double t_adam = BestSeconds(reps, [&] {
    status.Update(FusedAdam(c, master, m, v, {grad16.data(), n, DType::kBF16},
                            {out16.data(), n, DType::kBF16}, opt));
  });
  MEMASCEND_RETURN_IF_ERROR(status);
  r.adam_fused_gbps = r.adam_fused_bytes_per_element * static_cast<double>(n) / t_adam / 1e9;

  const float b1 = c.beta1, b2 = c.beta2, eps = c.eps, lr = c.lr, wd = c.weight_decay,
              mul = c.grad_multiplier;
  const float step_size = lr / (1 - b1), isb2 = 1.0f / std::sqrt(1 - b2), decay = 1 - lr * wd;
  before = AllocatedBytes();
  std::vector<float> g(n);  // the unscaled fp32 gradient: made once, reused (a caching allocator)
  r.adam_unfused_extra_bytes = AllocatedBytes() - before;
  const double t_unfused = BestSeconds(reps, [&] {
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { UnscalePass(grad16.data(), g.data(), mul, b, e); });
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { MomentPass(m.data(), g.data(), b1, b, e); });
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { SecondMomentPass(v.data(), g.data(), b2, b, e); });
    Chunks(pool, n, [&](std::size_t b, std::size_t e) {
      UpdatePass(master.data(), m.data(), v.data(), decay, step_size, isb2, eps, b, e);
    });
    MutableTensorView out{out16.data(), n, DType::kBF16};
    status.Update(Convert({master.data(), n, DType::kF32}, out, opt));
  });
  MEMASCEND_RETURN_IF_ERROR(status);
  r.adam_unfused_bytes_per_element = (2 + 4) + (8 + 4) + (8 + 4) + (12 + 4) + (4 + 2);
  r.adam_unfused_gbps = r.adam_unfused_bytes_per_element * static_cast<double>(n) / t_unfused / 1e9;
  r.adam_fused_seconds = t_adam;
  r.adam_unfused_seconds = t_unfused;
  return r;
}

}  // namespace memascend::cli
