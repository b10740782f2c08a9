#include "checkpoint_io.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <linux/fs.h>
#include <map>
#include <optional>
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

// The stored shape of a Llama slice ([out, in] for a Linear weight, as nn.Linear).
std::vector<std::uint64_t> LlamaSliceShape(const HfConfig& c, const Slice& s) {
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
  return {s.count};
}

// GPT-2's names and stored shapes for the GPT layout's slices (model.h): Conv1D weights
// are stored [in, out], the transpose of the group's [out, in].
HfTensorSlice Gpt2Slice(const HfConfig& c, std::size_t group, const Slice& s) {
  struct Known {
    const char* ours;
    const char* theirs;
    std::uint64_t in, out;  // in x hidden, out x hidden (0: a vector of `out`)
    bool conv1d;
  };
  static constexpr Known kBlock[] = {
      {"ln1.w", "ln_1.weight", 0, 1, false},
      {"ln1.b", "ln_1.bias", 0, 1, false},
      {"attn.qkv.w", "attn.c_attn.weight", 1, 3, true},
      {"attn.qkv.b", "attn.c_attn.bias", 0, 3, false},
      {"attn.proj.w", "attn.c_proj.weight", 1, 1, true},
      {"attn.proj.b", "attn.c_proj.bias", 0, 1, false},
      {"ln2.w", "ln_2.weight", 0, 1, false},
      {"ln2.b", "ln_2.bias", 0, 1, false},
      {"mlp.fc.w", "mlp.c_fc.weight", 1, 4, true},
      {"mlp.fc.b", "mlp.c_fc.bias", 0, 4, false},
      {"mlp.proj.w", "mlp.c_proj.weight", 4, 1, true},
      {"mlp.proj.b", "mlp.c_proj.bias", 0, 1, false},
  };
  const std::uint64_t h = c.hidden;
  HfTensorSlice t{s, "", {}, false};
  if (s.name == "wte") {
    t.name = "transformer.wte.weight";
    t.shape = {c.vocab, h};
  } else if (s.name == "wpe") {
    t.name = "transformer.wpe.weight";
    t.shape = {c.max_positions, h};
  } else if (s.name == "lnf.w" || s.name == "lnf.b") {
    t.name = s.name == "lnf.w" ? "transformer.ln_f.weight" : "transformer.ln_f.bias";
    t.shape = {h};
  } else if (s.name == "lm_head.w") {
    t.name = "lm_head.weight";
    t.shape = {c.vocab, h};
  } else {
    for (const Known& k : kBlock) {
      if (s.name != k.ours) continue;
      t.name = fmt::format("transformer.h.{}.{}", group - 1, k.theirs);
      t.shape = k.in == 0 ? std::vector<std::uint64_t>{k.out * h}
                          : std::vector<std::uint64_t>{k.in * h, k.out * h};
      t.transposed = k.conv1d;
    }
  }
  return t;
}

// Transposes a [rows, cols] matrix of `esize`-byte elements into [cols, rows].
void Transpose(const std::byte* in, std::byte* out, std::size_t rows, std::size_t cols,
               std::size_t esize) {
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t k = 0; k < cols; ++k)
      std::memcpy(out + (k * rows + r) * esize, in + (r * cols + k) * esize, esize);
  }
}

