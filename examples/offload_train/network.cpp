#include "network.h"

#include <utility>

#include "llama.h"

namespace offload_train {
namespace {

// Either model behind the interface: both have the same calls (model.h, llama.h).
template <typename Model>
class ModelNetwork final : public Network {
 public:
  template <typename... Args>
  explicit ModelNetwork(Args&&... args) : m_(std::forward<Args>(args)...) {}
  void Embed(const MatrixRows<float>& embed, const std::int32_t* tokens) override {
    m_.Embed(embed, tokens);
  }
  void Block(std::size_t layer, const float* params) override { m_.Block(layer, params); }
  double Head(const float* head, const MatrixRows<float>& embed, const std::int32_t* targets,
              float grad_scale, bool backward) override {
    return m_.Head(head, embed, targets, grad_scale, backward);
  }
  void HeadGradient(float* out, std::size_t begin, std::size_t end) const override {
    m_.HeadGradient(out, begin, end);
  }
  void BlockBackward(std::size_t layer, const float* params, float* dparams) override {
    m_.BlockBackward(layer, params, dparams);
  }
  void EmbedGradient(float* out, std::size_t begin, std::size_t end) const override {
    m_.EmbedGradient(out, begin, end);
  }
  const float* Residual() const override { return m_.Residual(); }
  void SetResidual(const float* stream) override { m_.SetResidual(stream); }
  void Recompute(std::size_t layer, const float* params, const float* input) override {
    m_.Recompute(layer, params, input);
  }
  const float* Logits(std::size_t b, std::size_t t) const override { return m_.Logits(b, t); }
  const float* RowLosses() const override { return m_.RowLosses(); }
  std::size_t ActivationBytes() const override { return m_.ActivationBytes(); }

 private:
  Model m_;
};

}  // namespace

std::unique_ptr<Network> MakeNetwork(const ModelConfig& c, const NetworkOptions& options,
                                     memascend::KernelThreads* threads) {
  if (IsLlama(c)) {
    return std::make_unique<ModelNetwork<Llama<float>>>(*c.hf, c.batch, c.seq, threads,
                                                        options.blas, options.checkpoint);
  }
  return std::make_unique<ModelNetwork<Gpt<float>>>(c, threads, options.blas, options.checkpoint);
}

}  // namespace offload_train
