// memascend/block_target.h: a block device or a preallocated file, opened for direct I/O.
//
//   memascend::BlockTargetOptions o;
//   o.create_size = 64ull << 30;  // a regular file is created and preallocated
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::BlockTarget t, memascend::BlockTarget::Open(path, o));
//
// Note [foreign data]: opening with check_signatures refuses a target that is mounted or
// held by another program (exclusive open of a device, kUnavailable), whose first blocks
// carry the signature of a file system or partition table (ext2/3/4, XFS, Btrfs, GPT, MBR,
// LUKS, swap) or of an existing MemAscend volume, or whose sampled blocks (the head, the
// middle, the last block; the whole of a file under 72 KiB) hold any other non-zero bytes, unless
// `force` is set: only a new or empty file or a target of zeros is ours without asking. A
// create_size beyond the file system's free space is refused before anything is created
// (kResourceExhausted), and a file this call created is removed when it fails. A file on a file
// system without O_DIRECT (tmpfs) is refused with the reason.
//
// Thread-safety: a BlockTarget is immutable after Open(); its fd may be used from any
// thread. Lifetime: move-only; the fd is closed on destruction.
#ifndef MEMASCEND_BLOCK_TARGET_H_
#define MEMASCEND_BLOCK_TARGET_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <absl/status/statusor.h>

namespace memascend {

struct BlockTargetOptions {
  std::uint64_t create_size = 0;  // regular files: create and preallocate to this size
  bool check_signatures = false;  // Note [foreign data]
  bool force = false;             // overrides the signature check
  // What a refusal of the signature check names as its override: the flag or option of
  // the caller that sets `force` (a benchmark names its own, --destroy-data).
  std::string override_hint = "--force to override (VolumeFormatOptions::force in the API)";
};

class BlockTarget {
 public:
  static absl::StatusOr<BlockTarget> Open(const std::string& path,
                                          const BlockTargetOptions& options);

  BlockTarget(BlockTarget&& other) noexcept;
  BlockTarget& operator=(BlockTarget&& other) noexcept;
  BlockTarget(const BlockTarget&) = delete;
  BlockTarget& operator=(const BlockTarget&) = delete;
  ~BlockTarget();

  int fd() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t size() const noexcept { return size_; }
  std::uint32_t logical_block() const noexcept { return logical_block_; }
  // The I/O block: offsets, lengths and buffers of direct I/O align to it.
  std::uint32_t io_block() const noexcept { return io_block_; }
  bool is_device() const noexcept { return device_; }

  // fdatasync: everything written so far is on stable storage.
  absl::Status Sync() const;
  // A regular file to at least `bytes`, allocated (fallocate); kFailedPrecondition for a
  // device, kResourceExhausted when the file system lacks the room (nothing changes).
  absl::Status Grow(std::uint64_t bytes);
  absl::Status Close();

 private:
  BlockTarget() = default;
  int fd_ = -1;
  std::string path_;
  std::uint64_t size_ = 0;
  std::uint32_t logical_block_ = 512;
  std::uint32_t io_block_ = 4096;
  bool device_ = false;
};

// The name of the file system, partition table or volume whose signature starts
// `head` (the target's first 68 KiB or less), if any: "ext4", "xfs", "btrfs", "gpt",
// "mbr", "luks", "swap", "memascend".
std::optional<std::string> DetectSignature(std::span<const std::byte> head);

}  // namespace memascend

#endif  // MEMASCEND_BLOCK_TARGET_H_
