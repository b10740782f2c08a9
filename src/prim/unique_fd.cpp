#include "prim/unique_fd.h"

#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

namespace memascend::prim {

void UniqueFd::Reset() noexcept {
  if (fd_ >= 0) {
    // Linux releases the descriptor even when close() fails; never retry (EINTR too).
    ::close(std::exchange(fd_, -1));
  }
}

absl::Status UniqueFd::Close() {
  if (fd_ < 0) return absl::OkStatus();
  if (::close(std::exchange(fd_, -1)) != 0) {
    return absl::ErrnoToStatus(errno, "close");
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> Open(const std::string& path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    std::string what = fmt::format("open({})", path);
    if (err == ENOENT && (flags & O_CREAT) != 0) {  // only a folder on the way can be missing
      const std::size_t slash = path.rfind('/');
      what += fmt::format(" (the folder {} does not exist; nothing makes it)",
                          slash == std::string::npos ? std::string(".")
                          : slash == 0               ? std::string("/")
                                                     : path.substr(0, slash));
    }
    return absl::ErrnoToStatus(err, what);
  }
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path) {
  absl::StatusOr<UniqueFd> opened = Open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (!opened.ok()) return opened.status();
  UniqueFd fd = *std::move(opened);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return absl::ErrnoToStatus(errno, fmt::format("stat({})", path));
  if (!S_ISREG(st.st_mode)) {
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a file";
    return absl::FailedPreconditionError(
        fmt::format("{}: {}, not a regular file to read", path, what));
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    return absl::ErrnoToStatus(errno, fmt::format("fcntl({})", path));
  return fd;
}

}  // namespace memascend::prim