// Where a slice's tensor is: under its name, or (GPT-2's original checkpoints) without
// the "transformer." prefix that GPT2LMHeadModel's own saves carry.
absl::StatusOr<memascend::SafetensorsCheckpoint::Where> FindTensor(
    const memascend::SafetensorsCheckpoint& ckpt, const std::string& name) {
  auto where = ckpt.Find(name);
  constexpr std::string_view kPrefix = "transformer.";
  if (!where.ok() && name.rfind(kPrefix, 0) == 0) {
    auto bare = ckpt.Find(name.substr(kPrefix.size()));
    if (bare.ok()) return bare;
  }
  return where;
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

std::vector<HfTensorSlice> HfGroupTensors(const ModelConfig& c, std::size_t group) {
  std::vector<HfTensorSlice> out;
  for (const Slice& s : GroupLayout(c, group)) {
    if (IsLlama(c)) {
      out.push_back({s, LlamaTensorName(*c.hf, group, s), LlamaSliceShape(*c.hf, s), false});
    } else {
      out.push_back(Gpt2Slice(*c.hf, group, s));
    }
  }
  return out;
}

std::vector<memascend::SafetensorsTensor> HfTensors(const ModelConfig& c, std::string_view dtype) {
  std::vector<memascend::SafetensorsTensor> out;
  for (std::size_t g = 0; g < GroupCount(c); ++g) {
    for (const HfTensorSlice& t : HfGroupTensors(c, g))
      out.push_back({t.name, std::string(dtype), t.shape});
  }
  return out;
}

absl::StatusOr<memascend::DType> HfGroupDType(const memascend::SafetensorsCheckpoint& ckpt,
                                              const ModelConfig& c, std::size_t group) {
  std::optional<memascend::DType> common;
  for (const HfTensorSlice& t : HfGroupTensors(c, group)) {
    MEMASCEND_ASSIGN_OR_RETURN(auto where, FindTensor(ckpt, t.name));
    auto type = where.tensor->Type();
    if (!type.ok()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: {}", where.file->path(), std::string(type.status().message())));
    }
    // Two 16-bit formats hold different values (bf16's range, fp16's precision): a group
    // of mixed dtypes is read in fp32, which holds each exactly.
    if (common.has_value() && *common != *type) return memascend::DType::kF32;
    common = *type;
  }
  return *common;  // a group has at least one tensor
}

absl::Status ImportHfGroup(const memascend::SafetensorsCheckpoint& ckpt, const ModelConfig& c,
                           std::size_t group, memascend::MutableTensorView out) {
  if (out.elements != GroupParams(c, group)) {
    return absl::InvalidArgumentError(fmt::format("group {} has {} parameters, not {}", group,
                                                  GroupParams(c, group), out.elements));
  }
  const std::size_t esize = memascend::SizeOf(out.dtype);
  std::vector<std::byte> stored;  // a transposed tensor as the file has it
  for (const HfTensorSlice& t : HfGroupTensors(c, group)) {
    MEMASCEND_ASSIGN_OR_RETURN(auto where, FindTensor(ckpt, t.name));
    if (where.tensor->shape != t.shape) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: tensor '{}' has shape [{}], the config's model needs [{}]", where.file->path(),
          where.tensor->name, ShapeText(where.tensor->shape), ShapeText(t.shape)));
    }
    std::byte* dst = static_cast<std::byte*>(out.data) + t.slice.offset * esize;
    // Read's errors name the file and the tensor already.
    if (!t.transposed) {
      MEMASCEND_RETURN_IF_ERROR(
          where.file->Read(*where.tensor, 0, {dst, t.slice.count, out.dtype}));
      continue;
    }
    stored.resize(t.slice.count * esize);
    MEMASCEND_RETURN_IF_ERROR(
        where.file->Read(*where.tensor, 0, {stored.data(), t.slice.count, out.dtype}));
    Transpose(stored.data(), dst, t.shape[0], t.shape[1], esize);
  }
  return absl::OkStatus();
}

absl::Status ForEachHfTensor(
    const ModelConfig& c, std::size_t group, const float* params,
    const std::function<absl::Status(const HfTensorSlice&, const float*)>& fn) {
  std::vector<float> transposed;
  for (const HfTensorSlice& t : HfGroupTensors(c, group)) {
    const float* data = params + t.slice.offset;
    if (t.transposed) {  // the group's [out, in] as the file's [in, out]
      transposed.resize(t.slice.count);
      Transpose(reinterpret_cast<const std::byte*>(data),
                reinterpret_cast<std::byte*>(transposed.data()), t.shape[1], t.shape[0],
                sizeof(float));
      data = transposed.data();
    }
    MEMASCEND_RETURN_IF_ERROR(fn(t, data));
  }
  return absl::OkStatus();
}

