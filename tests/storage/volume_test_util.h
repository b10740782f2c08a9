// tests/storage/volume_test_util.h: volume files and deterministic object contents.
#ifndef MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_
#define MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_

#include <fcntl.h>
#include <functional>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

namespace memascend::testing {

// A path in the test temp dir, removed on destruction.
class ScratchPath {
 public:
  explicit ScratchPath(const std::string& stem) {
    static int counter = 0;
    path_ = ::testing::TempDir() + "/memascend_" + stem + "_" + std::to_string(getpid()) + "_" +
            std::to_string(counter++);
    ::unlink(path_.c_str());
  }
  ~ScratchPath() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Bytes that depend on (name, version) only.
inline std::vector<std::byte> Pattern(const std::string& name, std::uint64_t version,
                                      std::size_t size) {
  std::mt19937_64 rng(std::hash<std::string>{}(name) ^ (version * 0x9E3779B97F4A7C15ull));
  std::vector<std::byte> out(size);
  for (std::size_t i = 0; i < size; ++i) out[i] = static_cast<std::byte>(rng());
  return out;
}

// Reads or changes bytes of a closed volume's file with plain (buffered) I/O.
inline void FlipByte(const std::string& path, std::uint64_t offset, std::uint8_t mask = 0x01) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= mask;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::fsync(fd);
  ::close(fd);
}

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_
