#include "checkpoint_io.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <map>
#include <system_error>
#include <unistd.h>

#include <fmt/format.h>

#include <memascend/status.h>

#include "llama.h"
#include "prim/file.h"
#include "prim/unique_fd.h"
#include "util/json_writer.h"

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

// `text` into `path` through a temporary file, fsynced and renamed over it.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string partial = path + ".partial";
  memascend::prim::UniqueFd fd(
      ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    return absl::UnavailableError(
        fmt::format("{}: cannot create: {}", partial, std::strerror(errno)));
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      memascend::prim::RemoveQuietly(partial);
      return absl::UnavailableError(
          fmt::format("{}: write failed: {}", partial, std::strerror(err)));
    }
    done += static_cast<std::size_t>(n);
  }
  absl::Status s = memascend::prim::Fsync(fd.get());
  if (s.ok()) s = fd.Close();
  if (!s.ok()) {
    memascend::prim::RemoveQuietly(partial);
    return s;
  }
  return memascend::prim::Rename(partial, path);
}

std::string ShardName(std::size_t i, std::size_t n) {
  return fmt::format("model-{:05}-of-{:05}.safetensors", i + 1, n);
}

}  // namespace

std::string TorchDtypeName(std::string_view dtype) {
  if (dtype == "F16") return "float16";
  if (dtype == "BF16") return "bfloat16";
  return "float32";
}

absl::Status ExportHfModel(const HfConfig& c, const std::string& dir, const HfExportOptions& o,
                           const std::function<absl::StatusOr<const float*>(std::size_t)>& group) {
  namespace fs = std::filesystem;
  if (o.dtype != "F32" && o.dtype != "F16" && o.dtype != "BF16") {
    return absl::InvalidArgumentError(fmt::format("export dtype '{}': F32, F16 or BF16", o.dtype));
  }
  if (o.shard_bytes == 0) return absl::InvalidArgumentError("export shard size must be positive");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(fmt::format("{}: cannot create: {}", dir, ec.message()));
  // What an earlier export (or a downloaded model) left: refused unless replacing it.
  std::vector<std::string> ours;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" ||
        (name.rfind("model", 0) == 0 && name.find(".safetensors") != std::string::npos))
      ours.push_back(e.path().string());
  }
  if (ec) return absl::UnavailableError(fmt::format("{}: cannot list: {}", dir, ec.message()));
  if (!ours.empty() && !o.overwrite) {
    return absl::AlreadyExistsError(
        fmt::format("export directory {} already holds a model ({}): give another directory, or "
                    "--export-overwrite to replace it",
                    dir, ours.front()));
  }

  // The shards: tensors in order, a new file when the next would pass shard_bytes.
  std::vector<memascend::SafetensorsTensor> tensors = LlamaTensors(c, o.dtype);
  const std::uint64_t esize = memascend::SafetensorsElementBytes(o.dtype);
  std::vector<std::vector<memascend::SafetensorsTensor>> shards(1);
  std::uint64_t in_shard = 0, total = 0;
  for (memascend::SafetensorsTensor& t : tensors) {
    const std::uint64_t bytes = t.elements() * esize;
    if (in_shard > 0 && in_shard + bytes > o.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    in_shard += bytes;
    total += bytes;
    shards.back().push_back(std::move(t));
  }
  const std::size_t n = shards.size();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::size_t shard = 0, left = shards[0].size();  // tensors still to write in `shard`
  auto writer = memascend::SafetensorsWriter::Create(
      fs::path(dir) / (n == 1 ? "model.safetensors" : ShardName(0, n)), shards[0], metadata,
      /*overwrite=*/true);
  MEMASCEND_RETURN_IF_ERROR(writer.status());
  for (std::size_t g = 0; g < LlamaGroupCount(c); ++g) {
    MEMASCEND_ASSIGN_OR_RETURN(const float* params, group(g));
    for (const Slice& s : LlamaGroupLayout(c, g)) {
      MEMASCEND_RETURN_IF_ERROR(
          (*writer)->Append({params + s.offset, s.count, memascend::DType::kF32}));
      if (--left > 0) continue;
      MEMASCEND_RETURN_IF_ERROR((*writer)->Finish());
      if (++shard == n) break;
      left = shards[shard].size();
      writer = memascend::SafetensorsWriter::Create(fs::path(dir) / ShardName(shard, n),
                                                    shards[shard], metadata, /*overwrite=*/true);
      MEMASCEND_RETURN_IF_ERROR(writer.status());
    }
  }
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  if (n > 1) {
    memascend::util::JsonWriter j;
    j.BeginObject().Key("metadata").BeginObject().Field("total_size", total).EndObject();
    j.Key("weight_map").BeginObject();
    for (std::size_t i = 0; i < n; ++i) {
      for (const memascend::SafetensorsTensor& t : shards[i]) j.Field(t.name, ShardName(i, n));
    }
    j.EndObject().EndObject();
    MEMASCEND_RETURN_IF_ERROR(WriteFileAtomically(index, j.str() + "\n"));
    memascend::prim::RemoveQuietly((fs::path(dir) / "model.safetensors").string());
  } else {
    memascend::prim::RemoveQuietly(index);  // an earlier sharded export's
  }
  return WriteFileAtomically((fs::path(dir) / "config.json").string(),
                             HfConfigJson(c, TorchDtypeName(o.dtype)) + "\n");
}

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

absl::StatusOr<memascend::DType> LlamaGroupDType(const memascend::SafetensorsCheckpoint& ckpt,
                                                 const HfConfig& c, std::size_t group) {
  const Slice first = LlamaGroupLayout(c, group).front();
  MEMASCEND_ASSIGN_OR_RETURN(auto where, ckpt.Find(LlamaTensorName(c, group, first)));
  auto type = where.tensor->Type();
  if (!type.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {}", where.file->path(), std::string(type.status().message())));
  }
  return *type;
}

absl::Status ImportLlamaGroup(const memascend::SafetensorsCheckpoint& ckpt, const HfConfig& c,
                              std::size_t group, memascend::MutableTensorView out) {
  if (out.elements != LlamaGroupParams(c, group)) {
    return absl::InvalidArgumentError(fmt::format("group {} has {} parameters, not {}", group,
                                                  LlamaGroupParams(c, group), out.elements));
  }
  const std::size_t esize = memascend::SizeOf(out.dtype);
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
    MEMASCEND_RETURN_IF_ERROR(where.file->Read(
        *where.tensor, 0,
        {static_cast<std::byte*>(out.data) + s.offset * esize, s.count, out.dtype}));
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
