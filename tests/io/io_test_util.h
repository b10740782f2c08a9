// tests/io/io_test_util.h: files and buffers for I/O tests.
#ifndef MEMASCEND_TESTS_IO_IO_TEST_UTIL_H_
#define MEMASCEND_TESTS_IO_IO_TEST_UTIL_H_

#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>

#include <gtest/gtest.h>

namespace memascend::testing {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte[], FreeDeleter>;

inline AlignedBuffer MakeBuffer(std::size_t bytes, std::size_t align = 4096) {
  return AlignedBuffer(
      static_cast<std::byte*>(std::aligned_alloc(align, (bytes + align - 1) / align * align)));
}

inline void Fill(std::byte* p, std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

// A temporary file of `bytes` (allocated), removed on destruction; O_DIRECT if asked.
class TempFile {
 public:
  TempFile(std::uint64_t bytes, bool direct) {
    static int counter = 0;
    path_ = ::testing::TempDir() + "/memascend_io_" + std::to_string(getpid()) + "_" +
            std::to_string(counter++);
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0),
                 0600);
    if (fd_ >= 0 && bytes > 0 && ::fallocate(fd_, 0, 0, static_cast<off_t>(bytes)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_; }
  bool ok() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_IO_IO_TEST_UTIL_H_
