#include "blas.h"

#include <cstdlib>

#ifdef MEMASCEND_TRAIN_HAVE_BLAS
#include <cblas.h>
#endif

namespace offload_train::blas {

#ifdef MEMASCEND_TRAIN_HAVE_BLAS
bool Available() noexcept { return true; }

void SetThreads(int n) noexcept { openblas_set_num_threads(n); }

void Gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, const float* a,
          std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
          std::size_t ldc) noexcept {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}
#else
bool Available() noexcept { return false; }

void SetThreads(int) noexcept {}

void Gemm(bool, bool, std::size_t, std::size_t, std::size_t, const float*, std::size_t,
          const float*, std::size_t, float, float*, std::size_t) noexcept {
  std::abort();  // callers check Available() first (ops.h never asks without it)
}
#endif

}  // namespace offload_train::blas
