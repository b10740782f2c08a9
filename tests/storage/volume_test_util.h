// tests/storage/volume_test_util.h: volume files and deterministic object contents.
#ifndef MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_
#define MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_

#include <cerrno>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/io_engine.h>

namespace memascend::testing {

// A thread-pool engine whose every attempt and flush goes through `faults`.
inline absl::StatusOr<std::unique_ptr<IoEngine>> FaultyEngine(
    std::shared_ptr<FaultInjector> faults) {
  IoEngineOptions eo;
  eo.backend = IoBackendChoice::kThreadPool;
  eo.fault_injector = std::move(faults);
  return IoEngine::Create(eo);
}

// A path in the test temp dir, removed on destruction: a file, or a folder with what it
// holds (tests that put a volume per rank in it), and the ZeRO baseline's swap folder
// beside it (PATH.zero).
class ScratchPath {
 public:
  explicit ScratchPath(const std::string& stem) {
    static int counter = 0;
    path_ = ::testing::TempDir() + "/memascend_" + stem + "_" + std::to_string(getpid()) + "_" +
            std::to_string(counter++);
    ::unlink(path_.c_str());
  }
  ~ScratchPath() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    std::filesystem::remove_all(path_ + ".zero", ignored);
  }
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

// Kills child `pid` with SIGKILL after `delay`, reaps it and returns everything it wrote
// to the pipe `read_fd` (which is closed). *killed says whether the signal ended it (a
// child that exited by itself failed: its exit code goes to *exit_code).
inline std::string KillAndCollect(pid_t pid, int read_fd, std::chrono::milliseconds delay,
                                  bool* killed, int* exit_code) {
  std::this_thread::sleep_for(delay);
  ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  *killed = WIFSIGNALED(status);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::string log;
  char buf[4096];
  for (ssize_t n; (n = ::read(read_fd, buf, sizeof(buf))) > 0;)
    log.append(buf, static_cast<std::size_t>(n));
  ::close(read_fd);
  return log;
}

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_STORAGE_VOLUME_TEST_UTIL_H_
