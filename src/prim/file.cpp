#include "prim/file.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/stat.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>

namespace memascend::prim {

std::int64_t PreadOnce(int fd, void* buffer, std::size_t length, std::uint64_t offset) noexcept {
  const ssize_t n = ::pread(fd, buffer, length, static_cast<off_t>(offset));
  return n < 0 ? -errno : n;
}

std::int64_t PwriteOnce(int fd, const void* buffer, std::size_t length,
                        std::uint64_t offset) noexcept {
  const ssize_t n = ::pwrite(fd, buffer, length, static_cast<off_t>(offset));
  return n < 0 ? -errno : n;
}

std::int64_t PreadFull(int fd, void* buffer, std::size_t length, std::uint64_t offset) noexcept {
  auto* p = static_cast<std::byte*>(buffer);
  std::size_t done = 0;
  while (done < length) {
    const std::int64_t n = PreadOnce(fd, p + done, length - done, offset + done);
    if (n == -EINTR) continue;
    if (n < 0) return n;
    if (n == 0) break;  // the end of the file
    done += static_cast<std::size_t>(n);
  }
  return static_cast<std::int64_t>(done);
}

absl::StatusOr<FileFacts> StatFile(int fd) {
  FileFacts facts;
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return absl::ErrnoToStatus(errno, "fcntl(F_GETFL)");
  facts.direct = (flags & O_DIRECT) != 0;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return absl::ErrnoToStatus(errno, "fstat");
  facts.block_device = S_ISBLK(st.st_mode);
  if (facts.block_device) {
    std::uint64_t bytes = 0;
    int logical = 0;
    if (::ioctl(fd, BLKGETSIZE64, &bytes) != 0)
      return absl::ErrnoToStatus(errno, "ioctl(BLKGETSIZE64)");
    if (::ioctl(fd, BLKSSZGET, &logical) != 0)
      return absl::ErrnoToStatus(errno, "ioctl(BLKSSZGET)");
    facts.size = bytes;
    facts.logical_block = static_cast<std::size_t>(logical);
  } else {
    facts.size = static_cast<std::uint64_t>(st.st_size);
    facts.logical_block = 512;
  }
  if (!facts.direct) return facts;
  std::size_t align = facts.block_device ? facts.logical_block : 4096;
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align != 0) {
    align = std::max<std::size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
  }
#endif
  facts.dio_align = align;
  return facts;
}

absl::Status Preallocate(int fd, std::uint64_t bytes) {
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    return absl::ErrnoToStatus(errno, fmt::format("fallocate({} bytes)", bytes));
  }
  return absl::OkStatus();
}

absl::Status Fsync(int fd) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return absl::ErrnoToStatus(errno, "fsync");
  return absl::OkStatus();
}

absl::Status Rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    return absl::ErrnoToStatus(errno, fmt::format("rename({}, {})", from, to));
  return absl::OkStatus();
}

void RemoveQuietly(const std::string& path) noexcept { ::unlink(path.c_str()); }

bool PathExists(const std::string& path) noexcept {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

absl::StatusOr<std::uint64_t> FreeBytes(const std::string& path) {
  struct statvfs v {};
  if (::statvfs(path.c_str(), &v) != 0)
    return absl::ErrnoToStatus(errno, fmt::format("statvfs({})", path));
  return static_cast<std::uint64_t>(v.f_bavail) * static_cast<std::uint64_t>(v.f_frsize);
}

absl::StatusOr<UniqueFd> MakeEventFd() {
  const int fd = ::eventfd(0, EFD_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, "eventfd");
  return UniqueFd(fd);
}

void SignalEventFd(int fd) noexcept {
  const std::uint64_t one = 1;
  ssize_t n;
  do {
    n = ::write(fd, &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
}

}  // namespace memascend::prim
