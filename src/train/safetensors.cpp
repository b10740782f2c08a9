#include <algorithm>
#include <cstring>
#include <fcntl.h>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include <memascend/safetensors.h>
#include <memascend/status.h>

#include "prim/file.h"
#include "prim/unique_fd.h"
#include "train/safetensors_header.h"
#include "util/json_reader.h"
#include "util/json_writer.h"

namespace memascend {
namespace {

// A header larger than this is not a checkpoint's (the format's own reader refuses
// 100 MB too): it would be read whole into memory.
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;
constexpr std::size_t kChunkBytes = 4u << 20;  // staged per read or write

absl::Status ReadFully(int fd, void* buffer, std::size_t length, std::uint64_t offset,
                       const std::string& path) {
  const std::int64_t n = prim::PreadFull(fd, buffer, length, offset);
  if (n < 0) return absl::ErrnoToStatus(static_cast<int>(-n), fmt::format("{}: read", path));
  if (static_cast<std::size_t>(n) < length) {
    return absl::DataLossError(fmt::format("{}: the file ends at byte {} (truncated)", path,
                                           offset + static_cast<std::uint64_t>(n)));
  }
  return absl::OkStatus();
}

absl::Status WriteFully(int fd, const void* buffer, std::size_t length, std::uint64_t offset,
                        const std::string& path) {
  const auto* p = static_cast<const std::byte*>(buffer);
  while (length > 0) {
    const std::int64_t n = prim::PwriteOnce(fd, p, length, offset);
    if (n == -EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(static_cast<int>(-n), fmt::format("{}: write", path));
    if (n == 0) return absl::DataLossError(fmt::format("{}: a write made no progress", path));
    p += n;
    length -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

// ---- the reader ---------------------------------------------------------------------------

struct SafetensorsReader::File {
  prim::UniqueFd fd;
};

SafetensorsReader::SafetensorsReader() = default;
SafetensorsReader::~SafetensorsReader() = default;

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  auto r = std::unique_ptr<SafetensorsReader>(new SafetensorsReader());
  r->path_ = path;
  r->file_ = std::make_unique<File>();
  MEMASCEND_ASSIGN_OR_RETURN(r->file_->fd, prim::OpenRegularFile(path));
  const int fd = r->file_->fd.get();
  MEMASCEND_ASSIGN_OR_RETURN(prim::FileFacts facts, prim::StatFile(fd));
  const std::uint64_t size = facts.size;
  if (size < 8) {
    return absl::FailedPreconditionError(
        fmt::format("{}: {} bytes is too short for a safetensors file", path, size));
  }
  unsigned char len_bytes[8];
  MEMASCEND_RETURN_IF_ERROR(ReadFully(fd, len_bytes, 8, 0, path));
  std::uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    return absl::FailedPreconditionError(
        fmt::format("{}: a header of {} bytes: not a safetensors file (or one this reader refuses)",
                    path, header_bytes));
  }
  if (header_bytes > size - 8) {
    return absl::DataLossError(fmt::format(
        "{}: the header of {} bytes passes the end of the {}-byte file", path, header_bytes, size));
  }
  std::string header(header_bytes, '\0');
  MEMASCEND_RETURN_IF_ERROR(ReadFully(fd, header.data(), header.size(), 8, path));
  r->data_offset_ = 8 + header_bytes;
  MEMASCEND_ASSIGN_OR_RETURN(train::ParsedHeader h,
                             train::ParseSafetensorsHeader(header, size - r->data_offset_, path));
  r->tensors_ = std::move(h.tensors);
  r->metadata_ = std::move(h.metadata);
  for (std::size_t i = 0; i < r->tensors_.size(); ++i) r->index_[r->tensors_[i].name] = i;
  return r;
}

const SafetensorsTensor* SafetensorsReader::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsReader::Read(const SafetensorsTensor& t, std::uint64_t first,
                                     MutableTensorView out) const {
  const absl::StatusOr<DType> type = t.Type();
  if (!type.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {}", path_, std::string(type.status().message())));
  }
  const DType from = *type;
  const std::uint64_t n = t.elements();
  if (first > n || out.elements > n - first) {
    return absl::InvalidArgumentError(fmt::format("{}: tensor '{}' has {} elements, not [{}, {})",
                                                  path_, t.name, n, first, first + out.elements));
  }
  const std::size_t esize = SizeOf(from);
  if (from == out.dtype) {
    return ReadFully(file_->fd.get(), out.data, out.elements * esize,
                     data_offset_ + t.begin + first * esize, path_);
  }
  std::vector<std::byte> stage(std::min<std::size_t>(kChunkBytes, out.elements * esize));
  const std::size_t per = stage.size() / esize;
  for (std::size_t done = 0; done < out.elements; done += per) {
    const std::size_t k = std::min(per, out.elements - done);
    MEMASCEND_RETURN_IF_ERROR(ReadFully(file_->fd.get(), stage.data(), k * esize,
                                        data_offset_ + t.begin + (first + done) * esize, path_));
    MEMASCEND_RETURN_IF_ERROR(
        Convert({stage.data(), k, from},
                {static_cast<std::byte*>(out.data) + done * SizeOf(out.dtype), k, out.dtype}));
  }
  return absl::OkStatus();
}

// ---- the checkpoint -----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& dir) {
  auto c = std::make_unique<SafetensorsCheckpoint>();
  c->dir_ = dir;
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  auto add_file = [&](const std::string& path) -> absl::StatusOr<const SafetensorsReader*> {
    MEMASCEND_ASSIGN_OR_RETURN(auto r, SafetensorsReader::Open(path));
    c->files_.push_back(std::move(r));
    return c->files_.back().get();
  };
  if (prim::PathExists(single)) {
    MEMASCEND_ASSIGN_OR_RETURN(const SafetensorsReader* r, add_file(single));
    for (const SafetensorsTensor& t : r->tensors()) c->where_[t.name] = {r, &t};
    return c;
  }
  if (!prim::PathExists(index)) {
    return absl::NotFoundError(fmt::format(
        "{}: neither model.safetensors nor model.safetensors.index.json is there", dir));
  }
  std::string text;
  {
    MEMASCEND_ASSIGN_OR_RETURN(prim::UniqueFd fd, prim::OpenRegularFile(index));
    MEMASCEND_ASSIGN_OR_RETURN(prim::FileFacts facts, prim::StatFile(fd.get()));
    if (facts.size > kMaxHeaderBytes)
      return absl::DataLossError(fmt::format("{}: {} bytes is not an index", index, facts.size));
    text.resize(facts.size);
    MEMASCEND_RETURN_IF_ERROR(ReadFully(fd.get(), text.data(), text.size(), 0, index));
  }
  auto parsed = util::ParseJson(text, train::kMaxHeaderValues);
  if (!parsed.ok())
    return absl::DataLossError(
        fmt::format("{}: {}", index, std::string(parsed.status().message())));
  const util::JsonValue* map = parsed->Find("weight_map");
  if (map == nullptr || !map->is_object())
    return absl::DataLossError(fmt::format("{}: no weight_map object", index));
  std::map<std::string, const SafetensorsReader*> shards;
  for (const auto& [name, v] : map->members()) {
    auto file = v.AsString();
    if (!file.ok() || file->empty() || file->find('/') != std::string::npos ||
        file->find('\0') != std::string::npos || *file == "." || *file == "..") {
      return absl::DataLossError(fmt::format(
          "{}: tensor '{}' is mapped to something that is not a file name", index, name));
    }
    auto it = shards.find(*file);
    if (it == shards.end()) {
      auto r = add_file(dir + "/" + *file);
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            fmt::format("{} (shard of {}, named by {}): {}", *file, dir, index,
                                        std::string(r.status().message())));
      }
      it = shards.emplace(*file, *r).first;
    }
    const SafetensorsTensor* t = it->second->Find(name);
    if (t == nullptr) {
      return absl::DataLossError(
          fmt::format("{}: names tensor '{}' in {}, which does not hold it", index, name, *file));
    }
    c->where_[name] = {it->second, t};
  }
  return c;
}

