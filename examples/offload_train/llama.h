// Llama (Hugging Face's LlamaForCausalLM) on the trainer's groups: group 0 the token
// embeddings, groups 1..L the decoder layers, group L+1 the head (the final RMSNorm, and
// lm_head unless the embeddings are tied). Each group's parameters are one flat array
// whose slices carry Hugging Face's names and layouts (GroupLayout), so a checkpoint maps
// onto groups slice by slice: "model.layers.<l>." + a block slice's name, and so on.
//
// With tied embeddings the head multiplies by the embedding matrix: Head() takes it, and
// EmbedGradient() adds the head's share (dlogits^T . normed) to the rows the tokens
// selected. The interface is Gpt's (model.h) otherwise: Embed, Block, Head, then
// HeadGradient, BlockBackward in reverse, EmbedGradient; the gradients come range by
// range with the bits of the whole (Note [gradient parts] in step.cpp).
//
// With `checkpoint`, the model keeps one block's activations, not every block's: the caller
// keeps each block's input (Residual() before Block()) and hands it back to Recompute()
// before that block's BlockBackward, which then gives the bits it would have given.
// `blas`: the matrix products through blas.h (ops.h).
//
// Thread-safety: one thread drives a model; `threads` parallelises inside each layer.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <memascend/kernels.h>

#include "hf_config.h"
#include "model.h"

namespace offload_train {

std::size_t LlamaGroupCount(const HfConfig& c);  // layers + 2
GroupKind LlamaKindOf(const HfConfig& c, std::size_t group);
// Hugging Face's name of a slice of `group`: "model.embed_tokens.weight",
// "model.layers.3.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight".
std::string LlamaTensorName(const HfConfig& c, std::size_t group, const Slice& s);
std::vector<Slice> LlamaGroupLayout(const HfConfig& c, std::size_t group);
std::size_t LlamaGroupParams(const HfConfig& c, std::size_t group);

// The initialisation of transformers' LlamaPreTrainedModel: N(0, initializer_range = 0.02)
// weights, unit RMSNorm gains. Deterministic in (seed, group).
void InitLlamaGroup(const HfConfig& c, std::size_t group, std::uint64_t seed, float* params);
// Elements [begin, end) of the same into params[0, end - begin) (InitGroupRange).
void InitLlamaGroupRange(const HfConfig& c, std::size_t group, std::uint64_t seed,
                         std::size_t begin, std::size_t end, float* params);

template <typename T>
class Llama {
 public:
  Llama(const HfConfig& config, std::size_t batch, std::size_t seq,
        memascend::KernelThreads* threads, bool blas = false, bool checkpoint = false);

  void Embed(const MatrixRows<T>& embed, const std::int32_t* tokens);
  void Block(std::size_t layer, const T* params);
  // The residual stream ([batch * seq, hidden]): the next block's input during the
  // forward pass.
  const T* Residual() const { return x_.data(); }
  void SetResidual(const T* stream) { std::copy(stream, stream + x_.size(), x_.begin()); }
  // Layer `layer`'s activations again from its input (checkpointed models).
  void Recompute(std::size_t layer, const T* params, const T* input);
  // `embed` is the embedding matrix, read only when the embeddings are tied.
  double Head(const T* head, const MatrixRows<T>& embed, const std::int32_t* targets, T grad_scale,
              bool backward);
  void HeadGradient(T* out, std::size_t begin, std::size_t end) const;
  void BlockBackward(std::size_t layer, const T* params, T* dparams);
  void EmbedGradient(T* out, std::size_t begin, std::size_t end) const;
  const T* Logits(std::size_t b, std::size_t t) const;
  const T* RowLosses() const { return row_loss_.data(); }  // each row's loss, after Head
  std::size_t ActivationBytes() const;
  const HfConfig& config() const { return c_; }

 private:
  struct BlockActs {
    std::vector<T> in, ln1, ln1_rstd, q, k, v, att, atty, mid, ln2, ln2_rstd, gate, up, act;
  };
  BlockActs& Acts(std::size_t layer) { return acts_[checkpoint_ ? 0 : layer]; }
  void Forward(std::size_t layer, const T* params, const T* input, T* output);

  HfConfig c_;
  std::size_t batch_, seq_, rows_;
  memascend::KernelThreads* threads_;
  bool blas_, checkpoint_;
  std::vector<T> cos_, sin_;
  std::vector<std::int32_t> tokens_;
  std::vector<T> x_;  // the residual stream, then its gradient
  std::vector<BlockActs> acts_;
  std::vector<T> normed_, norm_rstd_, logits_, row_loss_, dnorm_w_;
  std::vector<T> scratch_a_, scratch_b_, scratch_c_, scratch_d_;
};

extern template class Llama<float>;
extern template class Llama<double>;

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_LLAMA_H_
