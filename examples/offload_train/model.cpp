#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unistd.h>

#include <fmt/format.h>

#include "llama.h"
#include "ops.h"
#include "split_mix.h"

namespace offload_train {
namespace {

// Offsets of a block's slices, in GroupLayout's order.
struct BlockParams {
  std::size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcp_w, fcp_b,
      total;
  explicit BlockParams(std::size_t c) {
    std::size_t o = 0;
    auto take = [&o](std::size_t n) { return std::exchange(o, o + n); };
    ln1_w = take(c);
    ln1_b = take(c);
    qkv_w = take(3 * c * c);
    qkv_b = take(3 * c);
    proj_w = take(c * c);
    proj_b = take(c);
    ln2_w = take(c);
    ln2_b = take(c);
    fc_w = take(4 * c * c);
    fc_b = take(4 * c);
    fcp_w = take(4 * c * c);
    fcp_b = take(c);
    total = o;
  }
};

}  // namespace

ModelConfig ForHf(const HfConfig& hf, std::size_t batch, std::size_t seq) {
  ModelConfig c;
  c.vocab = hf.vocab;
  c.channels = hf.hidden;
  c.layers = hf.layers;
  c.heads = hf.heads;
  c.batch = batch;
  c.seq = seq;
  c.hf = hf;
  return c;
}

bool TiedHead(const ModelConfig& c) { return c.hf.has_value() && c.hf->tie_embeddings; }

std::string ArchName(const ModelConfig& c) {
  return c.hf.has_value() ? std::string(ToString(c.hf->arch)) : "GPT";
}

absl::Status Validate(const ModelConfig& c) {
  if (c.hf.has_value()) {
    const HfConfig& h = *c.hf;
    if (h.arch == Arch::kGpt2) {
      // GPT-2 runs on the demo's kernels: learned positions, a 4x MLP, layer norms of eps
      // 1e-5, as many key/value heads as heads.
      if (c.seq > h.max_positions) {
        return absl::InvalidArgumentError(
            fmt::format("--seq {} is longer than the model's {} learned positions (n_positions)",
                        c.seq, h.max_positions));
      }
      if (h.intermediate != 4 * h.hidden || h.kv_heads != h.heads ||
          h.head_dim * h.heads != h.hidden || h.norm_eps != ops::kLayerNormEps) {
        return absl::UnimplementedError(fmt::format(
            "model_type 'gpt2' with n_inner {} (the trainer's MLP is 4 x n_embd = {}) or "
            "layer_norm_epsilon {} (the trainer's is 1e-5): not supported",
            h.intermediate, 4 * h.hidden, h.norm_eps));
      }
    }
    if (c.vocab != h.vocab || c.channels != h.hidden || c.layers != h.layers ||
        c.heads != h.heads) {
      return absl::InternalError("a Hugging Face model's sizes differ from its config's");
    }
  }
  if (c.vocab < 2 || c.seq < 1 || c.channels < 1 || c.layers < 1 || c.heads < 1 || c.batch < 1)
    return absl::InvalidArgumentError("model sizes must be positive (vocab at least 2)");
  if (!c.hf.has_value() && c.channels % c.heads != 0) {
    return absl::InvalidArgumentError(
        fmt::format("channels ({}) must be a multiple of heads ({})", c.channels, c.heads));
  }
  if (c.vocab > (1u << 30)) return absl::InvalidArgumentError("vocab too large");
  constexpr std::size_t kMax = std::size_t{1} << 24;
  if (c.seq > kMax || c.channels > kMax || c.layers > kMax || c.heads > kMax || c.batch > kMax) {
    return absl::InvalidArgumentError(
        fmt::format("model sizes above {} (seq {}, channels {}, layers {}, heads {}, batch {})",
                    kMax, c.seq, c.channels, c.layers, c.heads, c.batch));
  }
  // The parameters and one batch's activations (about, in fp32) must fit in this
  // machine's memory, or the first allocation would fail.
  // (Only the largest group and a block's gradient are whole in memory: Note [gradient
  // parts] in step.cpp.)
  double params = 0;
  for (std::size_t g = 0; g < GroupCount(c); ++g)
    params = std::max(params, static_cast<double>(GroupParams(c, g)));
  params *= 2;
  // A block's activations: 16 widths of the residual stream (GPT's MLP is 4 wide; Llama's
  // intermediate size may be wider) and the attention matrix.
  const double width = c.hf.has_value() ? 6.0 * static_cast<double>(c.channels) +
                                              4.0 * static_cast<double>(c.hf->intermediate)
                                        : 16.0 * static_cast<double>(c.channels);
  const double rows = static_cast<double>(c.batch) * static_cast<double>(c.seq);
  const double acts =
      4.0 * rows *
      (2.0 * static_cast<double>(c.vocab) +
       static_cast<double>(c.layers) * (width + static_cast<double>(c.heads * c.seq)));
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (memory > 0 && acts + 4.0 * params > memory) {
    return absl::ResourceExhaustedError(fmt::format(
        "the model's largest layer ({:.0f} M parameters) and one batch's activations need about "
        "{:.1f} GiB of memory, more than this machine's {:.1f} GiB: a smaller --batch, --seq or "
        "model",
        params / 2e6, (acts + 4.0 * params) / (1u << 30), memory / (1u << 30)));
  }
  return absl::OkStatus();
}

std::size_t GroupCount(const ModelConfig& c) { return c.layers + 2; }

GroupKind KindOfGroup(std::size_t layers, std::size_t group) {
  if (group == 0) return GroupKind::kEmbed;
  return group <= layers ? GroupKind::kBlock : GroupKind::kHead;
}

GroupKind KindOf(const ModelConfig& c, std::size_t group) { return KindOfGroup(c.layers, group); }

std::string GroupName(const ModelConfig& c, std::size_t group) {
  switch (KindOf(c, group)) {
    case GroupKind::kEmbed:
      return "embed";
    case GroupKind::kBlock:
      return fmt::format("block.{}", group - 1);
    case GroupKind::kHead:
      return "head";
  }
  return "?";
}

bool IsLlama(const ModelConfig& c) { return c.hf.has_value() && c.hf->arch == Arch::kLlama; }

std::vector<Slice> GroupLayout(const ModelConfig& c, std::size_t group) {
  if (IsLlama(c)) return LlamaGroupLayout(*c.hf, group);
  // GPT-2's learned positions: as many as the model has (a Hugging Face GPT-2), or the
  // demo's sequence length.
  const std::size_t positions = c.hf.has_value() ? c.hf->max_positions : c.seq;
  SliceList out;
  auto add = [&out](const char* name, std::size_t n) { out.Add(name, n); };
  const std::size_t ch = c.channels;
  switch (KindOf(c, group)) {
    case GroupKind::kEmbed:
      add("wte", c.vocab * ch);
      add("wpe", positions * ch);
      break;
    case GroupKind::kBlock:
      add("ln1.w", ch);
      add("ln1.b", ch);
      add("attn.qkv.w", 3 * ch * ch);
      add("attn.qkv.b", 3 * ch);
      add("attn.proj.w", ch * ch);
      add("attn.proj.b", ch);
      add("ln2.w", ch);
      add("ln2.b", ch);
      add("mlp.fc.w", 4 * ch * ch);
      add("mlp.fc.b", 4 * ch);
      add("mlp.proj.w", 4 * ch * ch);
      add("mlp.proj.b", ch);
      break;
    case GroupKind::kHead:
      add("lnf.w", ch);
      add("lnf.b", ch);
      if (!TiedHead(c)) add("lm_head.w", c.vocab * ch);
      break;
  }
  return std::move(out).Take();
}

std::size_t GroupParams(const ModelConfig& c, std::size_t group) {
  std::size_t n = 0;
  for (const Slice& s : GroupLayout(c, group)) n += s.count;
  return n;
}

std::size_t TotalParams(const ModelConfig& c) {
  std::size_t n = 0;
  for (std::size_t g = 0; g < GroupCount(c); ++g) n += GroupParams(c, g);
  return n;
}

void InitGroup(const ModelConfig& c, std::size_t group, std::uint64_t seed, float* params) {
  InitGroupRange(c, group, seed, 0, GroupParams(c, group), params);
}

void InitGroupRange(const ModelConfig& c, std::size_t group, std::uint64_t seed, std::size_t begin,
                    std::size_t end, float* params) {
  if (IsLlama(c)) return InitLlamaGroupRange(*c.hf, group, seed, begin, end, params);
  SplitMix rng{seed * 0x100000001b3ull + group + 1};
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
  for (const Slice& s : GroupLayout(c, group)) {
    if (s.offset >= end) break;
    const std::string& n = s.name;
    const bool gain = n == "ln1.w" || n == "ln2.w" || n == "lnf.w";
    const bool bias = n.size() > 2 && n.compare(n.size() - 2, 2, ".b") == 0;
    const double std_dev = (n == "attn.proj.w" || n == "mlp.proj.w") ? residual_std : 0.02;
    const std::size_t last = s.offset + s.count;
    const std::size_t lo = std::max(begin, s.offset), hi = std::min(end, last);
    if (!gain && !bias) rng.Skip(2 * (std::min(lo, last) - s.offset));  // the draws before
    for (std::size_t k = lo; k < hi; ++k) {
      params[k - begin] = gain ? 1.0f : bias ? 0.0f : static_cast<float>(rng.Normal() * std_dev);
    }
  }
}

template <typename T>
Gpt<T>::Gpt(const ModelConfig& config, memascend::KernelThreads* threads, bool blas,
            bool checkpoint)
    : c_(config),
      threads_(threads),
      blas_(blas),
      checkpoint_(checkpoint),
      rows_(config.batch * config.seq) {
  const std::size_t ch = c_.channels;
  x_.resize(rows_ * ch);
  acts_.resize(checkpoint_ ? 1 : c_.layers);
  for (BlockActs& a : acts_) {
    a.in.resize(rows_ * ch);
    a.ln1.resize(rows_ * ch);
    a.ln1_mean.resize(rows_);
    a.ln1_rstd.resize(rows_);
    a.qkv.resize(rows_ * 3 * ch);
    a.att.resize(c_.batch * c_.heads * c_.seq * c_.seq);
    a.atty.resize(rows_ * ch);
    a.mid.resize(rows_ * ch);
    a.ln2.resize(rows_ * ch);
    a.ln2_mean.resize(rows_);
    a.ln2_rstd.resize(rows_);
    a.fc.resize(rows_ * 4 * ch);
    a.gelu.resize(rows_ * 4 * ch);
  }
  lnf_.resize(rows_ * ch);
  lnf_mean_.resize(rows_);
  lnf_rstd_.resize(rows_);
  logits_.resize(rows_ * c_.vocab);
  dlnf_wb_.resize(2 * ch);
  row_loss_.resize(rows_);
  scratch_a_.resize(rows_ * 4 * ch);
  scratch_b_.resize(rows_ * 4 * ch);
  scratch_c_.resize(rows_ * ch);
}

template <typename T>
void Gpt<T>::Embed(const MatrixRows<T>& params, const std::int32_t* tokens) {
  tokens_.assign(tokens, tokens + rows_);
  const std::size_t ch = c_.channels;
  ops::EmbeddingForward<T>(
      x_.data(), tokens, [&](std::size_t b, std::size_t e) { return params.Rows(b, e, ch); }, rows_,
      c_.seq, c_.vocab, ch);
}

template <typename T>
void Gpt<T>::Block(std::size_t layer, const T* params) {
  Forward(layer, params, x_.data(), x_.data());
}

template <typename T>
void Gpt<T>::Recompute(std::size_t layer, const T* params, const T* input) {
  // The output is not needed (x_ holds the gradient now): it goes to scratch.
  Forward(layer, params, input, scratch_c_.data());
}

template <typename T>
void Gpt<T>::Forward(std::size_t layer, const T* params, const T* input, T* output) {
  const BlockParams p(c_.channels);
  const std::size_t ch = c_.channels;
  BlockActs& a = Acts(layer);
  a.in.assign(input, input + rows_ * ch);
  ops::LayerNormForward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), a.in.data(),
                        params + p.ln1_w, params + p.ln1_b, rows_, ch, threads_);
  ops::MatmulForward(a.qkv.data(), a.ln1.data(), params + p.qkv_w, params + p.qkv_b, rows_, ch,
                     3 * ch, threads_, blas_);
  ops::AttentionForward(a.atty.data(), a.att.data(), a.qkv.data(), c_.batch, c_.seq, ch, c_.heads,
                        threads_);
  ops::MatmulForward(scratch_c_.data(), a.atty.data(), params + p.proj_w, params + p.proj_b, rows_,
                     ch, ch, threads_, blas_);
  for (std::size_t i = 0; i < rows_ * ch; ++i) a.mid[i] = a.in[i] + scratch_c_[i];
  ops::LayerNormForward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.mid.data(),
                        params + p.ln2_w, params + p.ln2_b, rows_, ch, threads_);
  ops::MatmulForward(a.fc.data(), a.ln2.data(), params + p.fc_w, params + p.fc_b, rows_, ch, 4 * ch,
                     threads_, blas_);
  ops::GeluForward(a.gelu.data(), a.fc.data(), rows_ * 4 * ch);
  ops::MatmulForward(scratch_c_.data(), a.gelu.data(), params + p.fcp_w, params + p.fcp_b, rows_,
                     4 * ch, ch, threads_, blas_);
  for (std::size_t i = 0; i < rows_ * ch; ++i) output[i] = a.mid[i] + scratch_c_[i];
}

