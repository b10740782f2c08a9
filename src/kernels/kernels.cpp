// The public CPU kernels: instruction-set dispatch, threading, validation.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <memascend/kernels.h>

#include "kernels/isa.h"
#include "prim/os.h"

namespace memascend {

namespace kernels {

const Isa& PickIsa(SimdLevel cap) {
  static const SimdLevel best =
      SelectSimd(prim::ProbeCpu(), ProbeOptions::FromEnvironment().max_simd);
  const SimdLevel level = static_cast<int>(best) < static_cast<int>(cap) ? best : cap;
  switch (level) {
#if MEMASCEND_X86_SIMD
    case SimdLevel::kAvx512:
      return Avx512Isa();
    case SimdLevel::kAvx2:
      return Avx2Isa();
#else
    case SimdLevel::kAvx512:
    case SimdLevel::kAvx2:
      break;  // no such kernels off x86 (the probe reports none there either)
#endif
    case SimdLevel::kScalar:
      break;
  }
  return ScalarIsa();
}

}  // namespace kernels

namespace {

constexpr std::size_t kChunkElements = 1u << 18;  // 1 MiB of fp32 per task
// Note [sum tasks]: the sum of squares' task, on which its bits depend (its partial sums
// are added in task order), so fixed whatever the threads: 2^16 elements, so that a part
// of 2^20 elements (memascend.torch's) is 16 tasks, one per thread of the GPU machines.
// At 2^18 it was 4: the gradients' norm, which runs as each part lands, used 4 of 16
// threads (docs/kernels.md). Bits of sums over more than 2^16 elements differ from those
// of versions before 2026-11-27 in their last places.
constexpr std::size_t kSumChunkElements = 1u << 16;

// Runs fn(begin, end) over [0, n) in tasks of ElementwiseGrain (Note [kernel grain]), on
// the pool if any.
template <typename F>
void Chunked(KernelThreads* threads, std::size_t n, F&& fn) {
  const std::size_t grain = kernels::ElementwiseGrain(threads ? threads->size() : 1, n);
  const std::size_t chunks = (n + grain - 1) / grain;
  if (threads == nullptr || chunks <= 1) {
    if (n > 0) fn(std::size_t{0}, n);
    return;
  }
  threads->ParallelFor(chunks, [&](std::size_t c) {
    const std::size_t begin = c * grain;
    fn(begin, std::min(n, begin + grain));
  });
}

// Tasks over a list of tensors without building a list: task c is found by walking the
// tensors' task counts. The grain is the list's (Note [kernel grain]).
template <typename F>
void ChunkedList(KernelThreads* threads, std::span<const TensorView> tensors, F&& fn) {
  std::size_t elements = 0;
  for (const TensorView& t : tensors) elements += t.elements;
  const std::size_t grain = kernels::ElementwiseGrain(threads ? threads->size() : 1, elements);
  std::size_t chunks = 0;
  for (const TensorView& t : tensors) chunks += (t.elements + grain - 1) / grain;
  const auto run = [&](std::size_t c) {
    for (const TensorView& t : tensors) {
      const std::size_t mine = (t.elements + grain - 1) / grain;
      if (c < mine) {
        const std::size_t begin = c * grain;
        fn(t, begin, std::min(t.elements, begin + grain));
        return;
      }
      c -= mine;
    }
  };
  if (threads == nullptr || chunks <= 1) {
    for (std::size_t c = 0; c < chunks; ++c) run(c);
  } else {
    threads->ParallelFor(chunks, run);
  }
}

}  // namespace

// ---- KernelThreads -------------------------------------------------------------------

// Note [kernel threads]: a call's function, context and chunk counter live in a Call on
// the caller's stack, published under `mu` with a new generation. A worker joins a call
// only under `mu`, taking the Call's address and counting itself in `running`; the
// caller unpublishes its Call under `mu` once `running` is back to 0. So a worker that
// wakes late, after its call ended, finds no call (or the next one, whole) and never
// mixes one call's counter with another's function: the bug this replaced let such a
// worker run a chunk of the next call with the previous call's dangling lambda, which
// showed as losses that differed now and then on a 16-core machine.
//
// Note [worker spin]: a worker that has finished a call watches for the next one for
// kSpin (reading `published`, yielding the CPU between reads) before it sleeps on `wake`.
// The optimizer calls the pool once per part, back to back, and each call lasts tens to
// hundreds of microseconds: a worker woken through the condition variable for each
// joined late and did a fraction of its share (the fused Adam over parts of 2^18
// elements, 2 threads: 0.68 x one call over the whole with sleeping workers). It still
// joins under `mu` (Note [kernel threads]); the spin only decides when to look. A pool
// with more threads than the machine has CPUs does not spin: its watchers would take the
// CPUs the others work on.
struct KernelThreads::Impl {
  static constexpr std::chrono::microseconds kSpin{200};
  struct Call {
    void (*thunk)(void*, std::size_t);
    void* ctx;
    std::size_t chunks;
    std::atomic<std::size_t> next{0};

