// Helpers for tests that run a part in a forked child with other limits.
#ifndef MEMASCEND_TESTS_TESTING_PROCESS_H_
#define MEMASCEND_TESTS_TESTING_PROCESS_H_

#include <cerrno>
#include <linux/capability.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

namespace memascend::testing {

// Drops CAP_IPC_LOCK from this (child) process so that RLIMIT_MEMLOCK applies to it
// even as root. False when the kernel refuses.
inline bool DropIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  data[0].effective &= ~(1u << CAP_IPC_LOCK);
  return syscall(SYS_capset, &header, data) == 0;
}

// Waits for child `pid` and returns its exit code; -1 when it did not exit by itself
// (a signal ended it) or cannot be waited for.
inline int ExitCodeOf(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_TESTING_PROCESS_H_
