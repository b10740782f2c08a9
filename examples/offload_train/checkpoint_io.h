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
#include <string>
#include <vector>

#include <absl/status/status.h>

#include <memascend/safetensors.h>

#include "hf_config.h"
#include "model.h"

namespace offload_train {

// The shape Hugging Face gives a slice's tensor ([out, in] for a Linear weight).
std::vector<std::uint64_t> LlamaSliceShape(const HfConfig& c, std::size_t group, const Slice& s);

// Group `group`'s parameters from the checkpoint into `out` (LlamaGroupParams floats).
absl::Status ImportLlamaGroup(const memascend::SafetensorsCheckpoint& ckpt, const HfConfig& c,
                              std::size_t group, float* out);

// The tensors of every group, in group order, under Hugging Face's names and shapes, in
// `dtype` ("F32", "F16", "BF16"): the plan a SafetensorsWriter takes.
std::vector<memascend::SafetensorsTensor> LlamaTensors(const HfConfig& c, std::string_view dtype);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_CHECKPOINT_IO_H_