    void Drain() {
      for (std::size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
        thunk(ctx, c);
      }
    }
  };

  std::mutex call_mu;  // one parallel call at a time
  std::mutex mu;
  std::condition_variable wake, done;
  std::vector<std::thread> workers;
  std::uint64_t generation = 0;             // of the published call
  std::atomic<std::uint64_t> published{0};  // `generation`, readable without mu (a hint)
  bool spin = true;                         // Note [worker spin]; set before any worker
  bool stop = false;
  Call* call = nullptr;     // the call in progress, if any (guarded by mu)
  std::size_t running = 0;  // workers inside `call` (guarded by mu)

  void Work() {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu);
    const auto ready = [&] { return stop || (call != nullptr && generation != seen); };
    for (;;) {
      if (spin && !ready()) {  // Note [worker spin]
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (published.load(std::memory_order_acquire) == seen &&
               std::chrono::steady_clock::now() < until) {
          std::this_thread::yield();
        }
        lock.lock();
      }
      wake.wait(lock, ready);
      if (stop) return;
      seen = generation;
      Call* joined = call;
      ++running;
      lock.unlock();
      joined->Drain();
      lock.lock();
      if (--running == 0) done.notify_all();
    }
  }
};

KernelThreads::KernelThreads(int threads) : impl_(new Impl) {
  const unsigned cpus = std::thread::hardware_concurrency();
  impl_->spin = cpus == 0 || static_cast<unsigned>(std::max(threads, 1)) <= cpus;
  for (int i = 1; i < std::max(threads, 1); ++i) {
    try {
      impl_->workers.push_back(prim::StartThread("ma-kernel", [this] { impl_->Work(); }));
    } catch (const std::system_error&) {
      break;  // the system makes no more (pids.max, ulimit -u): fewer, as size() says
    }
  }
}

KernelThreads::~KernelThreads() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  for (std::thread& t : impl_->workers) t.join();
  delete impl_;
}

int KernelThreads::size() const noexcept { return static_cast<int>(impl_->workers.size()) + 1; }

void KernelThreads::Run(std::size_t chunks, void (*thunk)(void*, std::size_t), void* ctx) {
  std::lock_guard<std::mutex> serial(impl_->call_mu);
  Impl& m = *impl_;
  Impl::Call call{thunk, ctx, chunks};
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.call = &call;
    ++m.generation;
    m.published.store(m.generation, std::memory_order_release);
  }
  m.wake.notify_all();
  call.Drain();  // the caller works too
  std::unique_lock<std::mutex> lock(m.mu);
  // Every chunk has been taken; wait for the workers still finishing theirs, then
  // unpublish the call before any other worker can join it (Note [kernel threads]).
  m.done.wait(lock, [&] { return m.running == 0; });
  m.call = nullptr;
}

// ---- Kernels ---------------------------------------------------------------------------

bool HasOverflow(std::span<const TensorView> tensors, const KernelOptions& options) {
  const kernels::Isa& isa = kernels::PickIsa(options.max_simd);
  std::atomic<bool> found{false};
  ChunkedList(
      options.threads, tensors, [&](const TensorView& t, std::size_t begin, std::size_t end) {
        if (found.load(std::memory_order_relaxed) || t.data == nullptr) return;  // stop early
        bool bad;
        if (t.dtype == DType::kF32) {
          bad =
              isa.any_nonfinite_32(static_cast<const std::uint32_t*>(t.data) + begin, end - begin);
        } else {
          bad = isa.any_nonfinite_16(static_cast<const std::uint16_t*>(t.data) + begin, end - begin,
                                     t.dtype == DType::kF16 ? 0x7c00 : 0x7f80);
        }
        if (bad) found.store(true, std::memory_order_relaxed);
      });
  return found.load();
}

