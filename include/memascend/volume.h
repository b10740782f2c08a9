// memascend/volume.h: tensors stored in extents of a raw block device or one
// preallocated file, with crash-safe metadata and checksummed data.
//
//   MEMASCEND_RETURN_IF_ERROR(memascend::Volume::Format("/dev/nvme1n1", {}));
//   MEMASCEND_ASSIGN_OR_RETURN(auto volume, memascend::Volume::Open("/dev/nvme1n1", {}));
//   MEMASCEND_RETURN_IF_ERROR(volume->Put("layers.0.mlp.up", bytes,
//                                         memascend::Durability::kDurable, "bf16[11008,4096]"));
//   MEMASCEND_RETURN_IF_ERROR(volume->Get("layers.0.mlp.up", out));
//
// Note [commit order]: a durable object becomes visible only after its data and then
// its journal record are on stable storage (data written, fdatasync, journal write,
// fdatasync). Overwriting writes new extents and frees the old ones only after the
// commit, so a crash leaves the old or the new object, never a mix. Concurrent commits
// share the journal write and the flushes (group commit). A scratch object skips the
// journal: it lives for this open only and is gone after reopen.
//
// Note [staged puts]: PutStaged writes an object's data but defers its commit: this
// process sees the new object at once, the previous one keeps its extents, and a crash
// before the next Sync() leaves the previous object. Sync() commits every staged object
// in one journal write behind one pair of flushes, instead of a pair per Put (the tensor
// store writes back evicted tensors this way and syncs at Flush).
//
// Note [journal halves]: the journal region has two halves. Commits append to the live
// half; when it is full, the volume writes a snapshot of every durable object plus the
// new records into the other half, makes it durable, and only then writes the next
// superblock (the two superblocks alternate by generation) to point at it. On open:
// the newest valid superblock, replay of its half up to the last complete commit, free
// space rebuilt from the objects. A damaged journal block followed by valid later
// commits is kDataLoss unless allow_data_loss.
//
// Thread-safety: every method may be called from any thread. Reading or overwriting an
// object while another thread deletes or overwrites it is a race of the caller's; the
// data checksum reports it as kDataLoss rather than returning mixed bytes.
// Lifetime: one process opens a volume at a time (an exclusive lock on the target).
// The engine passed in options must outlive the volume.
#ifndef MEMASCEND_VOLUME_H_
#define MEMASCEND_VOLUME_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/io_engine.h>
#include <memascend/object_store.h>
#include <memascend/types.h>

namespace memascend {

struct VolumeFormatOptions {
  std::uint64_t size = 0;                // create/grow a regular file to this size
  std::uint32_t unit_bytes = 64 * 1024;  // allocation unit: a multiple of 4096
  std::uint64_t journal_bytes = 0;       // both halves; 0: capacity / 512 in [2 MiB, 256 MiB]
  bool force = false;                    // Note [foreign data] in block_target.h
  // Called while format writes the journal region (large targets take a while).
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
};

struct VolumeOpenOptions {
  bool verify_checksums = true;  // check each object's CRC-32C on Get()
  bool allow_data_loss = false;  // open a volume whose journal was damaged mid-way
  IoEngine* engine = nullptr;    // null: the volume creates its own (IoBackendChoice::kAuto)
  // How long to wait for the lock of another holder. A process that just died may hold
  // it for a moment: the kernel releases an io_uring's registered files asynchronously.
  std::chrono::milliseconds lock_wait{2000};
};

struct VolumeStats {
  std::string uuid;
  std::uint64_t generation = 0;
  std::uint64_t capacity_bytes = 0;  // of the target
  std::uint64_t data_bytes = 0;      // of the data region
  std::uint64_t used_bytes = 0;      // allocated to objects (whole units)
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free_extent_bytes = 0;
  double fragmentation = 0;  // 1 - largest free extent / free space
  std::uint32_t unit_bytes = 0;
  std::uint32_t block_bytes = 0;
  std::uint64_t objects = 0;
  std::uint64_t durable_objects = 0;
  std::uint64_t journal_bytes = 0;       // one half
  std::uint64_t journal_used_bytes = 0;  // of the live half
  std::uint64_t commits = 0;             // journal writes since open
  std::uint64_t compactions = 0;
};

struct FsckReport {
  bool clean = true;
  std::uint64_t objects = 0;
  std::uint64_t used_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::vector<std::string> errors;    // damage: clean is false
  std::vector<std::string> warnings;  // repaired or expected (a torn last commit)
};

class Volume final : public ObjectStore {
 public:
  // Writes an empty volume. Refuses foreign data unless forced; kInvalidArgument for
  // a bad unit or journal size or a target too small to hold anything.
  static absl::Status Format(const std::string& path, const VolumeFormatOptions& options);
  // kNotFound for a missing path; kFailedPrecondition if the target holds no MemAscend
  // volume (anything else: it is not touched); kUnavailable if another process has it
  // open (its lock is held past options.lock_wait) or a device is in use; kDataLoss if no
  // superblock is valid or the journal was damaged mid-way (docs/errors.md).
  static absl::StatusOr<std::unique_ptr<Volume>> Open(const std::string& path,
                                                      const VolumeOpenOptions& options);
  // Opens the volume at `path`, formatting one there first when the path does not exist
  // or is an empty regular file (format.size gives a new file's size; format.force is
  // ignored: nothing else is ever formatted); a volume in a regular file smaller than
  // format.size grows to it (Note [volume growth]). Errors as Format, Open and Grow;
  // kInvalidArgument for a missing path and format.size 0.
  static absl::StatusOr<std::unique_ptr<Volume>> OpenOrCreate(const std::string& path,
                                                              const VolumeFormatOptions& format,
                                                              const VolumeOpenOptions& open = {});
  ~Volume() override;
  Volume(const Volume&) = delete;
  Volume& operator=(const Volume&) = delete;