namespace {

namespace fs = std::filesystem;

// The file that marks a staging directory as an export's own (Note [atomic export]).
constexpr const char* kStagingMarker = ".memascend-export";

// A file of a model export (ours to replace), as opposed to what else a model directory
// holds (a tokenizer, a README, a user's model_ema.safetensors or model.safetensors.bak,
// which are carried over): the names an export writes, exactly (Hugging Face's
// model.safetensors, its index, model-00001-of-00002.safetensors, config.json), and the
// temporary ".partial" names they are written under.
bool IsModelFile(std::string name) {
  constexpr std::string_view kPartial = ".partial";
  if (name.size() > kPartial.size() && name.ends_with(kPartial))
    name.resize(name.size() - kPartial.size());
  if (name == "config.json" || name == kStagingMarker || name == "model.safetensors" ||
      name == "model.safetensors.index.json")
    return true;
  // model-DDDDD-of-DDDDD.safetensors
  constexpr std::string_view kShape = "model-#####-of-#####.safetensors";
  if (name.size() != kShape.size()) return false;
  for (std::size_t i = 0; i < kShape.size(); ++i) {
    const bool digit = name[i] >= '0' && name[i] <= '9';
    if (kShape[i] == '#' ? !digit : name[i] != kShape[i]) return false;
  }
  return true;
}

absl::Status SyncDirectory(const fs::path& dir) {
  memascend::prim::UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) {
    return absl::UnavailableError(
        fmt::format("{}: cannot open to sync: {}", dir.string(), std::strerror(errno)));
  }
  return memascend::prim::Fsync(fd.get());
}

// Whether `a` and `b` are the same file, or files with the same bytes.
bool SameFile(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  if (ec || fs::file_size(a, ec) != fs::file_size(b, ec) || ec) return false;
  std::FILE* fa = std::fopen(a.c_str(), "rb");
  std::FILE* fb = std::fopen(b.c_str(), "rb");
  bool same = fa != nullptr && fb != nullptr;
  std::vector<char> ba(1 << 16), bb(1 << 16);
  while (same) {
    const std::size_t na = std::fread(ba.data(), 1, ba.size(), fa);
    const std::size_t nb = std::fread(bb.data(), 1, bb.size(), fb);
    same = na == nb && std::memcmp(ba.data(), bb.data(), na) == 0;
    if (na == 0) break;
  }
  if (fa != nullptr) std::fclose(fa);
  if (fb != nullptr) std::fclose(fb);
  return same;
}

// A staging directory an earlier export left (killed before its swap, or after it, holding
// the old model): removed when it holds nothing but model files and files the target holds
// too (carried over); refused, naming what it holds, otherwise (a folder of the target's,
// moved in just before a crash, is never removed).
absl::Status ClearStaging(const fs::path& stage, const fs::path& target) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(stage, ec))) return absl::OkStatus();
  if (!fs::is_directory(fs::symlink_status(stage, ec))) {
    return absl::AlreadyExistsError(fmt::format(
        "{} exists and is not an export's staging directory: move it away to export to {}",
        stage.string(), target.string()));
  }
  for (const fs::directory_entry& e : fs::directory_iterator(stage, ec)) {
    const std::string name = e.path().filename().string();
    const bool regular = e.is_regular_file(ec) && !e.is_symlink(ec);
    if (regular && (IsModelFile(name) || SameFile(e.path(), target / name))) continue;
    return absl::AlreadyExistsError(fmt::format(
        "{} is an interrupted export's staging directory and holds {}, which is neither a "
        "model file nor in {}: move it away, then export again",
        stage.string(), e.path().string(), target.string()));
  }
  fs::remove_all(stage, ec);
  if (ec) {
    return absl::UnavailableError(fmt::format("{}: cannot remove an earlier export's staging: {}",
                                              stage.string(), ec.message()));
  }
  return absl::OkStatus();
}

// What the target holds beside its model (a tokenizer, a README, folders) into `stage`,
// so it stays with the new export: regular files hard-linked (copied where links fail),
// anything else moved (Note [atomic export]).
absl::Status CarryOver(const fs::path& target, const fs::path& stage) {
  std::error_code ec;
  std::vector<fs::path> moved;
  for (const fs::directory_entry& e : fs::directory_iterator(target, ec)) {
    const std::string name = e.path().filename().string();
    if (IsModelFile(name)) continue;
    if (e.is_regular_file(ec) && !e.is_symlink(ec)) {
      fs::create_hard_link(e.path(), stage / name, ec);
      if (ec) fs::copy_file(e.path(), stage / name, ec);
      if (ec) {
        return absl::UnavailableError(fmt::format("{}: cannot carry into the new export: {}",
                                                  e.path().string(), ec.message()));
      }
    } else {
      moved.push_back(e.path());
    }
  }
  if (ec) {
    return absl::UnavailableError(
        fmt::format("{}: cannot list: {}", target.string(), ec.message()));
  }
  for (const fs::path& p : moved) {  // last: the moment before the swap is short
    MEMASCEND_RETURN_IF_ERROR(memascend::prim::Rename(p.string(), (stage / p.filename()).string()));
  }
  return absl::OkStatus();
}

