// The matrix products of ops.h through a BLAS (Debian's OpenBLAS), where the build found
// one (MEMASCEND_TRAIN_HAVE_BLAS); Available() says. Row-major single precision only: the
// gradient checks run the exact path in double.
//
// Determinism: OpenBLAS's sgemm gives the same bits for the same call (shape, strides,
// thread count), but not across thread counts or across splits of a product into smaller
// ones. So a weight gradient made range by range (ops::MatmulWeightGradientRange) is
// computed in fixed tiles of kGradientTileRows output rows whatever the range, and two
// runs agree bit for bit when they use the same number of threads.
//
// Thread-safety: SetThreads() is process-wide (OpenBLAS's pool); call it before the
// products, from the thread that runs them.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BLAS_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BLAS_H_

#include <cstddef>

namespace offload_train::blas {

bool Available() noexcept;
// OpenBLAS's threads (a no-op without it).
void SetThreads(int n) noexcept;

// c[m, n] = a'[m, k] . b'[k, n] + beta * c, with a' = a or a^T (a is [k, m] then), b' = b
// or b^T (b is [n, k] then); ld* are the row strides as stored.
void Gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, const float* a,
          std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
          std::size_t ldc) noexcept;

// Output rows of a weight gradient computed by one product (see above).
constexpr std::size_t kGradientTileRows = 64;

}  // namespace offload_train::blas

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_BLAS_H_
