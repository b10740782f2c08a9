// The model the trainer runs (ModelConfig: the demo's GPT, or a Hugging Face gpt2 or
// llama), and GPT-2's layout itself (Gpt; Llama is llama.h).
//
// A decoder-only transformer (GPT-2's layout: token and position embeddings, pre-norm
// blocks of causal multi-head attention and a GELU MLP, a final layer norm, an output
// head: the demo's untied, Hugging Face's GPT-2 tied to the token embeddings unless its
// config says otherwise), with the parameters in groups that the trainer streams one at
// a time: group 0 the embeddings, groups 1..L the blocks, group L+1 the head (with a
// tied head, the final layer norm alone).
//
// A group's parameters are one flat array (GroupLayout gives the slices), so each group
// is one tensor per kind of state in the store. The model keeps the activations of the
// current batch for the backward pass (ordinary memory, counted by ActivationBytes).
//
// Thread-safety: one thread drives a model; `threads` parallelises inside each layer.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_MODEL_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_MODEL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <absl/status/status.h>

#include <memascend/kernels.h>

#include "hf_config.h"

namespace offload_train {

// The model and its batch. Without `hf`, the demo's GPT of these sizes. With `hf`, that
// Hugging Face architecture (Llama), whose sizes vocab, channels, layers and heads repeat
// (ForHf), so that every report reads them from one place.
struct ModelConfig {
  std::size_t vocab = 256;
  std::size_t seq = 64;
  std::size_t channels = 128;
  std::size_t layers = 4;
  std::size_t heads = 4;
  std::size_t batch = 8;
  std::optional<HfConfig> hf;
};

ModelConfig ForHf(const HfConfig& hf, std::size_t batch, std::size_t seq);
// The output head multiplies by the token embeddings (group 0) instead of its own matrix.
bool TiedHead(const ModelConfig& c);
// A Hugging Face Llama (llama.h); otherwise GPT-2's layout (the demo's, or Hugging Face's
// gpt2), which the Gpt class below runs.
bool IsLlama(const ModelConfig& c);
// "GPT", or Hugging Face's model type ("llama").
std::string ArchName(const ModelConfig& c);

// kInvalidArgument for sizes out of range or a Hugging Face architecture the trainer does
// not run; kResourceExhausted for a model and batch this machine's memory cannot hold.
absl::Status Validate(const ModelConfig& c);

enum class GroupKind { kEmbed, kBlock, kHead };

struct Slice {
  std::string name;
  std::size_t offset = 0;
  std::size_t count = 0;
};

// A group's slices laid end to end, in the order they are added.
class SliceList {
 public:
  void Add(std::string name, std::size_t count) {
    slices_.push_back({std::move(name), end_, count});
    end_ += count;
  }
  std::vector<Slice> Take() && { return std::move(slices_); }

 private:
  std::vector<Slice> slices_;
  std::size_t end_ = 0;
};

// A row-major matrix of `cols` columns, read a range of rows at a time: either whole in
// memory (`data`), or made at most `chunk` rows at a time by `read`, whose result is valid
// until its next call (the trainer's tied embeddings, kept in 16 bits and widened as
// read: Note [tied head] in run.h). A model reads each range once before the next.
template <typename T>
struct MatrixRows {
  using Read = std::function<const T*(std::size_t begin, std::size_t end)>;
  MatrixRows(const T* whole = nullptr) : data(whole) {}  // NOLINT: a whole matrix converts
  MatrixRows(Read r, std::size_t most)
      : read(std::move(r)), chunk(std::max<std::size_t>(most, 1)) {}

  // Rows [begin, end), end - begin at most `chunk` when read.
  const T* Rows(std::size_t begin, std::size_t end, std::size_t cols) const {
    return data != nullptr ? data + begin * cols : read(begin, end);
  }
  // The most rows one Rows() may give, of a matrix of `rows`.
  std::size_t Chunk(std::size_t rows) const {
    return data != nullptr ? rows : std::min(rows, chunk);
  }