template <typename T>
double Gpt<T>::Head(const T* params, const MatrixRows<T>& embed, const std::int32_t* targets,
                    T grad_scale, bool backward) {
  const std::size_t ch = c_.channels;
  const T* lnf_w = params;
  const T* lnf_b = params + ch;
  const MatrixRows<T> lm = TiedHead(c_) ? embed : MatrixRows<T>(params + 2 * ch);
  const auto rows_of = [&](std::size_t b, std::size_t e) { return lm.Rows(b, e, ch); };
  const std::size_t chunk = lm.Chunk(c_.vocab);
  ops::LayerNormForward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), x_.data(), lnf_w, lnf_b,
                        rows_, ch, threads_);
  ops::VocabForward(logits_.data(), lnf_.data(), rows_of, chunk, rows_, ch, c_.vocab, threads_,
                    blas_);
  // With `backward`, the logits become their gradient in place (row by row, each read
  // whole before it is written).
  const double loss =
      ops::CrossEntropy(backward ? logits_.data() : static_cast<T*>(nullptr), logits_.data(),
                        targets, rows_, c_.vocab, grad_scale, threads_, row_loss_.data());
  if (!backward) return loss;
  std::vector<T>& dlnf = scratch_c_;
  std::fill(dlnf.begin(), dlnf.end(), T(0));
  ops::VocabBackwardInput(dlnf.data(), logits_.data(), rows_of, chunk, rows_, ch, c_.vocab,
                          threads_, blas_);
  std::vector<T> dx(rows_ * ch, T(0));
  std::fill(dlnf_wb_.begin(), dlnf_wb_.end(), T(0));
  ops::LayerNormBackward(dx.data(), dlnf_wb_.data(), dlnf_wb_.data() + ch, dlnf.data(), x_.data(),
                         lnf_w, lnf_mean_.data(), lnf_rstd_.data(), rows_, ch, threads_);
  x_ = std::move(dx);  // from here on x_ holds the gradient of the residual stream
  return loss;
}

