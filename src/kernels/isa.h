// kernels/isa.h: one table of kernel entry points per instruction set.
//
// Note [isa units]: scalar.cpp, avx2.cpp and avx512.cpp are compiled with different
// -m flags. The vector units hold only file-local functions and intrinsics and call
// the scalar unit (never an inline helper) for their tails, so no function compiled for
// a wider instruction set can be merged into code that runs on a CPU without it.
#ifndef MEMASCEND_SRC_KERNELS_ISA_H_
#define MEMASCEND_SRC_KERNELS_ISA_H_

#include <cstddef>
#include <cstdint>

#include <absl/status/status.h>

#include <memascend/kernels.h>

namespace memascend::kernels {

struct AdamArgs {
  float* master;
  float* m;
  float* v;
  const void* grad;
  DType grad_type;
  void* out;  // null: no working copy
  DType out_type;
  float b1, b2, one_minus_b1, one_minus_b2;
  float eps;
  float l2;            // Adam's weight decay folded into g (0 for AdamW)
  float decay;         // AdamW's multiplier of p: 1 - lr * wd (1 for Adam)
  float step_size;     // lr / (1 - b1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^t)
  float grad_mul;
};

// AdamArgs' scalar fields from a config (Note [adam]); pointers and types left unset.
AdamArgs AdamCoefficients(const AdamConfig& config);
// kInvalidArgument for step < 1, betas outside [0, 1), eps <= 0, negative lr or decay.
absl::Status ValidateAdamConfig(const AdamConfig& config);

// Elements per task of an element-wise kernel over `elements` on a pool of `threads`
// (Note [kernel grain] in kernels.cpp): 2^18 for one thread or a large call, finer for a
// call too small to give each thread several tasks, never under 2^14; a multiple of 2^12.
std::size_t ElementwiseGrain(int threads, std::size_t elements) noexcept;

struct Isa {
  SimdLevel level;
  // Any exponent field all ones: 32-bit (fp32) or 16-bit words with the given mask.
  bool (*any_nonfinite_32)(const std::uint32_t* p, std::size_t n);
  bool (*any_nonfinite_16)(const std::uint16_t* p, std::size_t n, std::uint16_t exponent_mask);
  void (*adam)(const AdamArgs& a, std::size_t begin, std::size_t end);
  void (*convert)(const void* from, DType from_type, void* to, DType to_type, std::size_t begin,
                  std::size_t end);
  double (*sum_squares)(const void* p, DType type, std::size_t begin, std::size_t end);
  // Reads `bytes` and folds them into one word: the memory-read ceiling.
  std::uint64_t (*read_fold)(const std::byte* p, std::size_t bytes);
  // Copies `bytes`: the copy ceiling.
  void (*copy)(std::byte* to, const std::byte* from, std::size_t bytes);
};

// The widest table this CPU supports, at most `cap` (and MEMASCEND_MAX_SIMD).
const Isa& PickIsa(SimdLevel cap);

const Isa& ScalarIsa();
const Isa& Avx2Isa();
const Isa& Avx512Isa();

// Scalar element code for the vector units' tails (defined in scalar.cpp).
void ScalarAdam(const AdamArgs& a, std::size_t begin, std::size_t end);
void ScalarConvert(const void* from, DType from_type, void* to, DType to_type, std::size_t begin,
                   std::size_t end);
double ScalarSumSquares(const void* p, DType type, std::size_t begin, std::size_t end);

}  // namespace memascend::kernels

#endif  // MEMASCEND_SRC_KERNELS_ISA_H_