absl::StatusOr<SafetensorsCheckpoint::Where> SafetensorsCheckpoint::Find(
    std::string_view name) const {
  const auto it = where_.find(name);
  if (it == where_.end())
    return absl::NotFoundError(fmt::format("{}: the checkpoint has no tensor '{}'", dir_, name));
  return it->second;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, w] : where_) out.push_back(name);
  return out;
}

// ---- the writer ---------------------------------------------------------------------------

struct SafetensorsWriter::File {
  prim::UniqueFd fd;
};

SafetensorsWriter::SafetensorsWriter() = default;

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_ && file_ != nullptr && file_->fd.get() >= 0) {
    file_->fd = prim::UniqueFd();
    prim::RemoveQuietly(partial_);
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsTensor> tensors,
    const std::map<std::string, std::string>& metadata, bool overwrite) {
  if (!overwrite && prim::PathExists(path)) {
    return absl::AlreadyExistsError(
        fmt::format("{} exists; it is not replaced without the overwrite flag", path));
  }
  auto w = std::unique_ptr<SafetensorsWriter>(new SafetensorsWriter());
  w->path_ = path;
  w->partial_ = path + ".partial";
  std::map<std::string_view, int> seen;
  std::uint64_t at = 0;
  for (SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !seen.emplace(t.name, 0).second)
      return absl::InvalidArgumentError(
          fmt::format("{}: a bad or repeated tensor name '{}'", path, t.name));
    const std::size_t esize = SafetensorsElementBytes(t.dtype);
    if (esize == 0)
      return absl::InvalidArgumentError(
          fmt::format("{}: tensor '{}': dtype '{}'", path, t.name, t.dtype));
    // The file's bytes are counted in 64 bits: a shape past them is refused, never wrapped.
    constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
    std::uint64_t count = 1;
    for (std::uint64_t d : t.shape) {
      if (d != 0 && count > kMax / d)
        count = kMax;
      else
        count *= d;
    }
    if (count > (kMax - at) / esize) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: tensor '{}': its shape's bytes pass what a file can hold", path, t.name));
    }
    t.begin = at;
    t.end = at + count * esize;
    at = t.end;
  }
  util::JsonWriter j;
  j.BeginObject();
  if (!metadata.empty()) {
    j.Key("__metadata__").BeginObject();
    for (const auto& [k, v] : metadata) j.Field(k, v);
    j.EndObject();
  }
  for (const SafetensorsTensor& t : tensors) {
    j.Key(t.name).BeginObject().Field("dtype", t.dtype).Key("shape").BeginArray();
    for (std::uint64_t d : t.shape) j.Uint(d);
    j.EndArray().Key("data_offsets").BeginArray().Uint(t.begin).Uint(t.end).EndArray().EndObject();
  }
  j.EndObject();
  std::string header = j.str();
  header.resize((header.size() + 7) / 8 * 8, ' ');  // the data region 8-byte aligned
  w->tensors_ = std::move(tensors);
  w->total_ = 8 + header.size() + at;
  w->data_offset_ = 8 + header.size();
  w->file_ = std::make_unique<File>();
  // The partial file is made here, never opened over something there (O_EXCL, and
  // O_NOFOLLOW: a link there is not followed to its target), so the destructor removes
  // only a file of this writer's. One left by an earlier writer that died goes with
  // `overwrite` (unlink: a link, not its target).
  if (overwrite) prim::RemoveQuietly(w->partial_);
  auto fd = prim::Open(w->partial_, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (!fd.ok()) {
    if (absl::IsAlreadyExists(fd.status())) {
      return absl::AlreadyExistsError(fmt::format(
          "{} exists (an earlier write's, left by a crash, or not ours); it is not replaced "
          "without the overwrite flag",
          w->partial_));
    }
    return fd.status();
  }
  w->file_->fd = *std::move(fd);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  MEMASCEND_RETURN_IF_ERROR(WriteFully(w->file_->fd.get(), len, 8, 0, w->partial_));
  MEMASCEND_RETURN_IF_ERROR(
      WriteFully(w->file_->fd.get(), header.data(), header.size(), 8, w->partial_));
  while (w->current_ < w->tensors_.size() &&
         w->tensors_[w->current_].begin == w->tensors_[w->current_].end)
    ++w->current_;  // empty tensors are whole already
  return w;
}

