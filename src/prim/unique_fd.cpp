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
  if (fd < 0) return absl::ErrnoToStatus(errno, fmt::format("open({})", path));
  return UniqueFd(fd);
}

}  // namespace memascend::prim
