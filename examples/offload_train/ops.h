// The transformer's layers, forward and backward, on the CPU. Templates over the
// scalar type: the trainer runs them in float, the gradient checks in double.
//
// Determinism: every parallel loop hands each thread outputs of its own (rows, heads or
// output features) and every reduction runs in a fixed order, so the results do not
// depend on the number of threads or their timing. The offloaded and reference modes
// rely on this to agree bit for bit.
//
// The matrix products take `blas`: in float, through blas.h's sgemm (fast; the same bits
// only at the same thread count, blas.h), else the exact loops here.
//
// Layouts are row-major: activations [rows, features], weights [out, in] (as PyTorch's
// nn.Linear), attention's qkv [rows, 3C] with q, k, v side by side and heads inside each.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPS_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <memascend/kernels.h>

#include "blas.h"

namespace offload_train::ops {

// Runs fn(begin, end) over [0, n) in fixed chunks, on `threads` when given.
template <typename F>
void ParallelRange(memascend::KernelThreads* threads, std::size_t n, std::size_t grain, F&& fn) {
  if (n == 0) return;
  grain = std::max<std::size_t>(grain, 1);
  const std::size_t chunks = (n + grain - 1) / grain;
  if (threads == nullptr || chunks == 1) {
    fn(std::size_t{0}, n);
    return;
  }
  threads->ParallelFor(chunks, [&](std::size_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

// A dot product in eight fixed lanes (vectorisable without reassociating).
template <typename T>
inline T Dot(const T* a, const T* b, std::size_t n) {
  T lane[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) lane[k] += a[i + k] * b[i + k];
  }
  T sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[r] = wte[tokens[r]] + wpe[r % seq], rows = batch * seq, the embeddings read a row at
// a time from their flat [wte; wpe] (`rows_of(i, i + 1)`: row i, valid until its next
// call; vocab rows of wte, then wpe's): each token's row copied, then its position's added.
template <typename T, typename RowsOf>
void EmbeddingForward(T* out, const std::int32_t* tokens, const RowsOf& rows_of, std::size_t rows,
                      std::size_t seq, std::size_t vocab, std::size_t channels) {
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t t = static_cast<std::size_t>(tokens[r]);
    const T* te = rows_of(t, t + 1);
    std::copy(te, te + channels, out + r * channels);
  }
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t p = vocab + r % seq;
    const T* pe = rows_of(p, p + 1);
    for (std::size_t c = 0; c < channels; ++c) out[r * channels + c] += pe[c];
  }
}

// The embeddings' gradient (EmbeddingForward's) for elements [begin, end) of their flat
// [wte; wpe] (vocab rows of wte, then seq rows of wpe), added into out[0, end - begin).
// Each element sums over the rows in order, so range by range gives the bits of one
// whole.
template <typename T>
void EmbeddingGradientRange(T* out, const T* dout, const std::int32_t* tokens, std::size_t rows,
                            std::size_t seq, std::size_t vocab, std::size_t channels,
                            std::size_t begin, std::size_t end) {
  auto add = [&](std::size_t at, const T* src) {  // one row of `channels` at flat index `at`
    const std::size_t lo = std::max(begin, at), hi = std::min(end, at + channels);
    for (std::size_t k = lo; k < hi; ++k) out[k - begin] += src[k - at];
  };
  for (std::size_t r = 0; r < rows; ++r) {
    add(static_cast<std::size_t>(tokens[r]) * channels, dout + r * channels);
    add((vocab + r % seq) * channels, dout + r * channels);
  }
}

constexpr double kLayerNormEps = 1e-5;

template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* in, const T* w, const T* b,
                      std::size_t rows, std::size_t channels, memascend::KernelThreads* threads) {
  ParallelRange(threads, rows, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* x = in + r * channels;
      T m = 0;
      for (std::size_t c = 0; c < channels; ++c) m += x[c];
      m /= static_cast<T>(channels);
      T var = 0;
      for (std::size_t c = 0; c < channels; ++c) var += (x[c] - m) * (x[c] - m);
      var /= static_cast<T>(channels);
      const T s = T(1) / std::sqrt(var + static_cast<T>(kLayerNormEps));
      for (std::size_t c = 0; c < channels; ++c)
        out[r * channels + c] = (x[c] - m) * s * w[c] + b[c];
      mean[r] = m;
      rstd[r] = s;
    }
  });
}

