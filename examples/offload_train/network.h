// The model the trainer runs, of either architecture (GPT-2's layout, model.h: the demo's
// GPT or Hugging Face's gpt2; or Llama, llama.h), behind one interface over its groups (model.h:
// group 0 the embeddings, 1..L the blocks, L + 1 the head) in fp32.
//
// A pass: Embed, Block for each layer in order, Head (which with `backward` starts the
// backward pass), HeadGradient, then BlockBackward in reverse, then EmbedGradient. With a
// tied head (TiedHead()), Head multiplies by the embedding matrix, which the caller passes
// again, whole or read a range of rows at a time (MatrixRows). With checkpointed activations
// (NetworkOptions::checkpoint) the caller keeps each block's input (Residual() before its Block)
// and hands it to Recompute() before that block's BlockBackward.
//
// Thread-safety: one thread drives a network; the KernelThreads parallelise inside it.
// Lifetime: the threads outlive the network.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_NETWORK_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_NETWORK_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include <memascend/kernels.h>

#include "model.h"

namespace offload_train {

struct NetworkOptions {
  bool blas = false;        // the matrix products through blas.h
  bool checkpoint = false;  // keep one block's activations
};

class Network {
 public:
  virtual ~Network() = default;
  virtual void Embed(const MatrixRows<float>& embed, const std::int32_t* tokens) = 0;
  virtual void Block(std::size_t layer, const float* params) = 0;
  // `embed` is read only with a tied head.
  virtual double Head(const float* head, const MatrixRows<float>& embed,
                      const std::int32_t* targets, float grad_scale, bool backward) = 0;
  virtual void HeadGradient(float* out, std::size_t begin, std::size_t end) const = 0;
  virtual void BlockBackward(std::size_t layer, const float* params, float* dparams) = 0;
  virtual void EmbedGradient(float* out, std::size_t begin, std::size_t end) const = 0;
  // The residual stream ([batch * seq, channels]): during the forward pass, the next
  // block's input (what a checkpointed network's caller keeps).
  virtual const float* Residual() const = 0;
  // Replaces the residual stream (a forward pass over several batches with each group
  // read once: the evaluation).
  virtual void SetResidual(const float* stream) = 0;
  // A checkpointed block's activations remade from its input, before its BlockBackward.
  virtual void Recompute(std::size_t layer, const float* params, const float* input) = 0;
  virtual const float* Logits(std::size_t b, std::size_t t) const = 0;
  virtual const float* RowLosses() const = 0;
  virtual std::size_t ActivationBytes() const = 0;
};

std::unique_ptr<Network> MakeNetwork(const ModelConfig& c, const NetworkOptions& options,
                                     memascend::KernelThreads* threads);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_NETWORK_H_
