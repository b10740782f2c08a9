// A Hugging Face checkpoint's tensors into the trainer's groups and back, slice by slice:
// each slice of a group (LlamaGroupLayout) is one tensor of the checkpoint under its
// Hugging Face name, read straight into the group's flat array in fp32 (whatever the
// file's dtype: F32, F16, BF16), so a model imports group by group, never whole.
//
// Errors name the tensor and the file: a tensor missing, a shape other than the
// config's, a dtype the trainer does not read.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <absl/status/status.h>
#include <absl/status/statusor.h>

#include <memascend/safetensors.h>

#include "hf_config.h"
#include "model.h"

namespace offload_train {

// The shape Hugging Face gives a slice's tensor ([out, in] for a Linear weight).
std::vector<std::uint64_t> LlamaSliceShape(const HfConfig& c, std::size_t group, const Slice& s);

// Group `group`'s parameters from the checkpoint into `out` (LlamaGroupParams elements,
// in out's dtype: F32, F16 or BF16, converted from the file's as needed).
absl::Status ImportLlamaGroup(const memascend::SafetensorsCheckpoint& ckpt, const HfConfig& c,
                              std::size_t group, memascend::MutableTensorView out);
// The dtype the checkpoint stores group `group` in (its first tensor's): an import needs
// no more memory than the group in that dtype.
absl::StatusOr<memascend::DType> LlamaGroupDType(const memascend::SafetensorsCheckpoint& ckpt,
                                                 const HfConfig& c, std::size_t group);

// The tensors of every group, in group order, under Hugging Face's names and shapes, in
// `dtype` ("F32", "F16", "BF16"): the plan a SafetensorsWriter takes.
std::vector<memascend::SafetensorsTensor> LlamaTensors(const HfConfig& c, std::string_view dtype);

struct HfExportOptions {
  std::string dtype = "F32";  // of every tensor: "F32", "F16" or "BF16"
  // A file holds at most this many bytes of tensors (a larger tensor gets a file of its
  // own); more than one file: model-0000i-of-0000n.safetensors and their index.
  std::uint64_t shard_bytes = 5'000'000'000;  // Hugging Face's default max_shard_size
  bool overwrite = false;                     // replace an earlier export in the directory
};

// The dtype name of a safetensors export for config.json's torch_dtype ("F16": "float16").
std::string TorchDtypeName(std::string_view safetensors_dtype);

// Writes a Hugging Face model directory: config.json and the weights under Hugging Face's
// names, in group order, `group(g)` giving group g's parameters in fp32 (valid until the
// next call), so one group is in memory at a time. `dir` is created if missing. Without
// `overwrite`, a directory holding config.json or model*.safetensors* is refused
// (kAlreadyExists, naming the file). Each file is written under a temporary name and
// renamed when whole (SafetensorsWriter); config.json comes last, so a directory with a
// config.json holds a whole export.
absl::Status ExportHfModel(const HfConfig& c, const std::string& dir, const HfExportOptions& o,
                           const std::function<absl::StatusOr<const float*>(std::size_t)>& group);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_
