// The layers of Llama (Hugging Face's LlamaForCausalLM), forward and backward, on the CPU:
// RMSNorm, rotary position embeddings (rope_theta, and rope_scaling of type "llama3" as
// Llama 3.1/3.2 carry it), causal grouped-query attention and the SwiGLU MLP. Templates
// over the scalar type, like ops.h: the trainer runs them in float, the gradient checks in
// double; every parallel loop gives each thread outputs of its own and every reduction a
// fixed order, so results do not depend on the thread count.
//
// Layouts follow Hugging Face's: activations [rows, features] with rows = batch * seq;
// q [rows, heads * head_dim], k and v [rows, kv_heads * head_dim]; query head h reads key
// and value head h / (heads / kv_heads); the rotation pairs element i of a head with
// element i + head_dim / 2 (rotate_half), not neighbours.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_OPS_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_OPS_H_

#include <cmath>
#include <cstddef>
#include <numbers>
#include <vector>

#include "ops.h"

namespace offload_train::ops {

// ---- RMSNorm: out = x / sqrt(mean(x^2) + eps) * w -------------------------------------------

template <typename T>
void RmsNormForward(T* out, T* rstd, const T* in, const T* w, std::size_t rows,
                    std::size_t channels, double eps, memascend::KernelThreads* threads) {
  ParallelRange(threads, rows, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* x = in + r * channels;
      T ss = 0;
      for (std::size_t c = 0; c < channels; ++c) ss += x[c] * x[c];
      const T s = T(1) / std::sqrt(ss / static_cast<T>(channels) + static_cast<T>(eps));
      for (std::size_t c = 0; c < channels; ++c) out[r * channels + c] = x[c] * s * w[c];
      rstd[r] = s;
    }
  });
}

// din += ..., dw += ... (dw reduced over rows in row order).
template <typename T>
void RmsNormBackward(T* din, T* dw, const T* dout, const T* in, const T* w, const T* rstd,
                     std::size_t rows, std::size_t channels, memascend::KernelThreads* threads) {
  ParallelRange(threads, rows, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* dy = dout + r * channels;
      const T* x = in + r * channels;
      const T s = rstd[r];
      T dot = 0;  // sum_c dy_c w_c x_c
      for (std::size_t c = 0; c < channels; ++c) dot += dy[c] * w[c] * x[c];
      const T k = dot * s * s * s / static_cast<T>(channels);
      for (std::size_t c = 0; c < channels; ++c)
        din[r * channels + c] += dy[c] * w[c] * s - x[c] * k;
    }
  });
  ParallelRange(threads, channels, 32, [&](std::size_t c0, std::size_t c1) {
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = c0; c < c1; ++c)
        dw[c] += dout[r * channels + c] * in[r * channels + c] * rstd[r];
    }
  });
}

// ---- rotary position embeddings -------------------------------------------------------------

struct RopeScaling {
  bool llama3 = false;  // rope_scaling {"rope_type": "llama3", ...}; otherwise none
  double factor = 8;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  double original_max_position_embeddings = 8192;
};

// The inverse frequencies of the head_dim / 2 rotation planes: theta^(-2i / head_dim),
// then Llama 3's rescaling (long wavelengths divided by `factor`, the middle band
// interpolated), as transformers computes them in fp32.
inline std::vector<float> RopeInverseFrequencies(std::size_t head_dim, double theta,
                                                 const RopeScaling& s) {
  std::vector<float> inv(head_dim / 2);
  for (std::size_t i = 0; i < inv.size(); ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), e);
  }
  if (!s.llama3) return inv;
  const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  for (float& f : inv) {
    const double wavelen = 2 * std::numbers::pi / static_cast<double>(f);
    if (wavelen > low_wavelen) {
      f = static_cast<float>(static_cast<double>(f) / s.factor);
    } else if (wavelen >= high_wavelen) {
      const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f = static_cast<float>((1 - smooth) * static_cast<double>(f) / s.factor +
                             smooth * static_cast<double>(f));
    }
  }
  return inv;
}

// cos and sin [seq, head_dim / 2] of position x inverse frequency (the product in fp32).
template <typename T>
void RopeTables(std::vector<T>* cos, std::vector<T>* sin, const std::vector<float>& inv,
                std::size_t seq) {
  const std::size_t half = inv.size();
  cos->resize(seq * half);
  sin->resize(seq * half);
  for (std::size_t t = 0; t < seq; ++t) {
    for (std::size_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * inv[i];
      (*cos)[t * half + i] = static_cast<T>(std::cos(static_cast<double>(angle)));
      (*sin)[t * half + i] = static_cast<T>(std::sin(static_cast<double>(angle)));
    }
  }
}

// Rotates every head of x [rows, heads * head_dim] in place by its row's position
// (row % seq); `inverse` applies the transposed rotation (the backward pass).
template <typename T>
void RopeApply(T* x, const T* cos, const T* sin, std::size_t rows, std::size_t seq,
               std::size_t heads, std::size_t head_dim, bool inverse,
               memascend::KernelThreads* threads) {
  const std::size_t half = head_dim / 2;
  ParallelRange(threads, rows, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* c = cos + (r % seq) * half;
      const T* s = sin + (r % seq) * half;
      for (std::size_t h = 0; h < heads; ++h) {
        T* v = x + r * heads * head_dim + h * head_dim;
        for (std::size_t i = 0; i < half; ++i) {
          const T a = v[i], b = v[i + half];
          const T sn = inverse ? -s[i] : s[i];
          v[i] = a * c[i] - b * sn;
          v[i + half] = b * c[i] + a * sn;
        }
      }
    }
  });
}

