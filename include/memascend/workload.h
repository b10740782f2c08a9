// memascend/workload.h: the parameter shapes of a model, read from a workload file.
//
// Format (data/workloads/README.md): '#' comment lines, the first of which may read
// "# <model>: ..."; then one line per parameter tensor, `name<TAB>shape`, the shape's
// dimensions separated by commas.
//
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::Workload w,
//                              memascend::LoadWorkload("data/workloads/llama-2-7b.tsv"));
//   // w.tensors[0].name == "model.embed_tokens.weight", w.tensors[0].numel == 131072000
//   for (const memascend::TensorGroup& g : memascend::GroupByLayer(w)) { ... }
//
// Thread-safety: plain values and pure functions.
#ifndef MEMASCEND_WORKLOAD_H_
#define MEMASCEND_WORKLOAD_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

namespace memascend {

struct WorkloadTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::uint64_t numel = 0;
  int layer = -1;  // the first all-digit component of the dotted name; -1 if none
};

struct Workload {
  std::string name;  // from the header comment, else the file's stem
  std::vector<WorkloadTensor> tensors;
  std::uint64_t total_parameters = 0;
  std::uint64_t largest_numel = 0;
};

// Parses workload text. kInvalidArgument naming the line for a missing tab, an empty
// or non-numeric dimension, a zero dimension, an element count that overflows, or a
// file without tensors.
absl::StatusOr<Workload> ParseWorkload(std::string_view text, std::string_view fallback_name);
absl::StatusOr<Workload> LoadWorkload(const std::string& path);

// Consecutive tensors with the same layer index (or runs of tensors outside any
// layer: embeddings before, final norm and head after) form one group, in file order:
// the unit in which layer-wise training streams parameters.
struct TensorGroup {
  int layer = -1;
  std::vector<std::size_t> tensors;  // indices into Workload::tensors
  std::uint64_t numel = 0;
};
std::vector<TensorGroup> GroupByLayer(const Workload& workload);

}  // namespace memascend

#endif  // MEMASCEND_WORKLOAD_H_
