#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memascend/block_target.h>
#include <memascend/status.h>

#include "prim/file.h"
#include "prim/unique_fd.h"
#include "storage/format.h"

namespace memascend {
namespace {

constexpr std::size_t kHeadBytes = 72 * 1024;  // Btrfs keeps its magic at 64 KiB + 64

bool At(std::span<const std::byte> head, std::size_t offset, std::string_view magic) {
  return head.size() >= offset + magic.size() &&
         std::memcmp(head.data() + offset, magic.data(), magic.size()) == 0;
}

}  // namespace

std::optional<std::string> DetectSignature(std::span<const std::byte> head) {
  std::uint64_t magic = 0;
  for (std::size_t off : {std::size_t{0}, std::size_t{storage::kMetaBlock}}) {
    if (head.size() >= off + 8) {
      std::memcpy(&magic, head.data() + off, 8);
      if (magic == storage::kSuperMagic) return "memascend";
    }
  }
  if (At(head, 0, "XFSB")) return "xfs";
  if (At(head, 0, "LUKS\xba\xbe")) return "luks";
  if (At(head, 0x10040, "_BHRfS_M")) return "btrfs";
  if (At(head, 1080, "\x53\xef")) return "ext4";  // ext2/3/4 s_magic 0xEF53
  if (At(head, 512, "EFI PART") || At(head, 4096, "EFI PART")) return "gpt";
  if (At(head, 4086, "SWAPSPACE2") || At(head, 4086, "SWAP-SPACE")) return "swap";
  if (At(head, 510, "\x55\xaa")) return "mbr";
  return std::nullopt;
}

namespace {

// Note [foreign data]: refuses a target whose head carries a known signature, or whose
// sampled ranges hold anything but zeros: the head (the first 72 KiB, so the whole of a
// small file), one block at the middle and the last block, each checked whatever the size
// (a sample inside the head is already covered, the others are still read). Only an empty
// target, a target of zeros or (forced) anything else is overwritten. The samples are read
// through a buffered descriptor: a file's size need not be a multiple of the direct-I/O
// block, and a file shorter than one block is data all the same.
absl::Status CheckForeignData(const std::string& path, std::uint64_t size, std::uint64_t block,
                              const std::string& override_hint) {
  prim::UniqueFd plain(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (plain.get() < 0)
    return absl::ErrnoToStatus(errno, fmt::format("open {} to check what it holds", path));
  const std::size_t head_bytes =
      static_cast<std::size_t>(std::min<std::uint64_t>(kHeadBytes, size));
  std::vector<std::byte> buf(std::max<std::size_t>(head_bytes, block));
  const std::int64_t got = prim::PreadFull(plain.get(), buf.data(), head_bytes, 0);
  if (got < 0)
    return absl::ErrnoToStatus(static_cast<int>(-got), fmt::format("read the head of {}", path));
  const std::span<const std::byte> head(buf.data(), static_cast<std::size_t>(got));
  if (auto sig = DetectSignature(head); sig.has_value()) {
    return absl::FailedPreconditionError(fmt::format(
        "{} carries a {} signature: refusing to overwrite it: {}", path, *sig, override_hint));
  }
  const auto first_nonzero = [](std::span<const std::byte> b) -> std::optional<std::size_t> {
    const auto it = std::find_if(b.begin(), b.end(), [](std::byte x) { return x != std::byte{0}; });
    if (it == b.end()) return std::nullopt;
    return static_cast<std::size_t>(it - b.begin());
  };
  std::optional<std::uint64_t> found = first_nonzero(head);
  const std::uint64_t middle = size / 2 / block * block;
  const std::uint64_t last = size > block ? size - block : 0;  // the last `block` bytes
  for (const std::uint64_t at : {middle, last}) {
    if (found.has_value()) break;
    const std::uint64_t length = std::min<std::uint64_t>(block, size - at);
    if (at + length <= head.size()) continue;  // inside the head: already checked
    const std::int64_t r =
        prim::PreadFull(plain.get(), buf.data(), static_cast<std::size_t>(length), at);
    if (r < 0) {
      return absl::ErrnoToStatus(static_cast<int>(-r),
                                 fmt::format("read {} bytes of {} at offset {}", length, path, at));
    }
    if (auto off = first_nonzero({buf.data(), static_cast<std::size_t>(r)}); off.has_value())
      found = at + *off;
  }
  if (!found.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "{} holds {} bytes of data that is not a MemAscend volume or a format MemAscend knows "
      "(non-zero bytes at offset {}): refusing to overwrite it: give an empty or new file, or "
      "{}",
      path, size, *found, override_hint));
}
}  // namespace

absl::StatusOr<BlockTarget> BlockTarget::Open(const std::string& path,
                                              const BlockTargetOptions& options) {
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  const bool device = exists && S_ISBLK(st.st_mode);
  if (exists && !device && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        fmt::format("{} is neither a block device nor a regular file", path));
  }
  // Note [foreign data]: a size the file system cannot hold is refused before anything
  // is created or written.
  if (!device && options.create_size > 0) {
    const std::uint64_t have = exists ? static_cast<std::uint64_t>(st.st_size) : 0;
    if (options.create_size > have) {
      const std::string dir = path.find('/') == std::string::npos
                                  ? std::string(".")
                                  : path.substr(0, std::max<std::size_t>(path.rfind('/'), 1));
      auto free_bytes = prim::FreeBytes(exists ? path : dir);
      if (free_bytes.ok() && options.create_size - have > *free_bytes) {
        return absl::ResourceExhaustedError(fmt::format(
            "{} needs {} more bytes but its file system has {} free: nothing was written", path,
            options.create_size - have, *free_bytes));
      }
    }
  }
  int flags = O_RDWR | O_DIRECT;
  if (device) flags |= O_EXCL;  // fails with EBUSY if mounted or held exclusively
  if (!device && options.create_size > 0) flags |= O_CREAT;
  auto fd = prim::Open(path, flags, 0644);
  if (!fd.ok()) {
    const std::string why(fd.status().message());
    if (device && fd.status().code() == absl::ErrnoToStatus(EBUSY, "").code() &&
        why.find("busy") != std::string::npos) {
      return absl::UnavailableError(
          fmt::format("{} is in use (mounted, or held by another program): {}", path, why));
    }
    if (why.find("Invalid argument") != std::string::npos) {
      if (!exists) ::unlink(path.c_str());
      return absl::FailedPreconditionError(fmt::format(
          "{}: its file system does not support O_DIRECT (tmpfs?); put the volume on a disk-backed "
          "file system or a block device ({})",
          path, why));
    }
    return fd.status();
  }
  // A file this call created is removed again if the call fails.
  struct RemoveIfFailed {
    const std::string* path;
    bool armed;
    ~RemoveIfFailed() {
      if (armed) ::unlink(path->c_str());
    }
  } created{&path, !exists};
  MEMASCEND_ASSIGN_OR_RETURN(prim::FileFacts facts, prim::StatFile(fd->get()));
  BlockTarget t;
  t.path_ = path;
  t.device_ = device;
  t.logical_block_ = static_cast<std::uint32_t>(facts.logical_block);
  t.io_block_ = static_cast<std::uint32_t>(std::max<std::size_t>(4096, facts.dio_align));
  t.size_ = facts.size;
  if (options.check_signatures && !options.force && facts.size > 0) {
    MEMASCEND_RETURN_IF_ERROR(
        CheckForeignData(path, facts.size, t.io_block_, options.override_hint));
  }
  if (!device && options.create_size > 0) {
    if (facts.size < options.create_size)
      MEMASCEND_RETURN_IF_ERROR(prim::Preallocate(fd->get(), options.create_size));
    t.size_ = options.create_size;
  }
  if (device && options.create_size > 0 && options.create_size < facts.size)
    t.size_ = options.create_size;
  created.armed = false;
  t.fd_ = fd->Release();
  return t;
}

