// memascend/safetensors.h: Hugging Face's safetensors checkpoints, read and written tensor
// by tensor (never a whole checkpoint in memory), with every structural fact checked.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto ckpt, memascend::SafetensorsCheckpoint::Open(dir));
//   MEMASCEND_ASSIGN_OR_RETURN(auto where, ckpt->Find("model.embed_tokens.weight"));
//   std::vector<float> rows(4096 * 16);
//   MEMASCEND_RETURN_IF_ERROR(where.file->Read(*where.tensor, 0,
//       {rows.data(), rows.size(), memascend::DType::kF32}));   // bf16 on disk, fp32 here
//
// Note [safetensors layout]: a file is an 8-byte little-endian header length N, N bytes of
// JSON (an object: per tensor {"dtype", "shape", "data_offsets": [begin, end]}, and an
// optional "__metadata__" object of strings), then the data region; offsets are bytes
// into the data region. Open() refuses (kDataLoss, naming the file and the tensor) a
// header that passes the end of the file, offsets that overlap, leave a gap or pass the
// end of the data region, and a byte range that does not match dtype x shape; and
// (kFailedPrecondition) a file that does not start like a safetensors file at all. A
// checkpoint directory holds model.safetensors, or model.safetensors.index.json whose
// "weight_map" names each tensor's shard.
//
// Thread-safety: a reader's Read may be called from several threads (pread). A writer
// is driven by one thread. Lifetime: Find's pointers live as long as the checkpoint.
#ifndef MEMASCEND_SAFETENSORS_H_
#define MEMASCEND_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/kernels.h>

namespace memascend {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as the file says: "F32", "F16", "BF16", "I64", ...
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  // bytes into the data region
  std::uint64_t end = 0;

  std::uint64_t elements() const noexcept;
  // The dtype MemAscend computes in: kInvalidArgument naming the dtype otherwise.
  absl::StatusOr<DType> Type() const;
};

// The element size of a safetensors dtype name; 0 for a name the format does not have.
std::size_t SafetensorsElementBytes(std::string_view dtype) noexcept;
// The safetensors name of a DType ("F32", "F16", "BF16").
std::string_view SafetensorsName(DType t) noexcept;

class SafetensorsReader {
 public:
  // Note [safetensors layout]. kNotFound for a missing file.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  ~SafetensorsReader();

  const std::string& path() const noexcept { return path_; }
  const std::vector<SafetensorsTensor>& tensors() const noexcept { return tensors_; }  // data order
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  const SafetensorsTensor* Find(std::string_view name) const;

  // Elements [first, first + out.elements) of `t` (one of tensors()), converted to
  // out.dtype. kInvalidArgument for a range past the tensor or a dtype not computed in;
  // kDataLoss for a short read (the file shrank since Open). Errors name the file.
  absl::Status Read(const SafetensorsTensor& t, std::uint64_t first, MutableTensorView out) const;

 private:
  struct File;  // the open file (a move-only descriptor)
  SafetensorsReader();
  std::string path_;
  std::unique_ptr<File> file_;
  std::uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: one file or shards with their index (Note [safetensors layout]).
class SafetensorsCheckpoint {
 public:
  // kNotFound when the directory has neither model.safetensors nor its index; kDataLoss
  // for an index naming a shard or tensor that is not there.
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& dir);
  struct Where {
    const SafetensorsReader* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  // kNotFound naming the tensor and the directory.
  absl::StatusOr<Where> Find(std::string_view name) const;
  std::vector<std::string> names() const;
  const std::string& dir() const noexcept { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, Where, std::less<>> where_;
};

// Writes one file: the tensors planned at Create, in that order, their bytes appended
// in order (each whole before the next), converted to each tensor's dtype. The file is
// written under `path + ".partial"` and renamed over `path` by Finish() after an fsync;
// a writer destroyed unfinished removes its partial file, so a failed export leaves no
// half checkpoint under the real name.
class SafetensorsWriter {
 public:
  // Offsets are computed here (shape x dtype). kAlreadyExists when `path` exists and
  // `overwrite` is false; kInvalidArgument for a bad or repeated name or dtype.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<SafetensorsTensor> tensors,
      const std::map<std::string, std::string>& metadata = {}, bool overwrite = false);
  ~SafetensorsWriter();

  // The next elements of the current tensor (moving to the next when one is whole).
  // kFailedPrecondition past the last tensor's end.
  absl::Status Append(TensorView data);
  // kFailedPrecondition when a tensor is still short of bytes; I/O errors as they come.
  absl::Status Finish();
  std::uint64_t bytes() const noexcept { return total_; }

 private:
  struct File;
  SafetensorsWriter();
  std::string path_, partial_;
  std::unique_ptr<File> file_;
  std::uint64_t data_offset_ = 0, total_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::size_t current_ = 0;
  std::uint64_t written_ = 0;  // bytes of the current tensor
  bool finished_ = false;
  std::vector<std::byte> buffer_;
};

}  // namespace memascend

#endif  // MEMASCEND_SAFETENSORS_H_
