// prim/file.h: file and block-device system calls for direct I/O.
#ifndef MEMASCEND_SRC_PRIM_FILE_H_
#define MEMASCEND_SRC_PRIM_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include <absl/status/statusor.h>

#include "prim/unique_fd.h"

namespace memascend::prim {

// One pread/pwrite attempt: bytes transferred, or -errno. No retries (the engine
// checks and retries, Note [checked completions]).
std::int64_t PreadOnce(int fd, void* buffer, std::size_t length, std::uint64_t offset) noexcept;
std::int64_t PwriteOnce(int fd, const void* buffer, std::size_t length,
                        std::uint64_t offset) noexcept;
// `length` bytes at `offset`, read through short reads and EINTR (a buffered descriptor:
// a file's metadata, a sample): the bytes read, fewer only where the file ends, or -errno.
std::int64_t PreadFull(int fd, void* buffer, std::size_t length, std::uint64_t offset) noexcept;

struct FileFacts {
  bool direct = false;  // opened with O_DIRECT
  bool block_device = false;
  std::uint64_t size = 0;     // bytes (device capacity for a block device)
  std::size_t dio_align = 1;  // offset, length and memory alignment for O_DIRECT; 1 if buffered
  std::size_t logical_block = 512;
};
absl::StatusOr<FileFacts> StatFile(int fd);

// Grows a regular file to at least `bytes` with allocated blocks (fallocate mode 0).
absl::Status Preallocate(int fd, std::uint64_t bytes);

// Bytes an unprivileged writer may still allocate on the file system holding `path`
// (statvfs: f_bavail x f_frsize).
absl::StatusOr<std::uint64_t> FreeBytes(const std::string& path);

// fsync(2); rename(2), which replaces `to`; unlink(2), quiet about a missing file.
absl::Status Fsync(int fd);
absl::Status Rename(const std::string& from, const std::string& to);
void RemoveQuietly(const std::string& path) noexcept;
// Whether there is an entry at `path`: a symlink counts whether or not its target exists
// (lstat), so a check before making a file never misses a link the make would follow.
bool PathExists(const std::string& path) noexcept;

// An eventfd (counter semantics, blocking, close-on-exec).
absl::StatusOr<UniqueFd> MakeEventFd();
void SignalEventFd(int fd) noexcept;

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_FILE_H_