// `stage` takes `target`'s place; what was there ends up under `stage`'s name.
absl::Status Swap(const fs::path& stage, const fs::path& target, bool target_exists) {
  if (!target_exists) return memascend::prim::Rename(stage.string(), target.string());
  if (::renameat2(AT_FDCWD, stage.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0)
    return absl::OkStatus();
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
    return absl::ErrnoToStatus(
        errno, fmt::format("renameat2({}, {}, RENAME_EXCHANGE)", stage.string(), target.string()));
  }
  // A file system without the exchange: the target is absent for a moment, never mixed.
  const fs::path old = stage.string() + ".old";
  MEMASCEND_RETURN_IF_ERROR(memascend::prim::Rename(target.string(), old.string()));
  if (absl::Status s = memascend::prim::Rename(stage.string(), target.string()); !s.ok()) {
    (void)memascend::prim::Rename(old.string(), target.string());
    return s;
  }
  return memascend::prim::Rename(old.string(), stage.string());
}

// The export's files into `dir` (the staging directory), each fsynced.
absl::Status WriteExport(const ModelConfig& c, const fs::path& dir, const HfExportOptions& o,
                         const GroupRangeReader& read) {
  // The shards: tensors in order, a new file when the next would pass shard_bytes.
  std::vector<memascend::SafetensorsTensor> tensors = HfTensors(c, o.dtype);
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
      dir / (n == 1 ? "model.safetensors" : ShardName(0, n)), shards[0], metadata);
  MEMASCEND_RETURN_IF_ERROR(writer.status());
  // Each tensor to the current file; a file whole, the next one.
  const auto tensor_done = [&]() -> absl::Status {
    if (--left > 0) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR((*writer)->Finish());
    if (++shard == n) return absl::OkStatus();  // the last tensor
    left = shards[shard].size();
    writer =
        memascend::SafetensorsWriter::Create(dir / ShardName(shard, n), shards[shard], metadata);
    return writer.status();
  };
  std::vector<float> piece, whole;
  for (std::size_t g = 0; g < GroupCount(c); ++g) {
    for (const HfTensorSlice& t : HfGroupTensors(c, g)) {
      if (t.transposed) {  // the group's [out, in] as the file's [in, out]: read whole
        whole.resize(t.slice.count);
        piece.resize(std::max(piece.size(), t.slice.count));
        MEMASCEND_RETURN_IF_ERROR(read(g, t.slice.offset, t.slice.count, whole.data()));
        Transpose(reinterpret_cast<const std::byte*>(whole.data()),
                  reinterpret_cast<std::byte*>(piece.data()), t.shape[1], t.shape[0],
                  sizeof(float));
        MEMASCEND_RETURN_IF_ERROR(
            (*writer)->Append({piece.data(), t.slice.count, memascend::DType::kF32}));
      } else {
        for (std::size_t done = 0; done < t.slice.count;) {
          const std::size_t count = std::min(o.piece_elements, t.slice.count - done);
          piece.resize(std::max(piece.size(), count));
          MEMASCEND_RETURN_IF_ERROR(read(g, t.slice.offset + done, count, piece.data()));
          MEMASCEND_RETURN_IF_ERROR(
              (*writer)->Append({piece.data(), count, memascend::DType::kF32}));
          done += count;
        }
      }
      MEMASCEND_RETURN_IF_ERROR(tensor_done());
    }
  }
  if (n > 1) {
    memascend::util::JsonWriter j;
    j.BeginObject().Key("metadata").BeginObject().Field("total_size", total).EndObject();
    j.Key("weight_map").BeginObject();
    for (std::size_t i = 0; i < n; ++i) {
      for (const memascend::SafetensorsTensor& t : shards[i]) j.Field(t.name, ShardName(i, n));
    }
    j.EndObject().EndObject();
    MEMASCEND_RETURN_IF_ERROR(
        WriteFileAtomically((dir / "model.safetensors.index.json").string(), j.str() + "\n"));
  }
  MEMASCEND_RETURN_IF_ERROR(WriteFileAtomically(
      (dir / "config.json").string(), HfConfigJson(*c.hf, TorchDtypeName(o.dtype)) + "\n"));
  return absl::OkStatus();
}

}  // namespace