bool HasOverflowWithTemporaries(std::span<const TensorView> tensors, const KernelOptions& options) {
  for (const TensorView& t : tensors) {
    if (t.data == nullptr || t.elements == 0) continue;
    const TensorView one[] = {t};
    for (const bool inf_pass : {true, false}) {
      std::vector<std::uint8_t> flags(t.elements);  // isinf(t) or isnan(t): a bool tensor
      ChunkedList(options.threads, one,
                  [&](const TensorView& v, std::size_t begin, std::size_t end) {
                    for (std::size_t i = begin; i < end; ++i) {
                      bool special, quiet;  // all-ones exponent; and a non-zero mantissa (NaN)
                      if (v.dtype == DType::kF32) {
                        const std::uint32_t b = static_cast<const std::uint32_t*>(v.data)[i];
                        special = (b & 0x7f800000u) == 0x7f800000u;
                        quiet = (b & 0x007fffffu) != 0;
                      } else {
                        const std::uint16_t b = static_cast<const std::uint16_t*>(v.data)[i];
                        const std::uint16_t exp = v.dtype == DType::kF16 ? 0x7c00 : 0x7f80;
                        special = (b & exp) == exp;
                        quiet = (b & static_cast<std::uint16_t>(~exp & 0x7fff)) != 0;
                      }
                      flags[i] = special && (inf_pass ? !quiet : quiet);
                    }
                  });
      std::atomic<bool> any{false};  // .any(): a reduction over the temporary, chunk by chunk
      ChunkedList(options.threads, one, [&](const TensorView&, std::size_t begin, std::size_t end) {
        bool mine = false;
        for (std::size_t i = begin; i < end; ++i) mine |= flags[i] != 0;
        if (mine) any.store(true, std::memory_order_relaxed);
      });
      if (any.load()) return true;
    }
  }
  return false;
}

// Deterministic: chunk partials are added in chunk order (a run-to-run identical norm,
// so offloaded and in-memory runs clip identically), in waves of a fixed stack buffer.
double SumOfSquares(std::span<const TensorView> tensors, const KernelOptions& options,
                    double total) {
  const kernels::Isa& isa = kernels::PickIsa(options.max_simd);
  std::size_t chunks = 0;
  for (const TensorView& t : tensors)
    chunks += (t.elements + kSumChunkElements - 1) / kSumChunkElements;
  constexpr std::size_t kWave = 1024;
  double partial[kWave];
  for (std::size_t base = 0; base < chunks; base += kWave) {
    const std::size_t n = std::min(kWave, chunks - base);
    const auto run = [&](std::size_t i) {
      std::size_t c = base + i;
      for (const TensorView& t : tensors) {
        const std::size_t mine = (t.elements + kSumChunkElements - 1) / kSumChunkElements;
        if (c < mine) {
          const std::size_t begin = c * kSumChunkElements;
          partial[i] = isa.sum_squares(t.data, t.dtype, begin,
                                       std::min(t.elements, begin + kSumChunkElements));
          return;
        }
        c -= mine;
      }
    };
    if (options.threads == nullptr || n <= 1) {
      for (std::size_t i = 0; i < n; ++i) run(i);
    } else {
      options.threads->ParallelFor(n, run);
    }
    for (std::size_t i = 0; i < n; ++i) total += partial[i];
  }
  return total;
}

float ClipCoefficient(double global_norm, double max_norm) noexcept {
  if (!(max_norm > 0) || !std::isfinite(global_norm)) return 1.0f;
  const double c = max_norm / (global_norm + 1e-6);
  return c < 1.0 ? static_cast<float>(c) : 1.0f;
}

absl::Status FusedAdam(const AdamConfig& c, std::span<float> master, std::span<float> exp_avg,
                       std::span<float> exp_avg_sq, TensorView grad, MutableTensorView params_out,
                       const KernelOptions& options) {
  const std::size_t n = master.size();
  if (exp_avg.size() != n || exp_avg_sq.size() != n || grad.elements != n ||
      (params_out.data != nullptr && params_out.elements != n)) {
    return absl::InvalidArgumentError(
        fmt::format("fused adam: element counts differ (master {}, m {}, v {}, grad {}, params {})",
                    n, exp_avg.size(), exp_avg_sq.size(), grad.elements, params_out.elements));
  }
  if (absl::Status s = kernels::ValidateAdamConfig(c); !s.ok()) return s;
  kernels::AdamArgs a = kernels::AdamCoefficients(c);
  a.master = master.data();
  a.m = exp_avg.data();
  a.v = exp_avg_sq.data();
  a.grad = grad.data;
  a.grad_type = grad.dtype;
  a.out = params_out.data;
  a.out_type = params_out.dtype;
  const kernels::Isa& isa = kernels::PickIsa(options.max_simd);
  Chunked(options.threads, n, [&](std::size_t begin, std::size_t end) { isa.adam(a, begin, end); });
  return absl::OkStatus();
}

absl::Status Convert(TensorView from, MutableTensorView to, const KernelOptions& options) {
  if (from.elements != to.elements) {
    return absl::InvalidArgumentError(
        fmt::format("convert: {} elements into {}", from.elements, to.elements));
  }
  if (from.dtype == to.dtype) {  // a copy, bit for bit, over the threads as a conversion is
    const std::size_t size = SizeOf(from.dtype);
    Chunked(options.threads, from.elements, [&](std::size_t begin, std::size_t end) {
      std::memcpy(static_cast<std::byte*>(to.data) + begin * size,
                  static_cast<const std::byte*>(from.data) + begin * size, (end - begin) * size);
    });
    return absl::OkStatus();
  }
  const kernels::Isa& isa = kernels::PickIsa(options.max_simd);
  Chunked(options.threads, from.elements, [&](std::size_t begin, std::size_t end) {
    isa.convert(from.data, from.dtype, to.data, to.dtype, begin, end);
  });
  return absl::OkStatus();
}

