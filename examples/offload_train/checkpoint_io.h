// A Hugging Face checkpoint's tensors into the trainer's groups and back, slice by slice:
// each slice of a group (GroupLayout) is one tensor of the checkpoint under its Hugging
// Face name (HfGroupTensors), so a model imports and exports group by group, never whole.
//
// Layouts: Llama's tensors are nn.Linear's [out, in], as the groups hold them. GPT-2's
// Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are stored [in, out]
// and transposed on the way in and out; its names carry "transformer." (as
// GPT2LMHeadModel saves them) and are found without it too (the original checkpoints);
// buffers such as attn.bias are not read; a tied head (tie_word_embeddings, GPT-2's
// default) has no tensor of its own.
//
// Errors name the tensor and the file: a tensor missing, a shape other than the config's,
// a dtype the trainer does not read, a truncated file.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/status.h>
#include <absl/status/statusor.h>

#include <memascend/kernels.h>
#include <memascend/safetensors.h>

#include "model.h"

namespace offload_train {

// One slice of a group as a Hugging Face checkpoint stores it.
struct HfTensorSlice {
  Slice slice;                       // where it is in the group's flat array
  std::string name;                  // Hugging Face's name
  std::vector<std::uint64_t> shape;  // as stored
  bool transposed = false;           // stored [in, out]; the group holds [out, in]
};

// Group `group`'s slices of a Hugging Face model (c.hf set), in the group's order.
std::vector<HfTensorSlice> HfGroupTensors(const ModelConfig& c, std::size_t group);
// Every group's tensors in group order, in `dtype` ("F32", "F16", "BF16"): the plan a
// SafetensorsWriter takes.
std::vector<memascend::SafetensorsTensor> HfTensors(const ModelConfig& c, std::string_view dtype);

// The dtype the checkpoint stores group `group` in: its tensors' where they agree, fp32
// where they differ (each converts to fp32 exactly); an import holds the group in it.
absl::StatusOr<memascend::DType> HfGroupDType(const memascend::SafetensorsCheckpoint& ckpt,
                                              const ModelConfig& c, std::size_t group);
// Group `group`'s parameters from the checkpoint into `out` (GroupParams elements, in
// out's dtype: F32, F16 or BF16, converted from the file's as needed).
absl::Status ImportHfGroup(const memascend::SafetensorsCheckpoint& ckpt, const ModelConfig& c,
                           std::size_t group, memascend::MutableTensorView out);

// fn(tensor, data) for each of group g's tensors in order, `data` its elements in the
// stored layout (fp32, from the group's `params`; valid during the call).
absl::Status ForEachHfTensor(
    const ModelConfig& c, std::size_t group, const float* params,
    const std::function<absl::Status(const HfTensorSlice&, const float*)>& fn);

struct HfExportOptions {
  std::string dtype = "F32";  // of every tensor: "F32", "F16" or "BF16"
  // A file holds at most this many bytes of tensors (a larger tensor gets a file of its
  // own); more than one file: model-0000i-of-0000n.safetensors and their index.
  std::uint64_t shard_bytes = 5'000'000'000;  // Hugging Face's default max_shard_size
  bool overwrite = false;                     // replace an earlier export in the directory
  // The most elements of a tensor read (and written) at a time: Note [tied head] in run.h.
  std::size_t piece_elements = std::size_t{4} << 20;  // 16 MiB of fp32
};

// The dtype name of a safetensors export for config.json's torch_dtype ("F16": "float16").
std::string TorchDtypeName(std::string_view safetensors_dtype);

// Writes a Hugging Face model directory: config.json and the weights under Hugging Face's
// names and layouts, in group order, read through `read` a piece at a time (below), so
// no group is in memory whole. `dir` is created if missing.
// Without `overwrite`, a directory holding config.json or model*.safetensors* is refused
// (kAlreadyExists, naming the file).
//
// Note [atomic export]: the export becomes visible whole or not at all. It is written into
// a staging directory beside `dir` (".<name>.memascend-export", same file system), every
// file fsynced; what else `dir` holds (a tokenizer, a README: regular files hard-linked,
// copied where links fail; folders moved, last) is carried into it; then one
// renameat2(RENAME_EXCHANGE) puts it in `dir`'s place (a file system without the exchange:
// two renames, `dir` absent for a moment, never mixed), and the old model, now under the
// staging name, is removed, its stale shards with it. A failure before the swap removes
// the staging and moves any folder back. A kill -9 leaves `dir` old or new, whole; the
// next export removes the staging left behind when it holds only model files and files
// `dir` holds too, and refuses, naming it, when it holds anything else (a folder moved in
// just before the kill). Through a symbolic link, the linked directory is replaced.
// `read` gives elements [first, first + count) of group g's weights (fp32) into `out`,
// asked for in the files' order (the groups in order, each range once), at most
// o.piece_elements at a time but for a tensor the file holds transposed (GPT-2's Conv1D
// weights, asked for whole). kInvalidArgument for piece_elements 0.
using GroupRangeReader =
    std::function<absl::Status(std::size_t g, std::size_t first, std::size_t count, float* out)>;
absl::Status ExportHfModel(const ModelConfig& c, const std::string& dir, const HfExportOptions& o,
                           const GroupRangeReader& read);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_