template <typename T>
void Gpt<T>::HeadGradient(T* out, std::size_t begin, std::size_t end) const {
  const std::size_t norm = dlnf_wb_.size();  // the final layer norm's gain and bias first
  std::fill(out, out + (end - begin), T(0));
  for (std::size_t k = begin; k < std::min(end, norm); ++k) out[k - begin] = dlnf_wb_[k];
  if (end <= norm || TiedHead(c_)) return;
  const std::size_t lo = std::max(begin, norm);
  ops::MatmulWeightGradientRange(out + (lo - begin), logits_.data(), lnf_.data(), rows_,
                                 c_.channels, c_.vocab, lo - norm, end - norm, threads_, blas_);
}

template <typename T>
void Gpt<T>::BlockBackward(std::size_t layer, const T* params, T* dparams) {
  const BlockParams p(c_.channels);
  const std::size_t ch = c_.channels;
  BlockActs& a = Acts(layer);
  // x_ is d(out); out = mid + mlp(ln2(mid)); mid = in + attn(ln1(in)).
  std::vector<T> dmid = x_;
  T* dgelu = scratch_a_.data();
  T* dfc = scratch_b_.data();
  std::fill(dgelu, dgelu + rows_ * 4 * ch, T(0));
  ops::MatmulBackward(dgelu, dparams + p.fcp_w, dparams + p.fcp_b, x_.data(), a.gelu.data(),
                      params + p.fcp_w, rows_, 4 * ch, ch, threads_, blas_);
  std::fill(dfc, dfc + rows_ * 4 * ch, T(0));
  ops::GeluBackward(dfc, dgelu, a.fc.data(), rows_ * 4 * ch);
  T* dln2 = scratch_c_.data();
  std::fill(dln2, dln2 + rows_ * ch, T(0));
  ops::MatmulBackward(dln2, dparams + p.fc_w, dparams + p.fc_b, dfc, a.ln2.data(), params + p.fc_w,
                      rows_, ch, 4 * ch, threads_, blas_);
  ops::LayerNormBackward(dmid.data(), dparams + p.ln2_w, dparams + p.ln2_b, dln2, a.mid.data(),
                         params + p.ln2_w, a.ln2_mean.data(), a.ln2_rstd.data(), rows_, ch,
                         threads_);
  // attention
  x_ = dmid;  // d(in) starts as the residual's share
  T* datty = scratch_c_.data();
  std::fill(datty, datty + rows_ * ch, T(0));
  ops::MatmulBackward(datty, dparams + p.proj_w, dparams + p.proj_b, dmid.data(), a.atty.data(),
                      params + p.proj_w, rows_, ch, ch, threads_, blas_);
  T* dqkv = scratch_a_.data();
  std::fill(dqkv, dqkv + rows_ * 3 * ch, T(0));
  ops::AttentionBackward(dqkv, datty, a.qkv.data(), a.att.data(), c_.batch, c_.seq, ch, c_.heads,
                         threads_);
  T* dln1 = scratch_b_.data();
  std::fill(dln1, dln1 + rows_ * ch, T(0));
  ops::MatmulBackward(dln1, dparams + p.qkv_w, dparams + p.qkv_b, dqkv, a.ln1.data(),
                      params + p.qkv_w, rows_, ch, 3 * ch, threads_, blas_);
  ops::LayerNormBackward(x_.data(), dparams + p.ln1_w, dparams + p.ln1_b, dln1, a.in.data(),
                         params + p.ln1_w, a.ln1_mean.data(), a.ln1_rstd.data(), rows_, ch,
                         threads_);
}