// din += ..., dw += ..., db += ... (dw, db reduced over rows in row order).
template <typename T>
void LayerNormBackward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, const T* mean,
                       const T* rstd, std::size_t rows, std::size_t channels,
                       memascend::KernelThreads* threads) {
  ParallelRange(threads, rows, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* dy = dout + r * channels;
      const T* x = in + r * channels;
      T mean_dn = 0, mean_dn_xhat = 0;
      for (std::size_t c = 0; c < channels; ++c) {
        const T xhat = (x[c] - mean[r]) * rstd[r];
        const T dn = w[c] * dy[c];
        mean_dn += dn;
        mean_dn_xhat += dn * xhat;
      }
      mean_dn /= static_cast<T>(channels);
      mean_dn_xhat /= static_cast<T>(channels);
      for (std::size_t c = 0; c < channels; ++c) {
        const T xhat = (x[c] - mean[r]) * rstd[r];
        din[r * channels + c] += (w[c] * dy[c] - mean_dn - xhat * mean_dn_xhat) * rstd[r];
      }
    }
  });
  ParallelRange(threads, channels, 32, [&](std::size_t c0, std::size_t c1) {
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = c0; c < c1; ++c) {
        const T xhat = (in[r * channels + c] - mean[r]) * rstd[r];
        dw[c] += xhat * dout[r * channels + c];
        db[c] += dout[r * channels + c];
      }
    }
  });
}

// out[rows, o] = in[rows, i] . w[o, i] + b[o] (b may be null); out's rows `ld_out` apart
// (0: out_f), so that a product can fill a range of another's columns.
template <typename T>
constexpr bool kBlasType = std::is_same_v<T, float>;

template <typename T>
void MatmulForward(T* out, const T* in, const T* w, const T* b, std::size_t rows, std::size_t in_f,
                   std::size_t out_f, memascend::KernelThreads* threads, bool use_blas = false,
                   std::size_t ld_out = 0) {
  const std::size_t ld = ld_out != 0 ? ld_out : out_f;
  if constexpr (kBlasType<T>) {
    if (use_blas) {
      blas::Gemm(false, true, rows, out_f, in_f, in, in_f, w, in_f, 0.0f, out, ld);
      if (b == nullptr) return;
      ParallelRange(threads, rows, 8, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r)
          for (std::size_t o = 0; o < out_f; ++o) out[r * ld + o] += b[o];
      });
      return;
    }
  }
  ParallelRange(threads, rows, 8, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* x = in + r * in_f;
      for (std::size_t o = 0; o < out_f; ++o)
        out[r * ld + o] = Dot(x, w + o * in_f, in_f) + (b != nullptr ? b[o] : T(0));
    }
  });
}

// din += dout . w; dout's rows `ld_dout` apart (0: out_f). Without the BLAS each element
// sums over o in order, so products over consecutive ranges of o, made in order, give
// the bits of one over the whole.
template <typename T>
void MatmulBackwardInput(T* din, const T* dout, const T* w, std::size_t rows, std::size_t in_f,
                         std::size_t out_f, memascend::KernelThreads* threads,
                         bool use_blas = false, std::size_t ld_dout = 0) {
  const std::size_t ld = ld_dout != 0 ? ld_dout : out_f;
  if constexpr (kBlasType<T>) {
    if (use_blas) {
      blas::Gemm(false, false, rows, in_f, out_f, dout, ld, w, in_f, 1.0f, din, in_f);
      return;
    }
  }
  ParallelRange(threads, rows, 8, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      T* dx = din + r * in_f;
      for (std::size_t o = 0; o < out_f; ++o) {
        const T d = dout[r * ld + o];
        const T* wo = w + o * in_f;
        for (std::size_t i = 0; i < in_f; ++i) dx[i] += d * wo[i];
      }
    }
  });
}

// The output head's product with a [vocab, in_f] matrix read `chunk` rows at a time
// (`rows_of(begin, end)` gives rows [begin, end), valid until its next call): logits[rows,
// vocab] = in . w^T. Without the BLAS, the bits of one product.
template <typename T, typename RowsOf>
void VocabForward(T* logits, const T* in, const RowsOf& rows_of, std::size_t chunk,
                  std::size_t rows, std::size_t in_f, std::size_t vocab,
                  memascend::KernelThreads* threads, bool use_blas) {
  for (std::size_t v = 0; v < vocab; v += chunk) {
    const std::size_t e = std::min(vocab, v + chunk);
    MatmulForward(logits + v, in, rows_of(v, e), static_cast<const T*>(nullptr), rows, in_f, e - v,
                  threads, use_blas, vocab);
  }
}

// din += dlogits . w, w read as VocabForward reads it, its ranges in order (without the
// BLAS, the bits of one product: MatmulBackwardInput).
template <typename T, typename RowsOf>
void VocabBackwardInput(T* din, const T* dlogits, const RowsOf& rows_of, std::size_t chunk,
                        std::size_t rows, std::size_t in_f, std::size_t vocab,
                        memascend::KernelThreads* threads, bool use_blas) {
  for (std::size_t v = 0; v < vocab; v += chunk) {
    const std::size_t e = std::min(vocab, v + chunk);
    MatmulBackwardInput(din, dlogits + v, rows_of(v, e), rows, in_f, e - v, threads, use_blas,
                        vocab);
  }
}

