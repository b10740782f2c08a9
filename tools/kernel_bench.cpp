// memascend bench kernels: the fused kernels against the unfused ways of computing the
// same thing, and against the machine's memory-bandwidth ceilings, in one run.
#include "kernel_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memascend/cuda_kernels.h>
#include <memascend/host_arena.h>
#include <memascend/kernels.h>
#include <memascend/status.h>
#include <memascend/system.h>

#include "alloc_counter.h"
#include "cuda_bench_kernels.h"
#include "kernels/isa.h"
#include "prim/cuda.h"
#include "prim/cuda_memory.h"

#if MEMASCEND_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

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

// The workload both benchmarks run: finite gradients, small weights, AdamW with loss
// scaling, and the bytes each Adam variant moves per element.
struct Workload {
  std::vector<float> grad32, master;
  std::vector<std::uint16_t> grad16;  // bf16
};
Workload MakeWorkload(std::size_t n) {
  Workload w{std::vector<float>(n), std::vector<float>(n), std::vector<std::uint16_t>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    w.grad32[i] = static_cast<float>(static_cast<long>(i % 1999) - 999) * 1e-3f;
    w.master[i] = static_cast<float>(i % 977) * 1e-4f;
    w.grad16[i] = FloatToBFloat16(w.grad32[i]);
  }
  return w;
}
AdamConfig BenchAdam() {
  AdamConfig c;
  c.weight_decay = 0.01f;
  c.grad_multiplier = 1.0f / 1024;
  return c;
}
// Fused: read p m v g, write p m v and the bf16 working copy. Unfused: unscale (read g16,
// write g), m (read m g, write m), v (read v g, write v), update (read p m v, write p),
// conversion (read p, write the copy).
constexpr double kAdamFusedBytes = 4 + 4 + 4 + 2 + 4 + 4 + 4 + 2;
constexpr double kAdamUnfusedBytes = (2 + 4) + (8 + 4) + (8 + 4) + (12 + 4) + (4 + 2);
// The unfused passes' coefficients (no bias correction: step 1's is folded into lr).
struct UnfusedAdam {
  float b1, b2, eps, mul, step_size, inv_sqrt_bc2, decay;
};
UnfusedAdam Unfused(const AdamConfig& c) {
  return {c.beta1,
          c.beta2,
          c.eps,
          c.grad_multiplier,
          c.lr / (1 - c.beta1),
          1.0f / std::sqrt(1 - c.beta2),
          1 - c.lr * c.weight_decay};
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

absl::StatusOr<KernelBenchResult> RunKernelBench(std::size_t n, int threads, int reps,
                                                 std::size_t part_elements) {
  if (n < (1u << 16)) return absl::InvalidArgumentError("--elements must be at least 65536");
  if (part_elements < 4096)
    return absl::InvalidArgumentError("--part-elements must be at least 4096");
  if (!ProbeSystem(ProbeOptions{}).cpu.avx2) {
    return absl::FailedPreconditionError("the baselines are built for AVX2, which this CPU lacks");
  }
  KernelBenchResult r;
  r.device = "cpu";
  r.elements = n;
  r.threads = threads;
  KernelThreads pool(threads);
  KernelOptions opt{&pool};
  const kernels::Isa& isa = kernels::PickIsa(SimdLevel::kAvx512);
  r.simd = std::string(ToString(isa.level));

  Workload w = MakeWorkload(n);
  std::vector<float>&grad32 = w.grad32, &master = w.master;
  std::vector<std::uint16_t>& grad16 = w.grad16;
  std::vector<float> m(n, 0.0f), v(n, 0.0f), copy_dst(n);
  std::vector<std::uint16_t> out16(n);
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
  const AdamConfig c = BenchAdam();
  absl::Status status;
  r.adam_fused_bytes_per_element = kAdamFusedBytes;
  // One call over the whole, and the same bytes one part at a time as the offloaded
  // optimizer updates them (Note [parts]: a call per part, each spread over the pool on
  // its own, Note [kernel grain]); their repetitions alternate, so neither always runs on
  // the other's warm caches.
  r.adam_part_elements = std::min(part_elements, n);
  const auto whole = [&] {
    status.Update(FusedAdam(c, master, m, v, {grad16.data(), n, DType::kBF16},
                            {out16.data(), n, DType::kBF16}, opt));
  };
  const auto parts = [&] {
    for (std::size_t b = 0; b < n; b += r.adam_part_elements) {
      const std::size_t k = std::min(r.adam_part_elements, n - b);
      status.Update(FusedAdam(c, std::span(master).subspan(b, k), std::span(m).subspan(b, k),
                              std::span(v).subspan(b, k), {grad16.data() + b, k, DType::kBF16},
                              {out16.data() + b, k, DType::kBF16}, opt));
    }
  };
  double t_adam = 1e30, t_parts = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    t_adam = std::min(t_adam, BestSeconds(1, whole));
    t_parts = std::min(t_parts, BestSeconds(1, parts));
  }
  MEMASCEND_RETURN_IF_ERROR(status);
  r.adam_fused_gbps = r.adam_fused_bytes_per_element * static_cast<double>(n) / t_adam / 1e9;
  r.adam_parts_gbps = r.adam_fused_bytes_per_element * static_cast<double>(n) / t_parts / 1e9;

  const UnfusedAdam u = Unfused(c);
  before = AllocatedBytes();
  std::vector<float> g(n);  // the unscaled fp32 gradient: made once, reused (a caching allocator)
  r.adam_unfused_extra_bytes = AllocatedBytes() - before;
  const double t_unfused = BestSeconds(reps, [&] {
    Chunks(pool, n, [&](std::size_t b, std::size_t e) {
      UnscalePass(grad16.data(), g.data(), u.mul, b, e);
    });
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { MomentPass(m.data(), g.data(), u.b1, b, e); });
    Chunks(pool, n,
           [&](std::size_t b, std::size_t e) { SecondMomentPass(v.data(), g.data(), u.b2, b, e); });
    Chunks(pool, n, [&](std::size_t b, std::size_t e) {
      UpdatePass(master.data(), m.data(), v.data(), u.decay, u.step_size, u.inv_sqrt_bc2, u.eps, b,
                 e);
    });
    MutableTensorView out{out16.data(), n, DType::kBF16};
    status.Update(Convert({master.data(), n, DType::kF32}, out, opt));
  });
  MEMASCEND_RETURN_IF_ERROR(status);
  r.adam_unfused_bytes_per_element = kAdamUnfusedBytes;
  r.adam_unfused_gbps = r.adam_unfused_bytes_per_element * static_cast<double>(n) / t_unfused / 1e9;
  r.adam_fused_seconds = t_adam;
  r.adam_unfused_seconds = t_unfused;
  return r;
}

