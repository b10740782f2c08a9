// Hugging Face config.json files: the published ones of Llama-3.2-1B and GPT-2 read into
// the shapes the guide gives (1.24 B and 124,439,808 parameters), what the trainer cannot
// compute refused with the key named, and a written config read back the same.
#include "hf_config.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace offload_train {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// meta-llama/Llama-3.2-1B's config.json (transformers 4.45), as published.
constexpr const char* kLlama32 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";

// openai-community/gpt2's config.json, as published (less its task_specific_params).
constexpr const char* kGpt2 = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
  "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
  "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
  "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
  "resid_pdrop": 0.1, "summary_activation": null, "summary_first_dropout": 0.1,
  "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true,
  "vocab_size": 50257})";

TEST(HfConfig, ReadsLlama32OneB) {
  ASSERT_OK_AND_ASSIGN(HfConfig c, ParseHfConfig(kLlama32, "config.json"));
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.hidden, 2048u);
  EXPECT_EQ(c.layers, 16u);
  EXPECT_EQ(c.heads, 32u);
  EXPECT_EQ(c.kv_heads, 8u);
  EXPECT_EQ(c.head_dim, 64u);
  EXPECT_EQ(c.intermediate, 8192u);
  EXPECT_EQ(c.vocab, 128256u);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.rope.llama3);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.ParameterCount(), 1'235'814'400u);  // "1.24 B"
}

TEST(HfConfig, ReadsGpt2) {
  ASSERT_OK_AND_ASSIGN(HfConfig c, ParseHfConfig(kGpt2, "config.json"));
  EXPECT_EQ(c.arch, Arch::kGpt2);
  EXPECT_EQ(c.hidden, 768u);
  EXPECT_EQ(c.intermediate, 3072u);  // n_inner absent: 4 x n_embd
  EXPECT_EQ(c.max_positions, 1024u);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.ParameterCount(), 124'439'808u);
}

TEST(HfConfig, ReadsTransformers5RopeParameters) {
  std::string t = kLlama32;
  t.replace(t.find("\"rope_scaling\""), 0,
            R"("rope_parameters": {"rope_type": "llama3", "rope_theta": 250000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}, )");
  ASSERT_OK_AND_ASSIGN(HfConfig c, ParseHfConfig(t, "config.json"));
  EXPECT_DOUBLE_EQ(c.rope_theta, 250000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
}

TEST(HfConfig, RefusesWhatTheTrainerCannotComputeNamingTheKey) {
  const std::string base = kLlama32;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = base;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  struct Case {
    std::string text, says;
  } cases[] = {
      {with("\"model_type\": \"llama\"", "\"model_type\": \"mistral\""), "model_type"},
      {with("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"), "num_key_value_heads"},
      {with("\"attention_bias\": false", "\"attention_bias\": true"), "attention_bias"},
      {with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""), "hidden_act"},
      {with("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""), "yarn"},
      {with("\"hidden_size\": 2048", "\"hidden_size\": -2048"), "hidden_size"},
      {with("\"hidden_size\": 2048,", ""), "hidden_size"},
      {with("\"head_dim\": 64", "\"head_dim\": 63"), "head_dim"},
      {with("\"vocab_size\": 128256", "\"vocab_size\": 4294967296"), "vocab_size"},
      {"{\"model_type\": \"llama\",}", "json"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseHfConfig(c.text, "/models/x/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.says)))
        << c.says;
    EXPECT_THAT(ParseHfConfig(c.text, "/models/x/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/models/x/config.json")));
  }
  EXPECT_THAT(ReadHfConfig("/nonexistent/config.json"), StatusIs(absl::StatusCode::kNotFound));
  // GPT-2's options the kernels do not compute.
  struct Gpt2Case {
    const char* key;
    const char* entry;
  } gpt2_cases[] = {
      {"scale_attn_weights", "\"scale_attn_weights\": false,"},
      {"scale_attn_by_inverse_layer_idx", "\"scale_attn_by_inverse_layer_idx\": true,"}};
  for (const Gpt2Case& c : gpt2_cases) {
    std::string t = kGpt2;
    t.insert(1, c.entry);
    EXPECT_THAT(ParseHfConfig(t, "/models/gpt2/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("/models/gpt2/config.json"), HasSubstr(c.key))))
        << c.key;
  }
}

TEST(HfConfig, AWrittenConfigReadsBackTheSame) {
  for (const char* text : {kLlama32, kGpt2}) {
    ASSERT_OK_AND_ASSIGN(HfConfig c, ParseHfConfig(text, "in"));
    ASSERT_OK_AND_ASSIGN(HfConfig back, ParseHfConfig(HfConfigJson(c, "float32"), "out"));
    EXPECT_EQ(back.arch, c.arch);
    EXPECT_EQ(back.ParameterCount(), c.ParameterCount());
    EXPECT_EQ(back.kv_heads, c.kv_heads);
    EXPECT_EQ(back.head_dim, c.head_dim);
    EXPECT_EQ(back.rope.llama3, c.rope.llama3);
    EXPECT_DOUBLE_EQ(back.rope.factor, c.rope.factor);
    EXPECT_DOUBLE_EQ(back.rope_theta, c.rope_theta);
    EXPECT_EQ(back.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(back.torch_dtype, "float32");
  }
}

}  // namespace
}  // namespace offload_train