// dw[k - begin] += (dout^T . in) at flat index k of [out_f, in_f], for k in [begin, end): a
// range of the weight's gradient, which need not start or end on a row. Each element
// sums over the rows in order, as MatmulBackward does, so a gradient made range by range
// has the bits of one made whole (through the BLAS: blas.h's fixed tiles).
template <typename T>
void MatmulWeightGradientRange(T* dw, const T* dout, const T* in, std::size_t rows,
                               std::size_t in_f, std::size_t out_f, std::size_t begin,
                               std::size_t end, memascend::KernelThreads* threads,
                               bool use_blas = false) {
  end = std::min(end, out_f * in_f);
  if (begin >= end) return;
  const std::size_t o_first = begin / in_f, o_last = (end - 1) / in_f;
  if constexpr (kBlasType<T>) {
    if (use_blas) {
      // Tile by tile of whole rows, each made alone and added to the range's part of it,
      // so that an element's bits do not depend on the range.
      constexpr std::size_t kTile = blas::kGradientTileRows;
      std::vector<T> tile(kTile * in_f);
      for (std::size_t t0 = o_first / kTile * kTile; t0 <= o_last; t0 += kTile) {
        const std::size_t t1 = std::min(out_f, t0 + kTile);
        const std::size_t lo = t0 * in_f, hi = t1 * in_f;
        blas::Gemm(true, false, t1 - t0, in_f, rows, dout + t0, out_f, in, in_f, 0.0f, tile.data(),
                   in_f);
        for (std::size_t k = std::max(lo, begin); k < std::min(hi, end); ++k)
          dw[k - begin] += tile[k - lo];
      }
      return;
    }
  }
  ParallelRange(threads, o_last - o_first + 1, 4, [&](std::size_t j0, std::size_t j1) {
    for (std::size_t o = o_first + j0; o < o_first + j1; ++o) {
      const std::size_t i0 = std::max(begin, o * in_f) - o * in_f;
      const std::size_t i1 = std::min(end, (o + 1) * in_f) - o * in_f;
      T* dwo = dw + (o * in_f + i0 - begin);
      for (std::size_t r = 0; r < rows; ++r) {
        const T d = dout[r * out_f + o];
        const T* x = in + r * in_f + i0;
        for (std::size_t i = 0; i < i1 - i0; ++i) dwo[i] += d * x[i];
      }
    }
  });
}

// din += dout . w; dw += dout^T . in; db += column sums of dout (db may be null).
template <typename T>
void MatmulBackward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, std::size_t rows,
                    std::size_t in_f, std::size_t out_f, memascend::KernelThreads* threads,
                    bool use_blas = false) {
  MatmulBackwardInput(din, dout, w, rows, in_f, out_f, threads, use_blas);
  MatmulWeightGradientRange(dw, dout, in, rows, in_f, out_f, 0, out_f * in_f, threads, use_blas);
  if (db == nullptr) return;
  ParallelRange(threads, out_f, 64, [&](std::size_t o0, std::size_t o1) {
    for (std::size_t o = o0; o < o1; ++o) {
      T bsum = 0;
      for (std::size_t r = 0; r < rows; ++r) bsum += dout[r * out_f + o];
      db[o] += bsum;
    }
  });
}

// Causal multi-head attention. qkv [batch*seq, 3C]; out [batch*seq, C];
// att [batch, heads, seq, seq] keeps the softmax for the backward pass.
template <typename T>
void AttentionForward(T* out, T* att, const T* qkv, std::size_t batch, std::size_t seq,
                      std::size_t channels, std::size_t heads, memascend::KernelThreads* threads) {
  const std::size_t hs = channels / heads;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const std::size_t c3 = 3 * channels;
  ParallelRange(threads, batch * heads, 1, [&](std::size_t p0, std::size_t p1) {
    for (std::size_t p = p0; p < p1; ++p) {
      const std::size_t b = p / heads, h = p % heads;
      for (std::size_t t = 0; t < seq; ++t) {
        const T* q = qkv + (b * seq + t) * c3 + h * hs;
        T* a = att + ((b * heads + h) * seq + t) * seq;
        T maxv = -INFINITY;
        for (std::size_t u = 0; u <= t; ++u) {
          const T* k = qkv + (b * seq + u) * c3 + channels + h * hs;
          a[u] = Dot(q, k, hs) * scale;
          maxv = std::max(maxv, a[u]);
        }
        T sum = 0;
        for (std::size_t u = 0; u <= t; ++u) {
          a[u] = std::exp(a[u] - maxv);
          sum += a[u];
        }
        for (std::size_t u = 0; u <= t; ++u) a[u] /= sum;
        for (std::size_t u = t + 1; u < seq; ++u) a[u] = 0;
        T* o = out + (b * seq + t) * channels + h * hs;
        for (std::size_t i = 0; i < hs; ++i) o[i] = 0;
        for (std::size_t u = 0; u <= t; ++u) {
          const T* v = qkv + (b * seq + u) * c3 + 2 * channels + h * hs;
          for (std::size_t i = 0; i < hs; ++i) o[i] += a[u] * v[i];
        }
      }
    }
  });
}