absl::Status ExportHfModel(const ModelConfig& c, const std::string& dir_arg,
                           const HfExportOptions& o, const GroupRangeReader& read) {
  if (!c.hf.has_value()) return absl::InvalidArgumentError("only a Hugging Face model exports");
  if (o.dtype != "F32" && o.dtype != "F16" && o.dtype != "BF16") {
    return absl::InvalidArgumentError(fmt::format("export dtype '{}': F32, F16 or BF16", o.dtype));
  }
  if (o.shard_bytes == 0) return absl::InvalidArgumentError("export shard size must be positive");
  if (o.piece_elements == 0)
    return absl::InvalidArgumentError("export piece size must be positive");
  if (dir_arg.empty()) return absl::InvalidArgumentError("export directory: empty path");
  std::error_code ec;
  // The directory itself (through a link to it), absolute, so that its parent and name are
  // real: the staging directory is its sibling on the same file system.
  fs::path target = fs::weakly_canonical(fs::absolute(dir_arg, ec), ec);
  // "out/" names out: a directory not made yet keeps its trailing separator here.
  while (!ec && !target.has_filename() && target != target.root_path())
    target = target.parent_path();
  if (ec || !target.has_filename() || !target.has_parent_path() || target == target.root_path()) {
    return absl::InvalidArgumentError(fmt::format("export directory {}: not a usable path{}",
                                                  dir_arg, ec ? ": " + ec.message() : ""));
  }
  const bool exists = fs::exists(target, ec);
  if (exists && !fs::is_directory(target, ec)) {
    return absl::InvalidArgumentError(
        fmt::format("export directory {} exists and is not a directory", dir_arg));
  }
  const fs::path parent = target.parent_path();
  fs::create_directories(parent, ec);
  if (ec)
    return absl::UnavailableError(
        fmt::format("{}: cannot create: {}", parent.string(), ec.message()));
  // What an earlier export (or a downloaded model) left: refused unless replacing it.
  if (exists) {
    for (const fs::directory_entry& e : fs::directory_iterator(target, ec)) {
      const std::string name = e.path().filename().string();
      if (IsModelFile(name) && name != kStagingMarker && !o.overwrite) {
        return absl::AlreadyExistsError(fmt::format(
            "export directory {} already holds a model ({}): give another directory, or "
            "--export-overwrite to replace it",
            dir_arg, e.path().string()));
      }
    }
    if (ec)
      return absl::UnavailableError(fmt::format("{}: cannot list: {}", dir_arg, ec.message()));
  }

  // Note [atomic export]: staged beside the target, swapped in whole.
  const fs::path stage = parent / ("." + target.filename().string() + ".memascend-export");
  MEMASCEND_RETURN_IF_ERROR(ClearStaging(stage, target));
  fs::create_directory(stage, ec);
  if (ec)
    return absl::UnavailableError(
        fmt::format("{}: cannot create: {}", stage.string(), ec.message()));
  absl::Status s = WriteFileAtomically((stage / kStagingMarker).string(),
                                       "an export to " + target.string() + " in progress\n");
  if (s.ok()) s = WriteExport(c, stage, o, read);
  if (s.ok() && exists) {
    fs::permissions(stage, fs::status(target, ec).permissions(), ec);
    s = CarryOver(target, stage);
  }
  if (s.ok()) s = SyncDirectory(stage);
  if (!s.ok()) {
    // Nothing of the target was touched unless folders were carried: those go back.
    if (exists) {
      for (const fs::directory_entry& e : fs::directory_iterator(stage, ec)) {
        if (!e.is_regular_file(ec) && !IsModelFile(e.path().filename().string())) {
          (void)memascend::prim::Rename(e.path().string(), (target / e.path().filename()).string());
        }
      }
    }
    fs::remove_all(stage, ec);  // our files, and links to (copies of) the target's
    return s;
  }
  MEMASCEND_RETURN_IF_ERROR(Swap(stage, target, exists));
  memascend::prim::RemoveQuietly((target / kStagingMarker).string());
  MEMASCEND_RETURN_IF_ERROR(SyncDirectory(parent));
  // The old model (and links to what was carried over), now under the staging name.
  if (exists) {
    fs::remove_all(stage, ec);
    if (ec) {
      return absl::UnavailableError(
          fmt::format("the export is in {}; the model it replaced is left in {}: {}",
                      target.string(), stage.string(), ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace offload_train
