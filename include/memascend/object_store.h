// memascend/object_store.h: named objects of bytes on storage, the interface the tensor
// store and the versioned training state write through. Two implementations:
//   - Volume (memascend/volume.h): extents of one raw device or preallocated file, with a
//     crash-safe journal and checksummed data; the one to use;
//   - FileObjectStore (below): a directory with a file per object, the layout
//     ZeRO-Infinity's swapper uses (one .swp file per tensor, opened per transfer with
//     O_DIRECT). It exists to measure what the volume saves (bench/ablation.py) and for a
//     file system on which no volume file can be preallocated.
//
//   MEMASCEND_ASSIGN_OR_RETURN(auto files, memascend::FileObjectStore::Open("/nvme/swap", {}));
//   MEMASCEND_RETURN_IF_ERROR(files->Put("layers.0.mlp.up", bytes,
//   memascend::Durability::kScratch)); MEMASCEND_ASSIGN_OR_RETURN(auto store,
//   memascend::TensorStore::Open(files.get(), {}));
//
// Note [file store commits]: a FileObjectStore writes a scratch object in place (as
// DeepSpeed does): a failed write leaves that object lost (Get() is kDataLoss naming the
// failed write), never silently old or mixed bytes. A durable Put writes NAME.tmp,
// fdatasyncs it, renames it over NAME and fsyncs the directory. PutStaged writes NAME.tmp
// and renames it to NAME.new; Sync() does the rest for every staged object (fdatasync,
// rename over NAME, the directory's fsync; a failed flush of the directory is retried by
// the next Sync(), and a durable Put whose flush fails has still replaced the object, in
// this process at least). A put while Sync() runs on another thread writes its bytes
// meanwhile and waits for the commit only to rename its file into place, so it comes
// after that commit (an object staged again stays staged, with its newer bytes, for the
// next Sync). Each object is replaced atomically,
// the set is not (a crash inside Sync() can leave some objects new and some old; the
// versioned training state in two versions never overwrites the version its last commit
// names, so a crash still resumes from that commit, but a state in place, Note [state in
// place] in training_state.h, is not crash-atomic here: memascend-train's --storage
// files, an ablation, runs one so). Each file ends in a trailer block (magic, size,
// CRC-32C of the data, durability, metadata) read back by Open(); scratch files of an
// earlier open are removed by Open(), as a volume forgets its scratch objects.
//
// Thread-safety: every method of either may be called from any thread. Reading or
// overwriting an object while another thread deletes or overwrites it is a race of the
// caller's (the checksum reports it as kDataLoss). Lifetime: the engine passed in options
// must outlive the store; one process opens a directory at a time (a lock file).
#ifndef MEMASCEND_OBJECT_STORE_H_
#define MEMASCEND_OBJECT_STORE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/io_engine.h>
#include <memascend/types.h>

namespace memascend {

struct VolumeExtent {
  std::uint64_t offset = 0;  // bytes into the target
  std::uint64_t bytes = 0;
};

struct ObjectInfo {
  std::string name;
  std::uint64_t size = 0;
  std::string metadata;
  Durability durability = Durability::kDurable;
  std::uint32_t checksum = 0;         // CRC-32C of the data
  std::vector<VolumeExtent> extents;  // a volume's; empty for a file store
};

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;