// ---- causal grouped-query attention -------------------------------------------------------

struct AttentionShape {
  std::size_t batch, seq, heads, kv_heads, head_dim;
};

// out [rows, heads * head_dim]; att [batch, heads, seq, seq] keeps the softmax.
template <typename T>
void GqaForward(T* out, T* att, const T* q, const T* k, const T* v, const AttentionShape& a,
                memascend::KernelThreads* threads) {
  const std::size_t hd = a.head_dim, qw = a.heads * hd, kw = a.kv_heads * hd;
  const std::size_t group = a.heads / a.kv_heads;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  ParallelRange(threads, a.batch * a.heads, 1, [&](std::size_t p0, std::size_t p1) {
    for (std::size_t p = p0; p < p1; ++p) {
      const std::size_t b = p / a.heads, h = p % a.heads, g = h / group;
      for (std::size_t t = 0; t < a.seq; ++t) {
        const T* qt = q + (b * a.seq + t) * qw + h * hd;
        T* w = att + ((b * a.heads + h) * a.seq + t) * a.seq;
        T maxv = -INFINITY;
        for (std::size_t u = 0; u <= t; ++u) {
          w[u] = Dot(qt, k + (b * a.seq + u) * kw + g * hd, hd) * scale;
          maxv = std::max(maxv, w[u]);
        }
        T sum = 0;
        for (std::size_t u = 0; u <= t; ++u) {
          w[u] = std::exp(w[u] - maxv);
          sum += w[u];
        }
        for (std::size_t u = 0; u <= t; ++u) w[u] /= sum;
        for (std::size_t u = t + 1; u < a.seq; ++u) w[u] = 0;
        T* o = out + (b * a.seq + t) * qw + h * hd;
        for (std::size_t i = 0; i < hd; ++i) o[i] = 0;
        for (std::size_t u = 0; u <= t; ++u) {
          const T* vu = v + (b * a.seq + u) * kw + g * hd;
          for (std::size_t i = 0; i < hd; ++i) o[i] += w[u] * vu[i];
        }
      }
    }
  });
}

// dq, dk, dv += the gradient of GqaForward. Each (batch, kv head) owns its slices of dk
// and dv and the dq of its query heads, visited in order.
template <typename T>
void GqaBackward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                 const T* att, const AttentionShape& a, memascend::KernelThreads* threads) {
  const std::size_t hd = a.head_dim, qw = a.heads * hd, kw = a.kv_heads * hd;
  const std::size_t group = a.heads / a.kv_heads;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  ParallelRange(threads, a.batch * a.kv_heads, 1, [&](std::size_t p0, std::size_t p1) {
    std::vector<T> datt(a.seq);
    for (std::size_t p = p0; p < p1; ++p) {
      const std::size_t b = p / a.kv_heads, g = p % a.kv_heads;
      for (std::size_t h = g * group; h < (g + 1) * group; ++h) {
        for (std::size_t t = 0; t < a.seq; ++t) {
          const T* w = att + ((b * a.heads + h) * a.seq + t) * a.seq;
          const T* dy = dout + (b * a.seq + t) * qw + h * hd;
          for (std::size_t u = 0; u <= t; ++u) {
            const T* vu = v + (b * a.seq + u) * kw + g * hd;
            T* dvu = dv + (b * a.seq + u) * kw + g * hd;
            datt[u] = Dot(dy, vu, hd);
            for (std::size_t i = 0; i < hd; ++i) dvu[i] += w[u] * dy[i];
          }
          T dot = 0;
          for (std::size_t u = 0; u <= t; ++u) dot += w[u] * datt[u];
          const T* qt = q + (b * a.seq + t) * qw + h * hd;
          T* dqt = dq + (b * a.seq + t) * qw + h * hd;
          for (std::size_t u = 0; u <= t; ++u) {
            const T ds = w[u] * (datt[u] - dot) * scale;
            const T* ku = k + (b * a.seq + u) * kw + g * hd;
            T* dku = dk + (b * a.seq + u) * kw + g * hd;
            for (std::size_t i = 0; i < hd; ++i) {
              dqt[i] += ds * ku[i];
              dku[i] += ds * qt[i];
            }
          }
        }
      }
    }
  });
}

// ---- SwiGLU: out = silu(gate) * up ----------------------------------------------------------

template <typename T>
void SwigluForward(T* out, const T* gate, const T* up, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const T sig = T(1) / (T(1) + std::exp(-gate[i]));
    out[i] = gate[i] * sig * up[i];
  }
}

// dgate += ..., dup += ...
template <typename T>
void SwigluBackward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const T sig = T(1) / (T(1) + std::exp(-gate[i]));
    const T silu = gate[i] * sig;
    dup[i] += dout[i] * silu;
    dgate[i] += dout[i] * up[i] * sig * (T(1) + gate[i] * (T(1) - sig));
  }
}

}  // namespace offload_train::ops

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_OPS_H_
