// Hugging Face's config.json for the two architectures the trainer speaks: GPT-2
// (model_type "gpt2") and Llama (model_type "llama"), read into one description, checked,
// and written back so that transformers loads what the trainer exports.
//
// What is refused, each with the file and the key named (kInvalidArgument): another
// model_type; a missing or non-positive size; heads that do not divide the hidden size
// (without head_dim) or key/value heads that do not divide the heads; biases in Llama's
// attention or MLP; an activation other than the one the architecture's kernels compute
// (silu for Llama, gelu_new for GPT-2); a rope type other than default and llama3.
// transformers 5 writes the rotary settings as "rope_parameters" (rope_type, rope_theta,
// and llama3's factors), earlier versions as "rope_theta" and "rope_scaling": both read.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_HF_CONFIG_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_HF_CONFIG_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include "llama_ops.h"

namespace offload_train {

enum class Arch { kGpt2, kLlama };
std::string_view ToString(Arch a) noexcept;  // "gpt2", "llama"

struct HfConfig {
  Arch arch = Arch::kLlama;
  std::size_t vocab = 0;
  std::size_t hidden = 0;
  std::size_t layers = 0;
  std::size_t heads = 0;
  std::size_t kv_heads = 0;      // = heads for GPT-2
  std::size_t head_dim = 0;      // hidden / heads unless the config says
  std::size_t intermediate = 0;  // GPT-2: n_inner, or 4 x hidden
  std::size_t max_positions = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000;  // Llama
  ops::RopeScaling rope;      // Llama
  bool tie_embeddings = false;
  std::string torch_dtype;  // as the file says ("bfloat16", ...); empty if absent
  // The tokenizer's special ids (bos_token_id, eos_token_id, pad_token_id), which the
  // trainer does not use but an export carries (generation reads them from config.json):
  // absent (or null) as none, one id, or a list (Llama 3's eos is two).
  struct TokenIds {
    std::vector<std::int64_t> ids;
    bool list = false;
  };
  std::optional<TokenIds> bos, eos, pad;

  std::size_t ParameterCount() const;
};

// `source` names the file in errors.
absl::StatusOr<HfConfig> ParseHfConfig(std::string_view json, std::string_view source);
absl::StatusOr<HfConfig> ReadHfConfig(const std::string& path);
// A config.json transformers loads for the model (with `torch_dtype` as given).
std::string HfConfigJson(const HfConfig& c, std::string_view torch_dtype);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_HF_CONFIG_H_