  const T* data = nullptr;
  Read read;
  std::size_t chunk = 0;
};

// The trainer's groups, for either architecture: group 0 the embeddings, groups
// 1..layers the blocks, group layers + 1 the head.
GroupKind KindOfGroup(std::size_t layers, std::size_t group);

std::size_t GroupCount(const ModelConfig& c);  // layers + 2
GroupKind KindOf(const ModelConfig& c, std::size_t group);
std::string GroupName(const ModelConfig& c, std::size_t group);  // "embed", "block.3", "head"
std::vector<Slice> GroupLayout(const ModelConfig& c, std::size_t group);
std::size_t GroupParams(const ModelConfig& c, std::size_t group);
std::size_t TotalParams(const ModelConfig& c);

// The demo GPT's initialisation (GPT-2's): N(0, 0.02) weights (residual projections scaled
// by 1/sqrt(2L)), unit layer-norm gains, zero biases; a Hugging Face architecture's own
// (InitLlamaGroup). Deterministic in (seed, group).
void InitGroup(const ModelConfig& c, std::size_t group, std::uint64_t seed, float* params);
// Elements [begin, end) of the same into params[0, end - begin), with their bits in the
// whole group's: a group made part by part (Run::Init) never needs a copy of it whole.
void InitGroupRange(const ModelConfig& c, std::size_t group, std::uint64_t seed, std::size_t begin,
                    std::size_t end, float* params);

template <typename T>
class Gpt {
 public:
  // `blas`: the matrix products through blas.h (ops.h). With `checkpoint`, the model keeps
  // one block's activations: the caller keeps each block's input (Residual() before
  // Block()) and hands it to Recompute() before that block's BlockBackward, which then
  // gives the bits it would have given.
  Gpt(const ModelConfig& config, memascend::KernelThreads* threads, bool blas = false,
      bool checkpoint = false);

  // Forward: Embed, then every Block in order, then Head (multiplying by `embed`'s token
  // embeddings with a tied head, TiedHead(); otherwise by its own matrix), which with
  // `backward` also
  // starts the backward pass (the head is last forward and first backward, so its
  // parameters are used once): it leaves the gradient of the residual stream for
  // BlockBackward, and the head's own gradient, scaled by grad_scale, for HeadGradient.
  // Returns the mean loss. `tokens` and `targets` are [batch * seq].
  // `params`: the embeddings' group ([wte; wpe], vocab + positions rows of channels).
  void Embed(const MatrixRows<T>& params, const std::int32_t* tokens);
  void Block(std::size_t layer, const T* params);
  const T* Residual() const { return x_.data(); }  // the next block's input, going forward
  void SetResidual(const T* stream) { std::copy(stream, stream + x_.size(), x_.begin()); }
  void Recompute(std::size_t layer, const T* params, const T* input);
  double Head(const T* params, const MatrixRows<T>& embed, const std::int32_t* targets,
              T grad_scale, bool backward);
  // Elements [begin, end) of the head's flat gradient into out[0, end - begin), after Head
  // with `backward` and before the next Head. Range by range, the bits of the whole.
  void HeadGradient(T* out, std::size_t begin, std::size_t end) const;
  void BlockBackward(std::size_t layer, const T* params, T* dparams);
  // Elements [begin, end) of the embeddings' flat gradient into out[0, end - begin), after
  // the BlockBackward of layer 0. Range by range, the bits of the whole.
  void EmbedGradient(T* out, std::size_t begin, std::size_t end) const;
  // The last logits row of sequence `b`, for sampling: after Head without `backward` (the
  // backward pass turns the logits into their gradient in place).
  const T* Logits(std::size_t b, std::size_t t) const;
  // Each row's loss (unscaled), after Head.
  const T* RowLosses() const { return row_loss_.data(); }
  std::size_t ActivationBytes() const;
  const ModelConfig& config() const { return c_; }

 private:
  struct BlockActs {
    std::vector<T> in, ln1, ln1_mean, ln1_rstd, qkv, att, atty, mid, ln2, ln2_mean, ln2_rstd, fc,
        gelu;
  };
  BlockActs& Acts(std::size_t layer) { return acts_[checkpoint_ ? 0 : layer]; }
  void Forward(std::size_t layer, const T* params, const T* input, T* output);

  ModelConfig c_;
  memascend::KernelThreads* threads_;
  bool blas_, checkpoint_;
  std::size_t rows_;
  std::vector<std::int32_t> tokens_;
  std::vector<T> x_;  // the residual stream, then its gradient
  std::vector<BlockActs> acts_;
  std::vector<T> lnf_, lnf_mean_, lnf_rstd_, logits_, row_loss_;
  std::vector<T> dlnf_wb_;  // the gradient of the final layer norm's gain and bias
  std::vector<T> scratch_a_, scratch_b_, scratch_c_;  // gradients inside a block
};

extern template class Gpt<float>;
extern template class Gpt<double>;

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_MODEL_H_