  // Stores `data` under `name` (1..255 bytes), replacing an object of that name per
  // Note [commit order]. kResourceExhausted if the volume or journal is full (the old
  // object, if any, stays); kInvalidArgument for a bad name or metadata over 16 KiB;
  // I/O errors as the engine reports them.
  absl::Status Put(std::string_view name, std::span<const std::byte> data, Durability durability,
                   std::string_view metadata = {}) override;
  // Note [staged puts]: a durable object committed by the next Sync(). Errors as Put().
  absl::Status PutStaged(std::string_view name, std::span<const std::byte> data,
                         std::string_view metadata = {}) override;
  // Commits every staged object. After a failure they stay staged.
  absl::Status Sync() override;
  // Note [selective commit] in object_store.h.
  absl::Status SyncOnly(std::span<const std::string> names) override;
  absl::Status DropStaged(std::span<const std::string> names) override;  // ObjectStore's
  // Reads the whole object into `out` (at least its size). kNotFound; kInvalidArgument
  // if `out` is too small; kDataLoss naming the object on a checksum mismatch.
  absl::StatusOr<std::size_t> Get(std::string_view name, std::span<std::byte> out) override;
  absl::StatusOr<ObjectInfo> Stat(std::string_view name) const override;
  std::vector<ObjectInfo> List() const override;
  std::uint64_t staged_bytes() const override;  // whole allocation units
  // Removes an object (durably, for a durable one). kNotFound.
  absl::Status Delete(std::string_view name) override;

  // Checks the volume's structures (and, with verify_data, every object's checksum).
  absl::StatusOr<FsckReport> Fsck(bool verify_data);
  // Note [volume growth]: a volume in a regular file grows to at least `size` bytes: the
  // file is extended (allocated), then both superblocks are rewritten, one after the
  // other, with the larger data region, which becomes free space. A crash between the two
  // leaves copies that differ in size alone, the newer the larger: Open uses the newer
  // (no object can be in the new region yet) and warns. kFailedPrecondition for a block
  // device; kResourceExhausted, and nothing changes, when the file system lacks the room.
  absl::Status Grow(std::uint64_t size);
  // Rewrites what is redundant: a damaged superblock copy gets the live superblock again
  // (as the next generation). True if something was rewritten; kDataLoss for two valid
  // copies of different geometry (which one is right cannot be told).
  absl::StatusOr<bool> RepairSuperblocks();
  VolumeStats stats() const;
  IoEngine* engine() const noexcept;

 private:
  struct Impl;
  explicit Volume(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_VOLUME_H_