absl::Status SafetensorsWriter::Append(TensorView data) {
  std::size_t done = 0;
  while (done < data.elements) {
    if (current_ >= tensors_.size())
      return absl::FailedPreconditionError(fmt::format("{}: bytes past the last tensor", path_));
    const SafetensorsTensor& t = tensors_[current_];
    MEMASCEND_ASSIGN_OR_RETURN(DType to, t.Type());
    const std::size_t esize = SizeOf(to);
    const std::size_t room = (t.end - t.begin - written_) / esize;
    const std::size_t k = std::min({room, data.elements - done, kChunkBytes / esize});
    const std::byte* src = static_cast<const std::byte*>(data.data) + done * SizeOf(data.dtype);
    const std::uint64_t offset = data_offset_ + t.begin + written_;
    if (to == data.dtype) {
      MEMASCEND_RETURN_IF_ERROR(WriteFully(file_->fd.get(), src, k * esize, offset, partial_));
    } else {
      buffer_.resize(k * esize);
      MEMASCEND_RETURN_IF_ERROR(Convert({src, k, data.dtype}, {buffer_.data(), k, to}));
      MEMASCEND_RETURN_IF_ERROR(
          WriteFully(file_->fd.get(), buffer_.data(), k * esize, offset, partial_));
    }
    written_ += k * esize;
    done += k;
    while (current_ < tensors_.size() &&
           written_ == tensors_[current_].end - tensors_[current_].begin) {
      ++current_;
      written_ = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (finished_) return absl::OkStatus();
  if (current_ < tensors_.size()) {
    return absl::FailedPreconditionError(
        fmt::format("{}: tensor '{}' has {} of its {} bytes", path_, tensors_[current_].name,
                    written_, tensors_[current_].end - tensors_[current_].begin));
  }
  MEMASCEND_RETURN_IF_ERROR(prim::Fsync(file_->fd.get()));
  file_->fd = prim::UniqueFd();
  MEMASCEND_RETURN_IF_ERROR(prim::Rename(partial_, path_));
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace memascend
