// memascend/kernels.h: the arithmetic of offloaded mixed-precision training, fused.
//
// - HasOverflow: one pass over many fp32/fp16/bf16 tensors that says whether any
//   element is inf or NaN. No temporaries (ZeRO builds two bool tensors the size of the
//   gradients), stops early, multi-threaded, AVX2/AVX-512 chosen at run time.
// - FusedAdam: one pass reading fp32 master weights, both moments and the gradient
//   (fp32, fp16 or bf16; unscaled and clipped on the fly), writing master weights,
//   moments and, in the same pass, the fp16/bf16 working copy of the parameters.
// - Convert: fp32 <-> fp16/bf16, round to nearest even.
// - DynamicLossScaler: scale, growth interval, backoff, hysteresis.
// CUDA versions (one launch per list of device tensors, stream-ordered) are in
// memascend/cuda_kernels.h.
//
//   memascend::KernelThreads threads(8);  // made once, reused; kernels allocate nothing
//   const memascend::TensorView grads[] = {{g0, n0, memascend::DType::kBF16}, ...};
//   if (memascend::HasOverflow(grads, {&threads})) scaler.Update(true);  // skip the step
//
// Note [adam]: with g = grad * grad_multiplier (1 / loss scale x clip coefficient),
// step t (from 1): Adam adds weight_decay * p to g; then m = b1 m + (1 - b1) g,
// v = b2 v + (1 - b2) g^2; AdamW multiplies p by (1 - lr * weight_decay); then
// p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). This is PyTorch's
// formulation. fp32 throughout; it matches a double-precision evaluation of the same
// formula to 2e-6 relative error per step (tests/kernels/adam_test.cpp).
//
// Thread-safety: the kernels are pure functions of their arguments; a KernelThreads
// runs one parallel call at a time (concurrent calls on one pool are serialised).
#ifndef MEMASCEND_KERNELS_H_
#define MEMASCEND_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

#include <absl/status/status.h>

#include <memascend/system.h>
#include <memascend/types.h>

namespace memascend {

// A tensor's bytes: `elements` values of `dtype` at `data` (no alignment needed).
struct TensorView {
  const void* data = nullptr;
  std::size_t elements = 0;
  DType dtype = DType::kF32;
};
struct MutableTensorView {
  void* data = nullptr;
  std::size_t elements = 0;
  DType dtype = DType::kF32;
};

// A fixed set of worker threads for the CPU kernels. Made once (it starts its threads),
// then each parallel call hands out chunks to the workers and the caller without
// allocating. Move-less; destroy it when no call is running.
class KernelThreads {
 public:
  // `threads` in total, the calling thread included (at least 1); fewer where the system
  // makes no more (a container's pids.max): size() says how many.
  explicit KernelThreads(int threads);
  ~KernelThreads();
  KernelThreads(const KernelThreads&) = delete;
  KernelThreads& operator=(const KernelThreads&) = delete;

  int size() const noexcept;

  // Calls fn(i) for every i in [0, chunks), spread over the threads; returns when all
  // are done. fn must not throw.
  template <typename F>
  void ParallelFor(std::size_t chunks, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    Run(
        chunks, [](void* ctx, std::size_t i) { (*static_cast<Fn*>(ctx))(i); },
        const_cast<void*>(static_cast<const void*>(std::addressof(fn))));
  }

 private:
  struct Impl;
  void Run(std::size_t chunks, void (*thunk)(void*, std::size_t), void* ctx);
  Impl* impl_;
};

struct KernelOptions {
  KernelThreads* threads = nullptr;  // null: the calling thread only
  // Cap on the instruction set (the probe's best by default); for tests and benchmarks.
  SimdLevel max_simd = SimdLevel::kAvx512;
};

// True if any element of any tensor is +-inf or NaN. Negative zero, subnormals and the
// largest finite values are not overflows. Allocates nothing.
bool HasOverflow(std::span<const TensorView> tensors, const KernelOptions& options = {});

// The same answer the way PyTorch's loss scalers compute it, for comparison (the
// benchmarks' ablation, bench/ablation.py): per tensor, isinf(t).any() then
// isnan(t).any(), each pass writing a one-byte-per-element temporary that is then reduced
// (ATen's kernels, on the options' threads). So it reads a finite tensor four times,
// allocates as many bytes as the largest tensor has elements, and stops only after a
// whole pass that found an overflow, not at the first one.
bool HasOverflowWithTemporaries(std::span<const TensorView> tensors,
                                const KernelOptions& options = {});

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;             // decoupled weight decay (AdamW) or L2 (Adam)
  std::int64_t step = 1;         // 1-based, for bias correction
  float grad_multiplier = 1.0f;  // 1 / loss scale, times the clip coefficient
};

