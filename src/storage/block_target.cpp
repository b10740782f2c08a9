#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

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

absl::StatusOr<BlockTarget> BlockTarget::Open(const std::string& path,
                                              const BlockTargetOptions& options) {
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  const bool device = exists && S_ISBLK(st.st_mode);
  if (exists && !device && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        fmt::format("{} is neither a block device nor a regular file", path));
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
      return absl::FailedPreconditionError(fmt::format(
          "{}: its file system does not support O_DIRECT (tmpfs?); put the volume on a disk-backed "
          "file system or a block device ({})",
          path, why));
    }
    return fd.status();
  }
  MEMASCEND_ASSIGN_OR_RETURN(prim::FileFacts facts, prim::StatFile(fd->get()));
  BlockTarget t;
  t.path_ = path;
  t.device_ = device;
  t.logical_block_ = static_cast<std::uint32_t>(facts.logical_block);
  t.io_block_ = static_cast<std::uint32_t>(std::max<std::size_t>(4096, facts.dio_align));
  t.size_ = facts.size;
  if (!device && options.create_size > 0) {
    if (facts.size < options.create_size)
      MEMASCEND_RETURN_IF_ERROR(prim::Preallocate(fd->get(), options.create_size));
    t.size_ = options.create_size;
  }
  if (device && options.create_size > 0 && options.create_size < facts.size)
    t.size_ = options.create_size;
  if (options.check_signatures && !options.force && t.size_ > 0) {
    const std::size_t n = std::min<std::uint64_t>(kHeadBytes, t.size_) / t.io_block_ * t.io_block_;
    if (n > 0) {
      std::unique_ptr<std::byte, decltype(&std::free)> head(
          static_cast<std::byte*>(std::aligned_alloc(t.io_block_, n)), &std::free);
      const std::int64_t got = prim::PreadOnce(fd->get(), head.get(), n, 0);
      if (got < 0)
        return absl::ErrnoToStatus(static_cast<int>(-got),
                                   fmt::format("read the head of {}", path));
      if (auto sig = DetectSignature({head.get(), static_cast<std::size_t>(got)});
          sig.has_value()) {
        return absl::FailedPreconditionError(fmt::format(
            "{} carries a {} signature: refusing to overwrite it (force to override)", path, *sig));
      }
    }
  }
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
