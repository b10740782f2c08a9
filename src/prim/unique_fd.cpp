#include "prim/unique_fd.h"

#include <cerrno>
#include <fcntl.h>
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

}  // namespace memascend::prim
