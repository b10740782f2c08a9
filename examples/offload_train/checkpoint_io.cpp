#include "checkpoint_io.h"

#include <fmt/format.h>

#include <memascend/status.h>

#include "llama.h"

namespace offload_train {
namespace {

// "a, b, c" (fmt::join trips GCC 12's -Wstringop-overflow in the sanitizer build).
std::string ShapeText(const std::vector<std::uint64_t>& shape) {
  std::string out;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out;
}

}  // namespace

std::vector<std::uint64_t> LlamaSliceShape(const HfConfig& c, std::size_t group, const Slice& s) {
  const std::uint64_t ch = c.hidden, qw = c.heads * c.head_dim, kw = c.kv_heads * c.head_dim,
                      in = c.intermediate;
  const std::string& n = s.name;
  if (n == "embed_tokens.weight" || n == "lm_head.weight") return {c.vocab, ch};
  if (n.find("norm") != std::string::npos) return {ch};
  if (n == "self_attn.q_proj.weight") return {qw, ch};
  if (n == "self_attn.k_proj.weight" || n == "self_attn.v_proj.weight") return {kw, ch};
  if (n == "self_attn.o_proj.weight") return {ch, qw};
  if (n == "mlp.gate_proj.weight" || n == "mlp.up_proj.weight") return {in, ch};
  if (n == "mlp.down_proj.weight") return {ch, in};
  (void)group;
  return {s.count};
}

absl::Status ImportLlamaGroup(const memascend::SafetensorsCheckpoint& ckpt, const HfConfig& c,
                              std::size_t group, float* out) {
  for (const Slice& s : LlamaGroupLayout(c, group)) {
    const std::string name = LlamaTensorName(c, group, s);
    MEMASCEND_ASSIGN_OR_RETURN(auto where, ckpt.Find(name));
    const std::vector<std::uint64_t> want = LlamaSliceShape(c, group, s);
    if (where.tensor->shape != want) {
      return absl::InvalidArgumentError(
          fmt::format("{}: tensor '{}' has shape [{}], the config's model needs [{}]",
                      where.file->path(), name, ShapeText(where.tensor->shape), ShapeText(want)));
    }
    // Read's errors name the file and the tensor already.
    MEMASCEND_RETURN_IF_ERROR(
        where.file->Read(*where.tensor, 0, {out + s.offset, s.count, memascend::DType::kF32}));
  }
  return absl::OkStatus();
}

std::vector<memascend::SafetensorsTensor> LlamaTensors(const HfConfig& c, std::string_view dtype) {
  std::vector<memascend::SafetensorsTensor> out;
  for (std::size_t g = 0; g < LlamaGroupCount(c); ++g) {
    for (const Slice& s : LlamaGroupLayout(c, g))
      out.push_back({LlamaTensorName(c, g, s), std::string(dtype), LlamaSliceShape(c, g, s)});
  }
  return out;
}

}  // namespace offload_train