// dqkv += the gradient of AttentionForward. Each (batch, head) owns its slices of dqkv.
template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* att, std::size_t batch,
                       std::size_t seq, std::size_t channels, std::size_t heads,
                       memascend::KernelThreads* threads) {
  const std::size_t hs = channels / heads;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const std::size_t c3 = 3 * channels;
  ParallelRange(threads, batch * heads, 1, [&](std::size_t p0, std::size_t p1) {
    std::vector<T> datt(seq);
    for (std::size_t p = p0; p < p1; ++p) {
      const std::size_t b = p / heads, h = p % heads;
      for (std::size_t t = 0; t < seq; ++t) {
        const T* a = att + ((b * heads + h) * seq + t) * seq;
        const T* dy = dout + (b * seq + t) * channels + h * hs;
        // through out = att . v
        for (std::size_t u = 0; u <= t; ++u) {
          const T* v = qkv + (b * seq + u) * c3 + 2 * channels + h * hs;
          T* dv = dqkv + (b * seq + u) * c3 + 2 * channels + h * hs;
          datt[u] = Dot(dy, v, hs);
          for (std::size_t i = 0; i < hs; ++i) dv[i] += a[u] * dy[i];
        }
        // through the softmax
        T dot = 0;
        for (std::size_t u = 0; u <= t; ++u) dot += a[u] * datt[u];
        const T* q = qkv + (b * seq + t) * c3 + h * hs;
        T* dq = dqkv + (b * seq + t) * c3 + h * hs;
        for (std::size_t u = 0; u <= t; ++u) {
          const T ds = a[u] * (datt[u] - dot) * scale;
          const T* k = qkv + (b * seq + u) * c3 + channels + h * hs;
          T* dk = dqkv + (b * seq + u) * c3 + channels + h * hs;
          for (std::size_t i = 0; i < hs; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
    }
  });
}

// GELU, tanh approximation (GPT-2's).
template <typename T>
void GeluForward(T* out, const T* in, std::size_t n) {
  const T k = static_cast<T>(0.7978845608028654);  // sqrt(2 / pi)
  for (std::size_t i = 0; i < n; ++i) {
    const T x = in[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
  }
}

template <typename T>
void GeluBackward(T* din, const T* dout, const T* in, std::size_t n) {
  const T k = static_cast<T>(0.7978845608028654);
  for (std::size_t i = 0; i < n; ++i) {
    const T x = in[i];
    const T u = k * (x + T(0.044715) * x * x * x);
    const T th = std::tanh(u);
    const T sech2 = T(1) - th * th;
    const T du = k * (T(1) + T(3) * T(0.044715) * x * x);
    din[i] += dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du);
  }
}

// Softmax cross-entropy over rows of logits: returns the mean loss (in double, summed in
// row order); with dlogits non-null writes (softmax - onehot) * grad_scale / rows. dlogits
// may be logits: each row is read whole before it is written.
template <typename T>
double CrossEntropy(T* dlogits, const T* logits, const std::int32_t* targets, std::size_t rows,
                    std::size_t vocab, T grad_scale, memascend::KernelThreads* threads,
                    T* row_loss /* [rows] scratch */) {
  ParallelRange(threads, rows, 4, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* l = logits + r * vocab;
      T maxv = l[0];
      for (std::size_t v = 1; v < vocab; ++v) maxv = std::max(maxv, l[v]);
      T sum = 0;
      for (std::size_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - maxv);
      const T logz = maxv + std::log(sum);
      const auto y = static_cast<std::size_t>(targets[r]);
      row_loss[r] = logz - l[y];
      if (dlogits != nullptr) {
        const T s = grad_scale / static_cast<T>(rows);
        T* d = dlogits + r * vocab;
        for (std::size_t v = 0; v < vocab; ++v) d[v] = std::exp(l[v] - logz) * s;
        d[y] -= s;
      }
    }
  });
  double total = 0;
  for (std::size_t r = 0; r < rows; ++r) total += static_cast<double>(row_loss[r]);
  return total / static_cast<double>(rows);
}

}  // namespace offload_train::ops

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPS_H_
