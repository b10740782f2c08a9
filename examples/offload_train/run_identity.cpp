#include "run_identity.h"

#include <cstring>
#include <map>
#include <string_view>

#include <fmt/format.h>

#include <memascend/training_state.h>

#include "hf_config.h"

namespace offload_train {

// What the volume's tensors are (Note [state layout] in memascend/training_state.h; 4: the
// SDK's commit record); a volume of another layout is not resumed.
namespace {

constexpr std::uint64_t kLayoutVersion = 4;

}  // namespace

std::uint64_t TokensFingerprint(const std::vector<std::int32_t>& tokens) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::int32_t t : tokens) h = (h ^ static_cast<std::uint32_t>(t)) * 1099511628211ull;
  return h;
}

std::uint64_t Fingerprint(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
  for (std::size_t v :
       {o.model.vocab, o.model.seq, o.model.channels, o.model.layers, o.model.heads, o.model.batch})
    mix(v);
  mix(static_cast<std::uint64_t>(o.dtype));
  mix(o.seed);
  mix(o.warmup);
  mix(o.optimizer_chunk);
  for (float f : {o.lr, o.weight_decay, o.clip, o.initial_loss_scale}) {
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    mix(bits);
  }
  if (o.model.hf.has_value()) {
    for (char ch : HfConfigJson(*o.model.hf, "")) mix(static_cast<unsigned char>(ch));
  }
  mix(data);
  mix(corpus_tokens);
  mix(kLayoutVersion);
  return h;
}

// Note [run identity] (run_identity.h).
std::string RunIdentity(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens,
                        int world) {
  std::string out;
  const auto add = [&out](std::string_view key, const auto& value) {
    out += fmt::format("{}={}\n", key, value);
  };
  if (o.model.hf.has_value()) {
    const HfConfig& h = *o.model.hf;
    add("model", h.arch == Arch::kLlama ? "llama" : "gpt2");
    add("hidden_size", h.hidden);
    add("num_hidden_layers", h.layers);
    add("num_attention_heads", h.heads);
    add("vocab_size", h.vocab);
    add("parameters", h.ParameterCount());
  } else {
    add("vocab", o.model.vocab);
    add("channels", o.model.channels);
    add("layers", o.model.layers);
    add("heads", o.model.heads);
  }
  add("seq", o.model.seq);
  add("batch", o.model.batch);
  add("dtype", o.dtype == memascend::DType::kBF16 ? "bf16" : "fp16");
  add("seed", o.seed);
  add("lr", o.lr);
  add("warmup", o.warmup);
  add("weight_decay", o.weight_decay);
  add("clip", o.clip);
  add("loss_scale", o.initial_loss_scale);
  add("optimizer_chunk", o.optimizer_chunk);
  add("data", fmt::format("{} tokens, digest {:#x}", corpus_tokens, data));
  add("ranks", world);
  return out;
}

std::string RunDifference(memascend::ObjectStore* volume, const std::string& name,
                          const std::string& ours) {
  if (volume == nullptr) return {};
  auto info = volume->Stat(name);
  if (!info.ok()) return {};
  std::string bytes(info->size, '\0');
  if (!volume->Get(name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).ok())
    return {};
  auto record = memascend::DecodeCommitRecord(bytes);
  if (!record.ok() || record->user.empty()) return {};
  const auto parse = [](const std::string& text) {
    std::map<std::string, std::string> m;
    std::size_t at = 0;
    while (at < text.size()) {
      std::size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(at, end - at);
      if (const std::size_t eq = line.find('='); eq != std::string::npos)
        m[line.substr(0, eq)] = line.substr(eq + 1);
      at = end + 1;
    }
    return m;
  };
  const std::map<std::string, std::string> theirs = parse(record->user), mine = parse(ours);
  std::string out;
  for (const auto& [key, value] : mine) {
    auto it = theirs.find(key);
    const std::string was = it == theirs.end() ? "none" : it->second;
    if (was == value) continue;
    out += fmt::format("{}{}: {} on the volume, {} in this run", out.empty() ? "" : "; ", key, was,
                       value);
  }
  for (const auto& [key, value] : theirs) {
    if (!mine.count(key))
      out += fmt::format("{}{}: {} on the volume, none in this run", out.empty() ? "" : "; ", key,
                         value);
  }
  return out;
}

}  // namespace offload_train