// The clip coefficient for a global gradient norm: min(1, max_norm / (norm + 1e-6)).
float ClipCoefficient(double global_norm, double max_norm) noexcept;

// Sum of squares of all elements (in double), for the global gradient norm, added to
// `total`. Each tensor is summed in tasks of 2^16 elements and the tasks' sums are added
// to the total one by one, in order, whatever the thread count. So a caller holding a
// gradient in slices whose boundaries are multiples of 2^16 elements can sum it slice by
// slice, each call continuing the last one's total, and gets the bits of one call over
// the whole.
double SumOfSquares(std::span<const TensorView> tensors, const KernelOptions& options = {},
                    double total = 0);

// Note [adam]. `master`, `exp_avg`, `exp_avg_sq` are fp32 and updated in place; `grad`
// is fp32, fp16 or bf16; `params_out` (optional: data null) receives the updated
// weights as fp16, bf16 or fp32. kInvalidArgument for mismatched element counts, a
// non-fp32 state, or a bad config (step < 1, betas outside [0, 1)).
absl::Status FusedAdam(const AdamConfig& config, std::span<float> master, std::span<float> exp_avg,
                       std::span<float> exp_avg_sq, TensorView grad, MutableTensorView params_out,
                       const KernelOptions& options = {});

// Element-wise dtype conversion, round to nearest even (NaN stays NaN, overflow to
// fp16 becomes inf); between equal dtypes a copy, bit for bit. Either way spread over the
// threads (Note [kernel grain]). `from` and `to` must not overlap. kInvalidArgument for
// mismatched counts.
absl::Status Convert(TensorView from, MutableTensorView to, const KernelOptions& options = {});

// Single values, for tests and scalar code.
std::uint16_t FloatToHalf(float f) noexcept;
float HalfToFloat(std::uint16_t h) noexcept;
std::uint16_t FloatToBFloat16(float f) noexcept;
float BFloat16ToFloat(std::uint16_t b) noexcept;

// Dynamic loss scaling for fp16 training (DeepSpeed's and Apex's rules).
//
//   DynamicLossScaler scaler;
//   loss *= scaler.scale();  ...backward...
//   const bool overflow = HasOverflow(grads);
//   if (scaler.Update(overflow)) Adam(... grad_multiplier = 1 / scaler_scale_used ...);
//
// Update(overflow) returns whether the step should be applied. On an overflow the step
// is skipped; after `hysteresis` overflows (consecutive or not, unless a good step
// restores it with consecutive_hysteresis) the scale is multiplied by backoff_factor.
// After growth_interval good steps in a row the scale is multiplied by growth_factor.
// Thread-safety: none.
class DynamicLossScaler {
 public:
  struct Options {
    float initial_scale = 65536.0f;
    float growth_factor = 2.0f;
    float backoff_factor = 0.5f;
    std::int64_t growth_interval = 1000;
    int hysteresis = 2;
    bool consecutive_hysteresis = false;
    float min_scale = 1.0f;
    float max_scale = 16777216.0f;  // 2^24
  };
  DynamicLossScaler() : DynamicLossScaler(Options{}) {}
  explicit DynamicLossScaler(const Options& options);

  float scale() const noexcept { return scale_; }
  bool Update(bool overflow) noexcept;
  std::int64_t good_steps() const noexcept { return good_steps_; }
  int hysteresis_left() const noexcept { return hysteresis_left_; }
  std::int64_t skipped_steps() const noexcept { return skipped_; }

  // The whole state, to checkpoint a run and resume it with the same scales.
  struct State {
    float scale = 0;
    std::int64_t good_steps = 0;
    int hysteresis_left = 0;
    std::int64_t skipped = 0;
  };
  State state() const noexcept { return {scale_, good_steps_, hysteresis_left_, skipped_}; }
  // kInvalidArgument, and nothing changes, for a scale outside [min_scale, max_scale]
  // or negative counters.
  absl::Status Restore(const State& state);

 private:
  Options options_;
  float scale_;
  std::int64_t good_steps_ = 0;
  int hysteresis_left_;
  std::int64_t skipped_ = 0;
};

}  // namespace memascend

#endif  // MEMASCEND_KERNELS_H_