BlockTarget::BlockTarget(BlockTarget&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)),
      path_(std::move(o.path_)),
      size_(o.size_),
      logical_block_(o.logical_block_),
      io_block_(o.io_block_),
      device_(o.device_) {}

BlockTarget& BlockTarget::operator=(BlockTarget&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    size_ = o.size_;
    logical_block_ = o.logical_block_;
    io_block_ = o.io_block_;
    device_ = o.device_;
  }
  return *this;
}

BlockTarget::~BlockTarget() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status BlockTarget::Grow(std::uint64_t bytes) {
  if (device_) {
    return absl::FailedPreconditionError(
        fmt::format("{} is a block device: it cannot grow", path_));
  }
  if (bytes <= size_) return absl::OkStatus();
  if (absl::Status s = prim::Preallocate(fd_, bytes); !s.ok()) {
    const std::string why(s.message());
    if (absl::IsResourceExhausted(s) || why.find("No space") != std::string::npos) {
      return absl::ResourceExhaustedError(
          fmt::format("{}: no room to grow to {} bytes: {}", path_, bytes, why));
    }
    return s;
  }
  size_ = bytes;
  return absl::OkStatus();
}

absl::Status BlockTarget::Sync() const {
  int rc;
  do {
    rc = ::fdatasync(fd_);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return absl::ErrnoToStatus(errno, fmt::format("fdatasync({})", path_));
  return absl::OkStatus();
}

absl::Status BlockTarget::Close() {
  if (fd_ < 0) return absl::OkStatus();
  if (::close(std::exchange(fd_, -1)) != 0) return absl::ErrnoToStatus(errno, "close");
  return absl::OkStatus();
}

}  // namespace memascend