#if MEMASCEND_HAVE_CUDA
namespace {

absl::Status Cuda(int err, std::string_view what) {
  if (err == 0) return absl::OkStatus();
  return absl::InternalError(
      fmt::format("{}: {}", what, cudaGetErrorString(static_cast<cudaError_t>(err))));
}

template <typename T>
T* As(const prim::DeviceAllocation& a) {
  return reinterpret_cast<T*>(a.data());
}

std::size_t DeviceFreeBytes() {
  std::size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return free;
}

// `reps` timings (CUDA events on `stream`) of `f`, after one warm-up run. `f` returns a
// cudaError_t value; the first error ends the measurement.
template <typename F>
absl::StatusOr<std::vector<double>> DeviceSeconds(int reps, cudaStream_t stream, F&& f) {
  MEMASCEND_RETURN_IF_ERROR(Cuda(f(), "warm-up"));
  cudaEvent_t start = nullptr, stop = nullptr;
  MEMASCEND_RETURN_IF_ERROR(Cuda(cudaEventCreate(&start), "cudaEventCreate"));
  MEMASCEND_RETURN_IF_ERROR(Cuda(cudaEventCreate(&stop), "cudaEventCreate"));
  std::vector<double> times;
  absl::Status status;
  for (int r = 0; r < reps && status.ok(); ++r) {
    status.Update(Cuda(cudaEventRecord(start, stream), "cudaEventRecord"));
    status.Update(Cuda(f(), "kernels"));
    status.Update(Cuda(cudaEventRecord(stop, stream), "cudaEventRecord"));
    status.Update(Cuda(cudaEventSynchronize(stop), "cudaEventSynchronize"));
    float ms = 0;
    status.Update(Cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    times.push_back(static_cast<double>(ms) / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  MEMASCEND_RETURN_IF_ERROR(status);
  return times;
}

// Best of `reps` timings of `f` (DeviceSeconds).
template <typename F>
absl::StatusOr<double> BestDeviceSeconds(int reps, cudaStream_t stream, F&& f) {
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<double> times,
                             DeviceSeconds(reps, stream, std::forward<F>(f)));
  double best = 1e30;
  for (double t : times) best = std::min(best, t);
  return best;
}

// The median of `v`; +inf for none (so a rate computed from it is 0).
double Median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::infinity();
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Device 0 made current, its properties; kFailedPrecondition (saying why) without one.
absl::StatusOr<cudaDeviceProp> OpenDevice0(std::string_view what) {
  if (prim::CudaDeviceCount() == 0) {
    const CudaInfo cuda = prim::ProbeCuda(prim::CudaDisabledByEnvironment());
    return absl::FailedPreconditionError(fmt::format("{}: no CUDA device ({})", what, cuda.status));
  }
  MEMASCEND_RETURN_IF_ERROR(Cuda(cudaSetDevice(0), "cudaSetDevice"));
  cudaDeviceProp prop{};
  MEMASCEND_RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"));
  return prop;
}

// A non-blocking stream of the benchmark's own, destroyed with it.
class OwnStream {
 public:
  static absl::StatusOr<std::unique_ptr<OwnStream>> Create() {
    cudaStream_t s = nullptr;
    MEMASCEND_RETURN_IF_ERROR(
        Cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    return std::unique_ptr<OwnStream>(new OwnStream(s));
  }
  ~OwnStream() { cudaStreamDestroy(stream_); }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  cudaStream_t get() const noexcept { return stream_; }

 private:
  explicit OwnStream(cudaStream_t s) : stream_(s) {}
  cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<KernelBenchResult> RunCudaKernelBench(std::size_t n, int reps) {
  n -= n % 16;
  if (n < (1u << 16)) return absl::InvalidArgumentError("--elements must be at least 65536");
  MEMASCEND_ASSIGN_OR_RETURN(const cudaDeviceProp prop, OpenDevice0("bench kernels --device cuda"));
  KernelBenchResult r;
  r.device = "cuda";
  r.elements = n;
  r.threads = prop.multiProcessorCount;
  r.simd = fmt::format("{} sm_{}{}", prop.name, prop.major, prop.minor);
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<OwnStream> own_stream, OwnStream::Create());
  cudaStream_t stream = own_stream->get();
  const CudaStreamView view(stream);

  // The same values as the CPU benchmark.
  const Workload w = MakeWorkload(n);
  MEMASCEND_ASSIGN_OR_RETURN(auto grad32, prim::DeviceAllocation::Allocate(0, 4 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto grad16, prim::DeviceAllocation::Allocate(0, 2 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto master, prim::DeviceAllocation::Allocate(0, 4 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto m, prim::DeviceAllocation::Allocate(0, 4 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto v, prim::DeviceAllocation::Allocate(0, 4 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto out16, prim::DeviceAllocation::Allocate(0, 2 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto copy_dst, prim::DeviceAllocation::Allocate(0, 4 * n));
  MEMASCEND_ASSIGN_OR_RETURN(auto flag, prim::DeviceAllocation::Allocate(0, 16));
  for (auto [dst, src, bytes] :
       {std::tuple{grad32.data(), static_cast<const void*>(w.grad32.data()), 4 * n},
        {grad16.data(), w.grad16.data(), 2 * n},
        {master.data(), w.master.data(), 4 * n}}) {
    MEMASCEND_RETURN_IF_ERROR(Cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload"));
  }
  for (const prim::DeviceAllocation* zeroed : {&m, &v, &flag}) {
    MEMASCEND_RETURN_IF_ERROR(Cuda(cudaMemset(zeroed->data(), 0, zeroed->size()), "cudaMemset"));
  }
  auto* flag_word = As<std::uint32_t>(flag);
  const double bytes32 = 4.0 * static_cast<double>(n);

  // Ceilings.
  MEMASCEND_ASSIGN_OR_RETURN(const double t_read, BestDeviceSeconds(reps, stream, [&] {
                               return cuda_bench::ReadFold(grad32.data(), 4 * n, flag_word + 3,
                                                           stream);
                             }));
  r.read_ceiling_gbps = bytes32 / t_read / 1e9;
  MEMASCEND_ASSIGN_OR_RETURN(
      const double t_copy, BestDeviceSeconds(reps, stream, [&] {
        return static_cast<int>(cudaMemcpyAsync(copy_dst.data(), grad32.data(), 4 * n,
                                                cudaMemcpyDeviceToDevice, stream));
      }));
  r.copy_ceiling_gbps = 2 * bytes32 / t_copy / 1e9;

  // Overflow check: the fused kernel (zero the flag, one launch) vs ZeRO's two
  // boolean temporaries, each made by one kernel and reduced by another.
  const auto fused_check = [&](const TensorView& t) {
    return [&, t] {
      if (const cudaError_t e = cudaMemsetAsync(flag_word, 0, 4, stream); e != cudaSuccess)
        return static_cast<int>(e);
      const absl::Status s = CudaHasOverflow({&t, 1}, flag_word, view);
      return s.ok() ? 0 : static_cast<int>(cudaErrorUnknown);
    };
  };
  std::size_t free_before = DeviceFreeBytes();
  MEMASCEND_ASSIGN_OR_RETURN(
      const double t_fused,
      BestDeviceSeconds(reps, stream, fused_check({grad32.data(), n, DType::kF32})));
  r.overflow_fused_extra_bytes = free_before - std::min(free_before, DeviceFreeBytes());
  r.overflow_fused_gbps = bytes32 / t_fused / 1e9;
  MEMASCEND_ASSIGN_OR_RETURN(
      const double t_fused16,
      BestDeviceSeconds(reps, stream, fused_check({grad16.data(), n, DType::kBF16})));
  r.overflow_fused_bf16_gbps = 2.0 * static_cast<double>(n) / t_fused16 / 1e9;
  {
    free_before = DeviceFreeBytes();
    // The temporaries, held across calls as a caching allocator holds them.
    MEMASCEND_ASSIGN_OR_RETURN(auto inf_mask, prim::DeviceAllocation::Allocate(0, n));
    MEMASCEND_ASSIGN_OR_RETURN(auto nan_mask, prim::DeviceAllocation::Allocate(0, n));
    MEMASCEND_ASSIGN_OR_RETURN(
        const double t_base, BestDeviceSeconds(reps, stream, [&] {
          int e = cuda_bench::IsInf(As<float>(grad32), As<bool>(inf_mask), n, stream);
          if (e == 0) e = cuda_bench::Any(As<bool>(inf_mask), n, flag_word + 1, stream);
          if (e == 0) e = cuda_bench::IsNan(As<float>(grad32), As<bool>(nan_mask), n, stream);
          if (e == 0) e = cuda_bench::Any(As<bool>(nan_mask), n, flag_word + 2, stream);
          return e;
        }));
    r.overflow_baseline_extra_bytes = free_before - std::min(free_before, DeviceFreeBytes());
    r.overflow_baseline_gbps = bytes32 / t_base / 1e9;
  }
  std::uint32_t flags[4] = {};
  MEMASCEND_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(flags, flag_word, sizeof(flags), cudaMemcpyDeviceToHost), "download"));
  if (flags[0] != 0 || flags[1] != 0 || flags[2] != 0)
    return absl::InternalError("the benchmark's gradients are finite; a check said otherwise");

  // Adam: fused (bf16 gradient in, bf16 working copy out) vs one kernel per operation.
  const AdamConfig c = BenchAdam();
  r.adam_fused_bytes_per_element = kAdamFusedBytes;
  MEMASCEND_ASSIGN_OR_RETURN(const double t_adam, BestDeviceSeconds(reps, stream, [&] {
                               const absl::Status s =
                                   CudaFusedAdam(c, As<float>(master), As<float>(m), As<float>(v),
                                                 {grad16.data(), n, DType::kBF16},
                                                 {out16.data(), n, DType::kBF16}, n, view);
                               return s.ok() ? 0 : static_cast<int>(cudaErrorUnknown);
                             }));
  r.adam_fused_gbps = r.adam_fused_bytes_per_element * static_cast<double>(n) / t_adam / 1e9;
  const UnfusedAdam u = Unfused(c);
  free_before = DeviceFreeBytes();
  // The unscaled fp32 gradient, held as a caching allocator holds it.
  MEMASCEND_ASSIGN_OR_RETURN(auto g, prim::DeviceAllocation::Allocate(0, 4 * n));
  r.adam_unfused_extra_bytes = free_before - std::min(free_before, DeviceFreeBytes());
  MEMASCEND_ASSIGN_OR_RETURN(
      const double t_unfused, BestDeviceSeconds(reps, stream, [&] {
        int e = cuda_bench::Unscale(As<std::uint16_t>(grad16), As<float>(g), u.mul, n, stream);
        if (e == 0) e = cuda_bench::Moment(As<float>(m), As<float>(g), u.b1, n, stream);
        if (e == 0) e = cuda_bench::SecondMoment(As<float>(v), As<float>(g), u.b2, n, stream);
        if (e == 0)
          e = cuda_bench::Update(As<float>(master), As<float>(m), As<float>(v), u.decay,
                                 u.step_size, u.inv_sqrt_bc2, u.eps, n, stream);
        if (e == 0) e = cuda_bench::ToBf16(As<float>(master), As<std::uint16_t>(out16), n, stream);
        return e;
      }));
  r.adam_unfused_bytes_per_element = kAdamUnfusedBytes;
  r.adam_unfused_gbps = r.adam_unfused_bytes_per_element * static_cast<double>(n) / t_unfused / 1e9;
  r.adam_fused_seconds = t_adam;
  r.adam_unfused_seconds = t_unfused;
  return r;
}

absl::StatusOr<PcieBenchResult> RunPcieBench(std::size_t bytes, int reps, std::size_t chunk) {
  bytes -= bytes % kHostBlockBytes;
  if (bytes < (std::size_t{1} << 20))
    return absl::InvalidArgumentError("--size must be at least 1M");
  if (reps < 1) return absl::InvalidArgumentError("--reps must be positive");
  if (chunk >= bytes) {
    return absl::InvalidArgumentError(
        fmt::format("--chunk ({} bytes) must be under --size ({} bytes)", chunk, bytes));
  }
  MEMASCEND_ASSIGN_OR_RETURN(const cudaDeviceProp prop, OpenDevice0("bench pcie"));
  PcieBenchResult r;
  r.device = fmt::format("{} sm_{}{}", prop.name, prop.major, prop.minor);
  r.bytes = bytes;
  r.reps = reps;

  // The host side: one region of MemAscend's arena, registered with CUDA.
  HostArenaOptions ao;
  ao.backing = ArenaBacking::kCudaRegistered;
  ao.budget_bytes = bytes;
  ao.chunk_bytes = 0;
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena, HostArena::Create(ao));
  const auto t0 = std::chrono::steady_clock::now();
  MEMASCEND_ASSIGN_OR_RETURN(ArenaAllocation host, arena->Allocate(bytes));
  r.register_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.host_backing = std::string(ToString(arena->backing()));
  // Not zeros: a pattern that is checked after the round trip.
  auto* words = reinterpret_cast<std::uint64_t*>(host.data);
  const std::size_t n_words = bytes / sizeof(std::uint64_t);
  for (std::size_t i = 0; i < n_words; ++i) words[i] = i * 0x9e3779b97f4a7c15ULL;
  MEMASCEND_ASSIGN_OR_RETURN(auto device, prim::DeviceAllocation::Allocate(0, bytes));

  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<OwnStream> own_stream, OwnStream::Create());
  cudaStream_t stream = own_stream->get();
  const double gib = static_cast<double>(bytes) / double(1 << 30);
  MEMASCEND_ASSIGN_OR_RETURN(
      std::vector<double> h2d, DeviceSeconds(reps, stream, [&] {
        return static_cast<int>(
            cudaMemcpyAsync(device.data(), host.data, bytes, cudaMemcpyHostToDevice, stream));
      }));
  std::memset(host.data, 0, bytes);
  MEMASCEND_ASSIGN_OR_RETURN(
      std::vector<double> d2h, DeviceSeconds(reps, stream, [&] {
        return static_cast<int>(
            cudaMemcpyAsync(host.data, device.data(), bytes, cudaMemcpyDeviceToHost, stream));
      }));
  r.verified = true;
  for (std::size_t i = 0; i < n_words && r.verified; ++i) {
    r.verified = words[i] == i * 0x9e3779b97f4a7c15ULL;
  }
  const auto rates = [gib](const std::vector<double>& t, double* best, double* median) {
    double fastest = 1e30;
    for (double x : t) fastest = std::min(fastest, x);
    *best = gib / fastest;
    *median = gib / Median(t);
  };
  rates(h2d, &r.h2d_gib_per_s, &r.h2d_gib_per_s_median);
  rates(d2h, &r.d2h_gib_per_s, &r.d2h_gib_per_s_median);
  if (chunk > 0) {
    // The same bytes as copies of `chunk` queued back to back (the last one shorter).
    r.chunk_bytes = chunk;
    MEMASCEND_ASSIGN_OR_RETURN(std::vector<double> chunked, DeviceSeconds(reps, stream, [&] {
                                 for (std::size_t at = 0; at < bytes; at += chunk) {
                                   const cudaError_t e = cudaMemcpyAsync(
                                       device.data() + at, host.data + at,
                                       std::min(chunk, bytes - at), cudaMemcpyHostToDevice, stream);
                                   if (e != cudaSuccess) return static_cast<int>(e);
                                 }
                                 return 0;
                               }));
    rates(chunked, &r.h2d_chunked_gib_per_s, &r.h2d_chunked_gib_per_s_median);
  }
  MEMASCEND_RETURN_IF_ERROR(arena->Free(host.data));

  // Pageable memory, for comparison: what a copy from an unregistered buffer gets.
  std::unique_ptr<std::byte[]> pageable(new std::byte[bytes]);
  std::memset(pageable.get(), 1, bytes);
  MEMASCEND_ASSIGN_OR_RETURN(
      const double t_pageable, BestDeviceSeconds(reps, stream, [&] {
        return static_cast<int>(
            cudaMemcpyAsync(device.data(), pageable.get(), bytes, cudaMemcpyHostToDevice, stream));
      }));
  r.h2d_pageable_gib_per_s = gib / t_pageable;
  if (!r.verified)
    return absl::DataLossError("bench pcie: the bytes did not come back as they went");
  return r;
}
#else
absl::StatusOr<KernelBenchResult> RunCudaKernelBench(std::size_t, int) {
  return absl::FailedPreconditionError(
      "bench kernels --device cuda: no CUDA device (memascend was built without CUDA)");
}
absl::StatusOr<PcieBenchResult> RunPcieBench(std::size_t, int, std::size_t) {
  return absl::FailedPreconditionError(
      "bench pcie: no CUDA device (memascend was built without CUDA)");
}
#endif

}  // namespace memascend::cli
