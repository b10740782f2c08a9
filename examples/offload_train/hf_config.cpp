#include "hf_config.h"

#include <cerrno>
#include <cstdint>
#include <optional>

#include <fmt/format.h>

#include <memascend/status.h>

#include "prim/file.h"
#include "prim/unique_fd.h"
#include "util/json_reader.h"
#include "util/json_writer.h"

namespace offload_train {
namespace {

using memascend::util::JsonValue;

struct Reader {
  const JsonValue& v;
  std::string_view source;

  absl::Status Bad(std::string_view key, std::string_view what) const {
    return absl::InvalidArgumentError(fmt::format("{}: '{}' {}", source, key, what));
  }
  // A required positive count, or the first of several names that is present.
  absl::StatusOr<std::size_t> Count(std::initializer_list<std::string_view> keys,
                                    std::optional<std::size_t> fallback = std::nullopt) const {
    for (std::string_view key : keys) {
      const JsonValue* m = v.Find(key);
      if (m == nullptr || m->is_null()) continue;
      auto n = m->AsInt();
      if (!n.ok() || *n <= 0 || *n > (std::int64_t{1} << 40))
        return Bad(key, "is not a positive count");
      return static_cast<std::size_t>(*n);
    }
    if (fallback) return *fallback;
    return Bad(*keys.begin(), "is missing");
  }
  absl::StatusOr<double> Number(std::string_view key, double fallback) const {
    const JsonValue* m = v.Find(key);
    if (m == nullptr || m->is_null()) return fallback;
    auto d = m->AsDouble();
    if (!d.ok() || !(*d > 0)) return Bad(key, "is not a positive number");
    return *d;
  }
  absl::StatusOr<bool> Flag(std::string_view key, bool fallback) const {
    const JsonValue* m = v.Find(key);
    if (m == nullptr || m->is_null()) return fallback;
    auto b = m->AsBool();
    if (!b.ok()) return Bad(key, "is not true or false");
    return *b;
  }
  // A special token's id: absent or null, an integer (LLaMA-1 conversions have a pad of
  // -1, which the trainer never reads but carries), or a list of them.
  absl::StatusOr<std::optional<HfConfig::TokenIds>> Ids(std::string_view key) const {
    const JsonValue* m = v.Find(key);
    if (m == nullptr || m->is_null()) return std::nullopt;
    HfConfig::TokenIds t;
    t.list = m->is_array();
    for (const JsonValue& e : t.list ? m->items() : std::vector<JsonValue>{*m}) {
      auto n = e.AsInt();
      if (!n.ok()) return Bad(key, "is not a token id or a list of them");
      t.ids.push_back(*n);
    }
    return t;
  }
  std::string Text(std::string_view key) const {
    const JsonValue* m = v.Find(key);
    if (m == nullptr) return {};
    auto s = m->AsString();
    return s.ok() ? *s : std::string();
  }
};

absl::Status ReadRope(const JsonValue& root, std::string_view source, HfConfig* c) {
  const Reader top{root, source};
  MEMASCEND_ASSIGN_OR_RETURN(c->rope_theta, top.Number("rope_theta", 10000.0));
  // transformers 5: rope_parameters; earlier: rope_scaling (null for plain RoPE).
  const JsonValue* p = root.Find("rope_parameters");
  std::string key = "rope_parameters";
  if (p == nullptr || p->is_null()) {
    p = root.Find("rope_scaling");
    key = "rope_scaling";
  }
  if (p == nullptr || p->is_null()) return absl::OkStatus();
  if (!p->is_object()) return top.Bad(key, "is not an object");
  const Reader r{*p, source};
  std::string type = r.Text("rope_type");
  if (type.empty()) type = r.Text("type");
  if (p->Find("rope_theta") != nullptr) {
    MEMASCEND_ASSIGN_OR_RETURN(c->rope_theta, r.Number("rope_theta", c->rope_theta));
  }
  if (type.empty() || type == "default") return absl::OkStatus();
  if (type != "llama3") {
    return top.Bad(
        key, fmt::format("has rope_type '{}'; the trainer computes default and llama3", type));
  }
  c->rope.llama3 = true;
  // All four, as transformers requires (it refuses a llama3 rope without one): no guess.
  for (const char* need :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    const JsonValue* m = p->Find(need);
    if (m == nullptr || m->is_null())
      return top.Bad(key, fmt::format("has rope_type 'llama3' and no '{}'", need));
  }
  MEMASCEND_ASSIGN_OR_RETURN(c->rope.factor, r.Number("factor", 0));
  MEMASCEND_ASSIGN_OR_RETURN(c->rope.low_freq_factor, r.Number("low_freq_factor", 0));
  MEMASCEND_ASSIGN_OR_RETURN(c->rope.high_freq_factor, r.Number("high_freq_factor", 0));
  MEMASCEND_ASSIGN_OR_RETURN(c->rope.original_max_position_embeddings,
                             r.Number("original_max_position_embeddings", 0));
  if (!(c->rope.high_freq_factor > c->rope.low_freq_factor))
    return top.Bad(key, "has high_freq_factor not above low_freq_factor");
  return absl::OkStatus();
}

}  // namespace

std::string_view ToString(Arch a) noexcept { return a == Arch::kGpt2 ? "gpt2" : "llama"; }

std::size_t HfConfig::ParameterCount() const {
  const std::size_t q = heads * head_dim, kv = kv_heads * head_dim;
  if (arch == Arch::kGpt2) {
    const std::size_t block = 2 * 2 * hidden + hidden * 3 * hidden + 3 * hidden + hidden * hidden +
                              hidden + 2 * hidden * intermediate + intermediate + hidden;
    return vocab * hidden + max_positions * hidden + layers * block + 2 * hidden +
           (tie_embeddings ? 0 : vocab * hidden);
  }
  const std::size_t block =
      2 * hidden + hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate;
  return vocab * hidden + layers * block + hidden + (tie_embeddings ? 0 : vocab * hidden);
}

absl::StatusOr<HfConfig> ParseHfConfig(std::string_view json, std::string_view source) {
  auto parsed = memascend::util::ParseJson(json);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {}", source, std::string(parsed.status().message())));
  }
  const JsonValue& v = *parsed;
  if (!v.is_object()) return absl::InvalidArgumentError(fmt::format("{}: not an object", source));
  const Reader r{v, source};
  HfConfig c;
  const std::string type = r.Text("model_type");
  c.torch_dtype = r.Text("torch_dtype");
  if (c.torch_dtype.empty()) c.torch_dtype = r.Text("dtype");
  if (type == "gpt2") {
    c.arch = Arch::kGpt2;
    MEMASCEND_ASSIGN_OR_RETURN(c.vocab, r.Count({"vocab_size"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.hidden, r.Count({"n_embd", "hidden_size"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.layers, r.Count({"n_layer", "num_hidden_layers"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.heads, r.Count({"n_head", "num_attention_heads"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.max_positions, r.Count({"n_positions", "n_ctx"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.intermediate, r.Count({"n_inner"}, 4 * c.hidden));
    MEMASCEND_ASSIGN_OR_RETURN(c.norm_eps, r.Number("layer_norm_epsilon", 1e-5));
    MEMASCEND_ASSIGN_OR_RETURN(c.tie_embeddings, r.Flag("tie_word_embeddings", true));
    c.kv_heads = c.heads;
    const std::string act = r.Text("activation_function");
    if (!act.empty() && act != "gelu_new" && act != "gelu_pytorch_tanh")
      return r.Bad("activation_function",
                   fmt::format("is '{}'; GPT-2's kernels compute gelu_new", act));
    if (c.hidden % c.heads != 0) return r.Bad("n_head", "does not divide n_embd");
    c.head_dim = c.hidden / c.heads;
    // Attention scaled by 1/sqrt(head_dim), and by nothing else, as the kernels do.
    MEMASCEND_ASSIGN_OR_RETURN(const bool scaled, r.Flag("scale_attn_weights", true));
    if (!scaled) return r.Bad("scale_attn_weights", "is false; the kernels scale by 1/sqrt(d)");
    MEMASCEND_ASSIGN_OR_RETURN(const bool by_layer,
                               r.Flag("scale_attn_by_inverse_layer_idx", false));
    if (by_layer) {
      return r.Bad("scale_attn_by_inverse_layer_idx",
                   "is true; the kernels do not scale attention by the layer");
    }
  } else if (type == "llama") {
    c.arch = Arch::kLlama;
    MEMASCEND_ASSIGN_OR_RETURN(c.vocab, r.Count({"vocab_size"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.hidden, r.Count({"hidden_size"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.layers, r.Count({"num_hidden_layers"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.heads, r.Count({"num_attention_heads"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.kv_heads, r.Count({"num_key_value_heads"}, c.heads));
    MEMASCEND_ASSIGN_OR_RETURN(c.intermediate, r.Count({"intermediate_size"}));
    MEMASCEND_ASSIGN_OR_RETURN(c.max_positions, r.Count({"max_position_embeddings"}, 2048));
    MEMASCEND_ASSIGN_OR_RETURN(c.norm_eps, r.Number("rms_norm_eps", 1e-6));
    MEMASCEND_ASSIGN_OR_RETURN(c.tie_embeddings, r.Flag("tie_word_embeddings", false));
    if (v.Find("head_dim") == nullptr && c.hidden % c.heads != 0)
      return r.Bad("num_attention_heads", "does not divide hidden_size (and no head_dim)");
    MEMASCEND_ASSIGN_OR_RETURN(c.head_dim, r.Count({"head_dim"}, c.hidden / c.heads));
    if (c.head_dim % 2 != 0) return r.Bad("head_dim", "is odd: rotary embeddings pair halves");
    if (c.heads % c.kv_heads != 0)
      return r.Bad("num_key_value_heads", "does not divide num_attention_heads");
    for (const char* key : {"attention_bias", "mlp_bias"}) {
      MEMASCEND_ASSIGN_OR_RETURN(bool bias, r.Flag(key, false));
      if (bias) return r.Bad(key, "is true; the trainer's Llama has no biases");
    }
    const std::string act = r.Text("hidden_act");
    if (!act.empty() && act != "silu")
      return r.Bad("hidden_act", fmt::format("is '{}'; Llama's MLP computes silu", act));
    MEMASCEND_RETURN_IF_ERROR(ReadRope(v, source, &c));
  } else {
    return r.Bad("model_type", fmt::format("is '{}'; the trainer speaks gpt2 and llama", type));
  }
  if (c.vocab > (std::size_t{1} << 31))
    return r.Bad("vocab_size", "passes the 2^31 token ids the trainer holds");
  // Each size within a bound far past any model's (hidden 16k, heads 128, head_dim 256,
  // layers 200), so that no product of them (the parameter count, heads x head_dim)
  // overflows 64 bits and reads as a small model.
  const bool gpt2 = c.arch == Arch::kGpt2;
  const struct {
    std::size_t value, limit;
    const char* key;
  } limits[] = {
      {c.hidden, std::size_t{1} << 20, gpt2 ? "n_embd" : "hidden_size"},
      {c.intermediate, std::size_t{1} << 22, gpt2 ? "n_inner" : "intermediate_size"},
      {c.layers, std::size_t{1} << 12, gpt2 ? "n_layer" : "num_hidden_layers"},
      {c.heads, std::size_t{1} << 12, gpt2 ? "n_head" : "num_attention_heads"},
      {c.kv_heads, std::size_t{1} << 12, "num_key_value_heads"},
      // GPT-2's is n_embd / n_head, within n_embd's bound.
      {c.head_dim, gpt2 ? c.head_dim : std::size_t{1} << 12, "head_dim"},
      {c.max_positions, std::size_t{1} << 31, gpt2 ? "n_positions" : "max_position_embeddings"}};
  for (const auto& l : limits) {
    if (l.value > l.limit)
      return r.Bad(l.key, fmt::format("is {}, past the trainer's bound of {}", l.value, l.limit));
  }
  MEMASCEND_ASSIGN_OR_RETURN(c.bos, r.Ids("bos_token_id"));
  MEMASCEND_ASSIGN_OR_RETURN(c.eos, r.Ids("eos_token_id"));
  MEMASCEND_ASSIGN_OR_RETURN(c.pad, r.Ids("pad_token_id"));
  return c;
}

absl::StatusOr<HfConfig> ReadHfConfig(const std::string& path) {
  // A regular file only (a FIFO would wait for a writer forever, a directory reads as
  // nothing); a read's error is the error, not a short text.
  MEMASCEND_ASSIGN_OR_RETURN(memascend::prim::UniqueFd fd, memascend::prim::OpenRegularFile(path));
  std::string text;
  char buf[65536];
  for (;;) {
    const std::int64_t n = memascend::prim::PreadFull(fd.get(), buf, sizeof(buf), text.size());
    if (n < 0) return absl::ErrnoToStatus(static_cast<int>(-n), fmt::format("{}: read", path));
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > (16u << 20))
      return absl::InvalidArgumentError(fmt::format("{}: over 16 MiB: not a config.json", path));
    if (static_cast<std::size_t>(n) < sizeof(buf)) break;  // the end of the file
  }
  return ParseHfConfig(text, path);
}

std::string HfConfigJson(const HfConfig& c, std::string_view torch_dtype) {
  memascend::util::JsonWriter j;
  j.BeginObject();
  if (c.arch == Arch::kGpt2) {
    j.Key("architectures").BeginArray().String("GPT2LMHeadModel").EndArray();
    j.Field("model_type", "gpt2")
        .Field("vocab_size", c.vocab)
        .Field("n_embd", c.hidden)
        .Field("n_layer", c.layers)
        .Field("n_head", c.heads)
        .Field("n_positions", c.max_positions)
        .Field("n_ctx", c.max_positions)
        .Field("n_inner", c.intermediate)
        .Field("layer_norm_epsilon", c.norm_eps)
        .Field("activation_function", "gelu_new")
        .Field("tie_word_embeddings", c.tie_embeddings);
  } else {
    j.Key("architectures").BeginArray().String("LlamaForCausalLM").EndArray();
    j.Field("model_type", "llama")
        .Field("vocab_size", c.vocab)
        .Field("hidden_size", c.hidden)
        .Field("num_hidden_layers", c.layers)
        .Field("num_attention_heads", c.heads)
        .Field("num_key_value_heads", c.kv_heads)
        .Field("head_dim", c.head_dim)
        .Field("intermediate_size", c.intermediate)
        .Field("max_position_embeddings", c.max_positions)
        .Field("rms_norm_eps", c.norm_eps)
        .Field("hidden_act", "silu")
        .Field("attention_bias", false)
        .Field("mlp_bias", false)
        .Field("tie_word_embeddings", c.tie_embeddings)
        .Field("rope_theta", c.rope_theta);
    if (c.rope.llama3) {
      j.Key("rope_scaling")
          .BeginObject()
          .Field("rope_type", "llama3")
          .Field("factor", c.rope.factor)
          .Field("low_freq_factor", c.rope.low_freq_factor)
          .Field("high_freq_factor", c.rope.high_freq_factor)
          .Field("original_max_position_embeddings",
                 static_cast<std::int64_t>(c.rope.original_max_position_embeddings))
          .EndObject();
    } else {
      j.Key("rope_scaling").Null();
    }
  }
  const std::pair<const char*, const std::optional<HfConfig::TokenIds>*> ids[] = {
      {"bos_token_id", &c.bos}, {"eos_token_id", &c.eos}, {"pad_token_id", &c.pad}};
  for (const auto& [key, t] : ids) {
    if (!t->has_value()) continue;
    j.Key(key);
    if ((*t)->list) j.BeginArray();
    for (std::int64_t id : (*t)->ids) j.Int(id);
    if ((*t)->list) j.EndArray();
  }
  j.Field("torch_dtype", torch_dtype);
  j.EndObject();
  return std::move(j).str();
}

}  // namespace offload_train