namespace kernels {

// Note [kernel grain]: an element-wise kernel (each element's result its own: the Adam
// update, a conversion, the overflow check's "any") is cut into tasks for the pool. One
// task per kChunkElements (2^18) leaves threads idle whenever a call is small against the
// pool: the offloaded optimizer calls once per part, and memascend.torch's parts are 2^20
// elements, so a 16-thread pool ran each part's update on 4 threads. So a call is cut into
// about kTasksPerThread tasks per thread (balance against a worker that wakes late), of
// at least kMinGrain elements (a task of ~100 KiB outlasts its dispatch many times over),
// at most kChunkElements, and a multiple of kGrainAlign (whole pages of fp32, whole
// vectors). The results are the same bits whatever the grain. The sum of squares is not
// element-wise: its tasks are fixed, as its bits depend on them (Note [sum tasks]).
std::size_t ElementwiseGrain(int threads, std::size_t elements) noexcept {
  constexpr std::size_t kTasksPerThread = 4;
  constexpr std::size_t kMinGrain = std::size_t{1} << 14;
  constexpr std::size_t kGrainAlign = std::size_t{1} << 12;
  if (threads <= 1) return kChunkElements;
  const std::size_t tasks = static_cast<std::size_t>(threads) * kTasksPerThread;
  const std::size_t per_task = (elements + tasks - 1) / tasks;
  const std::size_t aligned = (per_task + kGrainAlign - 1) / kGrainAlign * kGrainAlign;
  return std::clamp(aligned, kMinGrain, kChunkElements);
}

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  if (c.step < 1 || !(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1) ||
      !(c.eps > 0) || !(c.lr >= 0) || !(c.weight_decay >= 0)) {
    return absl::InvalidArgumentError(
        fmt::format("adam: bad config (step {}, betas {} {}, eps {}, lr {}, decay {})", c.step,
                    c.beta1, c.beta2, c.eps, c.lr, c.weight_decay));
  }
  return absl::OkStatus();
}

AdamArgs AdamCoefficients(const AdamConfig& c) {
  AdamArgs a{};
  a.b1 = c.beta1;
  a.b2 = c.beta2;
  a.one_minus_b1 = 1.0f - c.beta1;
  a.one_minus_b2 = 1.0f - c.beta2;
  a.eps = c.eps;
  a.l2 = c.adamw ? 0.0f : c.weight_decay;
  a.decay = c.adamw ? 1.0f - c.lr * c.weight_decay : 1.0f;
  const double bc1 = 1.0 - std::pow(static_cast<double>(c.beta1), static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(c.beta2), static_cast<double>(c.step));
  a.step_size = static_cast<float>(static_cast<double>(c.lr) / bc1);
  a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  a.grad_mul = c.grad_multiplier;
  return a;
}

}  // namespace kernels

// ---- DynamicLossScaler -----------------------------------------------------------------

DynamicLossScaler::DynamicLossScaler(const Options& options)
    : options_(options),
      scale_(options.initial_scale),
      hysteresis_left_(std::max(options.hysteresis, 1)) {}

bool DynamicLossScaler::Update(bool overflow) noexcept {
  if (overflow) {
    ++skipped_;
    good_steps_ = 0;
    if (hysteresis_left_ <= 1) {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      hysteresis_left_ = std::max(options_.hysteresis, 1);
    } else {
      --hysteresis_left_;
    }
    return false;
  }
  if (options_.consecutive_hysteresis) hysteresis_left_ = std::max(options_.hysteresis, 1);
  if (++good_steps_ >= options_.growth_interval) {
    scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
    good_steps_ = 0;
  }
  return true;
}

absl::Status DynamicLossScaler::Restore(const State& state) {
  if (!(state.scale >= options_.min_scale && state.scale <= options_.max_scale) ||
      state.good_steps < 0 || state.hysteresis_left < 1 || state.skipped < 0) {
    return absl::InvalidArgumentError(
        fmt::format("loss scaler state out of range: scale {} (allowed {}..{}), good steps {}, "
                    "hysteresis {}, skipped {}",
                    state.scale, options_.min_scale, options_.max_scale, state.good_steps,
                    state.hysteresis_left, state.skipped));
  }
  scale_ = state.scale;
  good_steps_ = state.good_steps;
  hysteresis_left_ = state.hysteresis_left;
  skipped_ = state.skipped;
  return absl::OkStatus();
}

}  // namespace memascend