template <typename T>
void Gpt<T>::EmbedGradient(T* out, std::size_t begin, std::size_t end) const {
  std::fill(out, out + (end - begin), T(0));
  // A tied head's share first (dlogits^T . lnf, in the token embeddings' rows), then the
  // rows the tokens and positions selected, each in a fixed order: range by range, the
  // bits of the whole.
  if (TiedHead(c_)) {
    ops::MatmulWeightGradientRange(out, logits_.data(), lnf_.data(), rows_, c_.channels, c_.vocab,
                                   begin, end, threads_, blas_);
  }
  ops::EmbeddingGradientRange(out, x_.data(), tokens_.data(), rows_, c_.seq, c_.vocab, c_.channels,
                              begin, end);
}

template <typename T>
const T* Gpt<T>::Logits(std::size_t b, std::size_t t) const {
  return logits_.data() + (b * c_.seq + t) * c_.vocab;
}

template <typename T>
std::size_t Gpt<T>::ActivationBytes() const {
  std::size_t n = x_.size() + lnf_.size() + lnf_mean_.size() + lnf_rstd_.size() + logits_.size() +
                  dlnf_wb_.size() + row_loss_.size() + scratch_a_.size() + scratch_b_.size() +
                  scratch_c_.size();
  for (const BlockActs& a : acts_) {
    n += a.in.size() + a.ln1.size() + a.ln1_mean.size() + a.ln1_rstd.size() + a.qkv.size() +
         a.att.size() + a.atty.size() + a.mid.size() + a.ln2.size() + a.ln2_mean.size() +
         a.ln2_rstd.size() + a.fc.size() + a.gelu.size();
  }
  return n * sizeof(T) + tokens_.capacity() * sizeof(std::int32_t);
}

template class Gpt<float>;
template class Gpt<double>;

}  // namespace offload_train