  // Stores `data` under `name` (1..255 bytes), replacing an object of that name.
  // kResourceExhausted when storage is full; kInvalidArgument for a bad name or metadata
  // over 16 KiB; I/O errors as the engine reports them. What an implementation keeps of
  // the old object on a failure: Note [commit order] in volume.h, Note [file store
  // commits] above.
  virtual absl::Status Put(std::string_view name, std::span<const std::byte> data,
                           Durability durability, std::string_view metadata = {}) = 0;
  // A durable object committed by the next Sync(); this process sees it at once.
  virtual absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                                 std::string_view metadata = {}) = 0;
  // Commits every staged object. After a failure they stay staged.
  virtual absl::Status Sync() = 0;
  // Note [selective commit]: commits the staged objects named in `names` alone, as Sync()
  // commits them all (a volume: one journal commit; a file store: its renames, one by
  // one, no more atomic than its Sync); the others stay staged for a later one, and a
  // name that is not staged is passed over. For a writer whose commits must not carry what another
  // thread stages meanwhile (a state in place committing a batch of parts in the
  // background while the next parts are updated). After a failure they stay staged.
  virtual absl::Status SyncOnly(std::span<const std::string> names) = 0;
  // Forgets the staged objects named, as a crash would: the committed ones (or none) are
  // what this process sees again, and what the staged ones took is let go; a name not
  // staged is passed over. For a writer whose last commit failed and whose staged objects
  // no later commit may carry (a training state in place: Note [commit interval] in
  // training_state.h).
  virtual absl::Status DropStaged(std::span<const std::string> names) = 0;
  // Reads the whole object into `out` (at least its size). kNotFound; kInvalidArgument
  // if `out` is too small; kDataLoss naming the object on a checksum mismatch.
  virtual absl::StatusOr<std::size_t> Get(std::string_view name, std::span<std::byte> out) = 0;
  virtual absl::StatusOr<ObjectInfo> Stat(std::string_view name) const = 0;
  virtual std::vector<ObjectInfo> List() const = 0;
  // Removes an object (durably, for a durable one). kNotFound.
  virtual absl::Status Delete(std::string_view name) = 0;
  // Bytes of storage written by PutStaged and not yet committed by Sync(), beyond the
  // objects they replace (what a Sync would let go of). 0 for a store that stages nothing.
  virtual std::uint64_t staged_bytes() const { return 0; }
};

struct FileObjectStoreOptions {
  bool create = true;            // make the directory if it does not exist
  bool verify_checksums = true;  // check each object's CRC-32C on Get(), as a volume does
  IoEngine* engine = nullptr;    // null: the store creates its own (IoBackendChoice::kAuto)
  std::chrono::milliseconds lock_wait{2000};
};

class FileObjectStore final : public ObjectStore {
 public:
  // Opens `dir`: a new or empty directory, or one an earlier FileObjectStore made (its
  // marker file). kFailedPrecondition for a directory holding anything else, or a store
  // holding a file that is not an object (nothing in it is touched: give an empty
  // directory), for a path that is not a directory, and for a file system without
  // O_DIRECT (tmpfs); kNotFound for a missing directory without
  // options.create; kUnavailable if another process holds it past lock_wait; kDataLoss
  // for an object file whose trailer is damaged (named; nothing is removed).
  static absl::StatusOr<std::unique_ptr<FileObjectStore>> Open(
      const std::string& dir, const FileObjectStoreOptions& options);
  ~FileObjectStore() override;
  FileObjectStore(const FileObjectStore&) = delete;
  FileObjectStore& operator=(const FileObjectStore&) = delete;

  absl::Status Put(std::string_view name, std::span<const std::byte> data, Durability durability,
                   std::string_view metadata = {}) override;
  absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                         std::string_view metadata = {}) override;
  absl::Status Sync() override;
  absl::Status SyncOnly(std::span<const std::string> names) override;
  absl::Status DropStaged(std::span<const std::string> names) override;
  absl::StatusOr<std::size_t> Get(std::string_view name, std::span<std::byte> out) override;
  absl::StatusOr<ObjectInfo> Stat(std::string_view name) const override;
  std::vector<ObjectInfo> List() const override;
  absl::Status Delete(std::string_view name) override;
  // The staged files' data (NAME.new, each rounded up to a block).
  std::uint64_t staged_bytes() const override;

  const std::string& dir() const noexcept;
  // The file that holds `name` (escaped: '/', '%' and a leading '.' as %XX).
  std::string PathOf(std::string_view name) const;

 private:
  struct Impl;
  explicit FileObjectStore(std::unique_ptr<Impl> impl);
  absl::Status SyncStaged(const std::set<std::string_view>* only);  // null: every one
  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_OBJECT_STORE_H_
