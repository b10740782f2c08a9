#include "llama.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "llama_ops.h"
#include "ops.h"
#include "split_mix.h"

namespace offload_train {
namespace {

// Offsets of a decoder layer's slices, in LlamaGroupLayout's order.
struct LayerParams {
  std::size_t ln1, q, k, v, o, ln2, gate, up, down, total;
  explicit LayerParams(const HfConfig& c) {
    const std::size_t ch = c.hidden, qw = c.heads * c.head_dim, kw = c.kv_heads * c.head_dim,
                      in = c.intermediate;
    std::size_t at = 0;
    auto take = [&at](std::size_t n) { return std::exchange(at, at + n); };
    ln1 = take(ch);
    q = take(qw * ch);
    k = take(kw * ch);
    v = take(kw * ch);
    o = take(ch * qw);
    ln2 = take(ch);
    gate = take(in * ch);
    up = take(in * ch);
    down = take(ch * in);
    total = at;
  }
};

}  // namespace

std::size_t LlamaGroupCount(const HfConfig& c) { return c.layers + 2; }

GroupKind LlamaKindOf(const HfConfig& c, std::size_t group) { return KindOfGroup(c.layers, group); }

std::vector<Slice> LlamaGroupLayout(const HfConfig& c, std::size_t group) {
  SliceList out;
  auto add = [&out](const char* name, std::size_t n) { out.Add(name, n); };
  const std::size_t ch = c.hidden, qw = c.heads * c.head_dim, kw = c.kv_heads * c.head_dim;
  switch (LlamaKindOf(c, group)) {
    case GroupKind::kEmbed:
      add("embed_tokens.weight", c.vocab * ch);
      break;
    case GroupKind::kBlock:
      add("input_layernorm.weight", ch);
      add("self_attn.q_proj.weight", qw * ch);
      add("self_attn.k_proj.weight", kw * ch);
      add("self_attn.v_proj.weight", kw * ch);
      add("self_attn.o_proj.weight", ch * qw);
      add("post_attention_layernorm.weight", ch);
      add("mlp.gate_proj.weight", c.intermediate * ch);
      add("mlp.up_proj.weight", c.intermediate * ch);
      add("mlp.down_proj.weight", ch * c.intermediate);
      break;
    case GroupKind::kHead:
      add("norm.weight", ch);
      if (!c.tie_embeddings) add("lm_head.weight", c.vocab * ch);
      break;
  }
  return std::move(out).Take();
}

std::string LlamaTensorName(const HfConfig& c, std::size_t group, const Slice& s) {
  switch (LlamaKindOf(c, group)) {
    case GroupKind::kEmbed:
      return "model." + s.name;
    case GroupKind::kBlock:
      return fmt::format("model.layers.{}.{}", group - 1, s.name);
    case GroupKind::kHead:
      return s.name == "lm_head.weight" ? s.name : "model." + s.name;
  }
  return s.name;
}

std::size_t LlamaGroupParams(const HfConfig& c, std::size_t group) {
  std::size_t n = 0;
  for (const Slice& s : LlamaGroupLayout(c, group)) n += s.count;
  return n;
}

void InitLlamaGroup(const HfConfig& c, std::size_t group, std::uint64_t seed, float* params) {
  InitLlamaGroupRange(c, group, seed, 0, LlamaGroupParams(c, group), params);
}

void InitLlamaGroupRange(const HfConfig& c, std::size_t group, std::uint64_t seed,
                         std::size_t begin, std::size_t end, float* params) {
  SplitMix rng{seed * 0x100000001b3ull + group + 1};
  for (const Slice& s : LlamaGroupLayout(c, group)) {
    const bool gain = s.name.find("norm") != std::string::npos;
    if (s.offset >= end) break;
    const std::size_t last = s.offset + s.count;
    const std::size_t lo = std::max(begin, s.offset), hi = std::min(end, last);
    if (!gain) rng.Skip(2 * (std::min(lo, last) - s.offset));  // the draws before the range
    for (std::size_t k = lo; k < hi; ++k)
      params[k - begin] = gain ? 1.0f : static_cast<float>(rng.Normal() * 0.02);
  }
}

template <typename T>
Llama<T>::Llama(const HfConfig& config, std::size_t batch, std::size_t seq,
                memascend::KernelThreads* threads, bool blas, bool checkpoint)
    : c_(config),
      batch_(batch),
      seq_(seq),
      rows_(batch * seq),
      threads_(threads),
      blas_(blas),
      checkpoint_(checkpoint) {
  const std::size_t ch = c_.hidden, qw = c_.heads * c_.head_dim, kw = c_.kv_heads * c_.head_dim,
                    in = c_.intermediate;
  ops::RopeTables(&cos_, &sin_, ops::RopeInverseFrequencies(c_.head_dim, c_.rope_theta, c_.rope),
                  seq_);
  x_.resize(rows_ * ch);
  acts_.resize(checkpoint_ ? 1 : c_.layers);
  for (BlockActs& a : acts_) {
    a.in.resize(rows_ * ch);
    a.ln1.resize(rows_ * ch);
    a.ln1_rstd.resize(rows_);
    a.q.resize(rows_ * qw);
    a.k.resize(rows_ * kw);
    a.v.resize(rows_ * kw);
    a.att.resize(batch_ * c_.heads * seq_ * seq_);
    a.atty.resize(rows_ * qw);
    a.mid.resize(rows_ * ch);
    a.ln2.resize(rows_ * ch);
    a.ln2_rstd.resize(rows_);
    a.gate.resize(rows_ * in);
    a.up.resize(rows_ * in);
    a.act.resize(rows_ * in);
  }
  normed_.resize(rows_ * ch);
  norm_rstd_.resize(rows_);
  logits_.resize(rows_ * c_.vocab);
  row_loss_.resize(rows_);
  dnorm_w_.resize(ch);
  const std::size_t widest = std::max({in, qw, ch});
  scratch_a_.resize(rows_ * widest);
  scratch_b_.resize(rows_ * widest);
  scratch_c_.resize(rows_ * widest);
  scratch_d_.resize(rows_ * widest);
}

template <typename T>
void Llama<T>::Embed(const MatrixRows<T>& embed, const std::int32_t* tokens) {
  tokens_.assign(tokens, tokens + rows_);
  const std::size_t ch = c_.hidden;
  for (std::size_t r = 0; r < rows_; ++r) {
    const std::size_t t = static_cast<std::size_t>(tokens[r]);
    const T* e = embed.Rows(t, t + 1, ch);
    std::copy(e, e + ch, x_.data() + r * ch);
  }
}

template <typename T>
void Llama<T>::Block(std::size_t layer, const T* params) {
  Forward(layer, params, x_.data(), x_.data());
}

template <typename T>
void Llama<T>::Recompute(std::size_t layer, const T* params, const T* input) {
  // The output is not needed (x_ holds the gradient now): it goes to scratch.
  Forward(layer, params, input, scratch_a_.data());
}

template <typename T>
void Llama<T>::Forward(std::size_t layer, const T* params, const T* input, T* output) {
  const LayerParams p(c_);
  const std::size_t ch = c_.hidden, qw = c_.heads * c_.head_dim, kw = c_.kv_heads * c_.head_dim,
                    in = c_.intermediate;
  const ops::AttentionShape shape{batch_, seq_, c_.heads, c_.kv_heads, c_.head_dim};
  BlockActs& a = Acts(layer);
  const T* none = nullptr;
  a.in.assign(input, input + rows_ * ch);
  ops::RmsNormForward(a.ln1.data(), a.ln1_rstd.data(), a.in.data(), params + p.ln1, rows_, ch,
                      c_.norm_eps, threads_);
  ops::MatmulForward(a.q.data(), a.ln1.data(), params + p.q, none, rows_, ch, qw, threads_, blas_);
  ops::MatmulForward(a.k.data(), a.ln1.data(), params + p.k, none, rows_, ch, kw, threads_, blas_);
  ops::MatmulForward(a.v.data(), a.ln1.data(), params + p.v, none, rows_, ch, kw, threads_, blas_);
  ops::RopeApply(a.q.data(), cos_.data(), sin_.data(), rows_, seq_, c_.heads, c_.head_dim, false,
                 threads_);
  ops::RopeApply(a.k.data(), cos_.data(), sin_.data(), rows_, seq_, c_.kv_heads, c_.head_dim, false,
                 threads_);
  ops::GqaForward(a.atty.data(), a.att.data(), a.q.data(), a.k.data(), a.v.data(), shape, threads_);
  T* o = scratch_a_.data();
  ops::MatmulForward(o, a.atty.data(), params + p.o, none, rows_, qw, ch, threads_, blas_);
  for (std::size_t i = 0; i < rows_ * ch; ++i) a.mid[i] = a.in[i] + o[i];
  ops::RmsNormForward(a.ln2.data(), a.ln2_rstd.data(), a.mid.data(), params + p.ln2, rows_, ch,
                      c_.norm_eps, threads_);
  ops::MatmulForward(a.gate.data(), a.ln2.data(), params + p.gate, none, rows_, ch, in, threads_,
                     blas_);
  ops::MatmulForward(a.up.data(), a.ln2.data(), params + p.up, none, rows_, ch, in, threads_,
                     blas_);
  ops::SwigluForward(a.act.data(), a.gate.data(), a.up.data(), rows_ * in);
  ops::MatmulForward(o, a.act.data(), params + p.down, none, rows_, in, ch, threads_, blas_);
  for (std::size_t i = 0; i < rows_ * ch; ++i) output[i] = a.mid[i] + o[i];
}

template <typename T>
double Llama<T>::Head(const T* head, const MatrixRows<T>& embed, const std::int32_t* targets,
                      T grad_scale, bool backward) {
  const std::size_t ch = c_.hidden;
  const T* norm_w = head;
  const MatrixRows<T> out_w = c_.tie_embeddings ? embed : MatrixRows<T>(head + ch);
  const auto rows_of = [&](std::size_t b, std::size_t e) { return out_w.Rows(b, e, ch); };
  const std::size_t chunk = out_w.Chunk(c_.vocab);
  ops::RmsNormForward(normed_.data(), norm_rstd_.data(), x_.data(), norm_w, rows_, ch, c_.norm_eps,
                      threads_);
  ops::VocabForward(logits_.data(), normed_.data(), rows_of, chunk, rows_, ch, c_.vocab, threads_,
                    blas_);
  const double loss =
      ops::CrossEntropy(backward ? logits_.data() : static_cast<T*>(nullptr), logits_.data(),
                        targets, rows_, c_.vocab, grad_scale, threads_, row_loss_.data());
  if (!backward) return loss;
  T* dnormed = scratch_a_.data();
  std::fill(dnormed, dnormed + rows_ * ch, T(0));
  ops::VocabBackwardInput(dnormed, logits_.data(), rows_of, chunk, rows_, ch, c_.vocab, threads_,
                          blas_);
  std::vector<T> dx(rows_ * ch, T(0));
  std::fill(dnorm_w_.begin(), dnorm_w_.end(), T(0));
  ops::RmsNormBackward(dx.data(), dnorm_w_.data(), dnormed, x_.data(), norm_w, norm_rstd_.data(),
                       rows_, ch, threads_);
  x_ = std::move(dx);
  return loss;
}

template <typename T>
void Llama<T>::HeadGradient(T* out, std::size_t begin, std::size_t end) const {
  const std::size_t norm = dnorm_w_.size();
  std::fill(out, out + (end - begin), T(0));
  for (std::size_t k = begin; k < std::min(end, norm); ++k) out[k - begin] = dnorm_w_[k];
  if (end <= norm || c_.tie_embeddings) return;
  const std::size_t lo = std::max(begin, norm);
  ops::MatmulWeightGradientRange(out + (lo - begin), logits_.data(), normed_.data(), rows_,
                                 c_.hidden, c_.vocab, lo - norm, end - norm, threads_, blas_);
}

template <typename T>
void Llama<T>::BlockBackward(std::size_t layer, const T* params, T* dparams) {
  const LayerParams p(c_);
  const std::size_t ch = c_.hidden, qw = c_.heads * c_.head_dim, kw = c_.kv_heads * c_.head_dim,
                    in = c_.intermediate;
  const ops::AttentionShape shape{batch_, seq_, c_.heads, c_.kv_heads, c_.head_dim};
  BlockActs& a = Acts(layer);
  T* none = nullptr;
  // x_ is d(out); out = mid + down(swiglu(gate(ln2), up(ln2))); mid = in + o(attn(ln1(in))).
  std::vector<T> dmid = x_;
  T* dact = scratch_a_.data();
  std::fill(dact, dact + rows_ * in, T(0));
  ops::MatmulBackward(dact, dparams + p.down, none, x_.data(), a.act.data(), params + p.down, rows_,
                      in, ch, threads_, blas_);
  T* dgate = scratch_b_.data();
  T* dup = scratch_c_.data();
  std::fill(dgate, dgate + rows_ * in, T(0));
  std::fill(dup, dup + rows_ * in, T(0));
  ops::SwigluBackward(dgate, dup, dact, a.gate.data(), a.up.data(), rows_ * in);
  T* dln2 = scratch_d_.data();
  std::fill(dln2, dln2 + rows_ * ch, T(0));
  ops::MatmulBackward(dln2, dparams + p.gate, none, dgate, a.ln2.data(), params + p.gate, rows_, ch,
                      in, threads_, blas_);
  ops::MatmulBackward(dln2, dparams + p.up, none, dup, a.ln2.data(), params + p.up, rows_, ch, in,
                      threads_, blas_);
  ops::RmsNormBackward(dmid.data(), dparams + p.ln2, dln2, a.mid.data(), params + p.ln2,
                       a.ln2_rstd.data(), rows_, ch, threads_);
  // attention
  x_ = dmid;  // d(in) starts as the residual's share
  T* datty = scratch_a_.data();
  std::fill(datty, datty + rows_ * qw, T(0));
  ops::MatmulBackward(datty, dparams + p.o, none, dmid.data(), a.atty.data(), params + p.o, rows_,
                      qw, ch, threads_, blas_);
  T* dq = scratch_b_.data();
  T* dk = scratch_c_.data();
  T* dv = scratch_d_.data();
  std::fill(dq, dq + rows_ * qw, T(0));
  std::fill(dk, dk + rows_ * kw, T(0));
  std::fill(dv, dv + rows_ * kw, T(0));
  ops::GqaBackward(dq, dk, dv, datty, a.q.data(), a.k.data(), a.v.data(), a.att.data(), shape,
                   threads_);
  // Through the rotation (stored q and k are rotated; their projections' outputs were not).
  ops::RopeApply(dq, cos_.data(), sin_.data(), rows_, seq_, c_.heads, c_.head_dim, true, threads_);
  ops::RopeApply(dk, cos_.data(), sin_.data(), rows_, seq_, c_.kv_heads, c_.head_dim, true,
                 threads_);
  T* dln1 = scratch_a_.data();
  std::fill(dln1, dln1 + rows_ * ch, T(0));
  ops::MatmulBackward(dln1, dparams + p.q, none, dq, a.ln1.data(), params + p.q, rows_, ch, qw,
                      threads_, blas_);
  ops::MatmulBackward(dln1, dparams + p.k, none, dk, a.ln1.data(), params + p.k, rows_, ch, kw,
                      threads_, blas_);
  ops::MatmulBackward(dln1, dparams + p.v, none, dv, a.ln1.data(), params + p.v, rows_, ch, kw,
                      threads_, blas_);
  ops::RmsNormBackward(x_.data(), dparams + p.ln1, dln1, a.in.data(), params + p.ln1,
                       a.ln1_rstd.data(), rows_, ch, threads_);
}

template <typename T>
void Llama<T>::EmbedGradient(T* out, std::size_t begin, std::size_t end) const {
  std::fill(out, out + (end - begin), T(0));
  const std::size_t ch = c_.hidden;
  // The tied head's share first (dlogits^T . normed), then the rows the tokens selected,
  // each in a fixed order, so range by range gives the bits of the whole.
  if (c_.tie_embeddings) {
    ops::MatmulWeightGradientRange(out, logits_.data(), normed_.data(), rows_, ch, c_.vocab, begin,
                                   end, threads_, blas_);
  }
  for (std::size_t r = 0; r < rows_; ++r) {
    const std::size_t at = static_cast<std::size_t>(tokens_[r]) * ch;
    const std::size_t lo = std::max(begin, at), hi = std::min(end, at + ch);
    for (std::size_t k = lo; k < hi; ++k) out[k - begin] += x_[r * ch + (k - at)];
  }
}

template <typename T>
std::size_t Llama<T>::ActivationBytes() const {
  std::size_t n = x_.size() + normed_.size() + norm_rstd_.size() + logits_.size() +
                  row_loss_.size() + dnorm_w_.size() + scratch_a_.size() + scratch_b_.size() +
                  scratch_c_.size() + scratch_d_.size() + cos_.size() + sin_.size();
  for (const BlockActs& a : acts_) {
    for (const std::vector<T>* v : {&a.in, &a.ln1, &a.ln1_rstd, &a.q, &a.k, &a.v, &a.att, &a.atty,
                                    &a.mid, &a.ln2, &a.ln2_rstd, &a.gate, &a.up, &a.act})
      n += v->size();
  }
  return n * sizeof(T) + tokens_.capacity() * sizeof(std::int32_t);
}

template <typename T>
const T* Llama<T>::Logits(std::size_t b, std::size_t t) const {
  return logits_.data() + (b * seq_ + t) * c_.vocab;
}

template class Llama<float>;
template class Llama<double>;

}  // namespace offload_train
