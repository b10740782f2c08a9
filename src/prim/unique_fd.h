// prim/unique_fd.h: a move-only owner of a POSIX file descriptor.
#ifndef MEMASCEND_SRC_PRIM_UNIQUE_FD_H_
#define MEMASCEND_SRC_PRIM_UNIQUE_FD_H_

#include <string>
#include <sys/types.h>
#include <utility>

#include <absl/status/status.h>
#include <absl/status/statusor.h>

namespace memascend::prim {

// Owns one file descriptor and closes it on destruction. Close() reports the error
// that the destructor has to swallow (close() can report a failed write-back).
// Thread-safety: none; one owner at a time.
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }

  // Gives up ownership without closing.
  [[nodiscard]] int Release() noexcept { return std::exchange(fd_, -1); }

  // Closes now and reports the result. Idempotent: closing an empty handle is OK.
  absl::Status Close();

 private:
  void Reset() noexcept;

  int fd_ = -1;
};

// open(2) with O_CLOEXEC added; the error names the path.
absl::StatusOr<UniqueFd> Open(const std::string& path, int flags, mode_t mode = 0);

// A user's file opened to read, refused (FailedPrecondition, naming the path and what it
// is) unless it is a regular file: opening a FIFO waits for a writer forever, and a
// directory or a device is not a file of data. The open does not wait (O_NONBLOCK, cleared
// once the file is known regular); symlinks are followed.
absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path);

}  // namespace memascend::prim

#endif  // MEMASCEND_SRC_PRIM_UNIQUE_FD_H_
