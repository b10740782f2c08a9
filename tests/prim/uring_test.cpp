#include "prim/uring.h"

#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <liburing.h>

#include <memascend/io_engine.h>

#include "testing/status_matchers.h"

namespace memascend::prim {
namespace {

TEST(UringRing, MovedRingStillCompletesRequests) {
  const IoUringInfo info = ProbeIoUring(false);
  if (!info.available) GTEST_SKIP() << "io_uring unavailable: " << info.unavailable_reason;
  ASSERT_OK_AND_ASSIGN(UringRing ring, UringRing::Create(8));
  UringRing moved = std::move(ring);
  EXPECT_EQ(ring.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  io_uring_sqe* sqe = io_uring_get_sqe(moved.get());
  ASSERT_NE(sqe, nullptr);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, 42);
  ASSERT_EQ(io_uring_submit(moved.get()), 1);
  io_uring_cqe* cqe = nullptr;
  ASSERT_EQ(io_uring_wait_cqe(moved.get(), &cqe), 0);
  EXPECT_EQ(cqe->res, 0);
  EXPECT_EQ(io_uring_cqe_get_data64(cqe), 42u);
  io_uring_cqe_seen(moved.get(), cqe);
  EXPECT_NE(moved.features(), 0u);
}

TEST(UringRing, RejectsAbsurdQueueDepth) {
  // More entries than IORING_MAX_ENTRIES (32768) without IORING_SETUP_CLAMP.
  const IoUringInfo info = ProbeIoUring(false);
  if (!info.available) GTEST_SKIP() << "io_uring unavailable: " << info.unavailable_reason;
  auto ring = UringRing::Create(1u << 20);
  EXPECT_FALSE(ring.ok());
  EXPECT_NE(ring.status().message().find("io_uring_setup"), std::string_view::npos);
}

TEST(ProbeIoUring, DisabledByOptionSaysWhy) {
  const IoUringInfo info = ProbeIoUring(true);
  EXPECT_FALSE(info.available);
  EXPECT_EQ(info.unavailable_reason, "disabled by MEMASCEND_DISABLE_IO_URING");
}

// Note [io_uring probe]: every step the engine relies on is tried and recorded, in order.
TEST(ProbeIoUring, RecordsEveryStep) {
  const IoUringInfo info = RunIoUringProbe({});
  ASSERT_FALSE(info.checks.empty());
  EXPECT_EQ(info.checks.front().name, "setup");
  if (!info.available) {
    // A machine without io_uring: the first failed check is the reason.
    bool found = false;
    for (const IoUringCheck& c : info.checks) {
      if (!c.ok && c.name != "opcode probe") {
        EXPECT_NE(info.unavailable_reason.find(c.name), std::string::npos)
            << info.unavailable_reason;
        found = true;
        break;
      }
    }
    EXPECT_TRUE(found) << info.unavailable_reason;
    return;
  }
  std::vector<std::string> names;
  for (const IoUringCheck& c : info.checks) {
    names.push_back(c.name);
    if (c.name != "opcode probe") {
      EXPECT_TRUE(c.ok) << c.name << ": " << c.detail;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"setup", "nop", "opcode probe", "scratch file",
                                             "write", "read", "eventfd read", "registered files",
                                             "registered buffers", "write_fixed", "read_fixed"}));
  EXPECT_TRUE(info.unavailable_reason.empty());
  EXPECT_TRUE(info.op_read && info.op_write && info.op_read_fixed && info.op_write_fixed);
  EXPECT_TRUE(info.registered_files && info.registered_buffers);
  EXPECT_FALSE(info.probe_dir.empty());
}

TEST(ProbeIoUring, ProbesOncePerProcess) {
  const IoUringInfo a = ProbeIoUring(false);
  const IoUringInfo b = ProbeIoUring(false);
  EXPECT_EQ(a.available, b.available);
  EXPECT_EQ(a.checks.size(), b.checks.size());
}

// What a sandbox that refuses one operation looks like (gVisor refuses io_uring_register
// and completes only NOP and READV): each missing operation makes io_uring unavailable,
// says which, and the engine's automatic choice falls back to the thread pool.
TEST(ProbeIoUring, AnyMissingOperationFallsBackToThreads) {
  if (!ProbeIoUring(false).available) GTEST_SKIP() << "io_uring unavailable here";
  for (const char* missing : {"nop", "write", "read", "eventfd read", "registered files",
                              "registered buffers", "write_fixed", "read_fixed"}) {
    SCOPED_TRACE(missing);
    SystemInfo system;
    system.io_uring = RunIoUringProbe(missing);
    EXPECT_FALSE(system.io_uring.available);
    EXPECT_NE(system.io_uring.unavailable_reason.find(missing), std::string::npos)
        << system.io_uring.unavailable_reason;
    EXPECT_EQ(system.io_uring.checks.back().name, missing);
    const IoBackendDecision d = DecideIoBackend(IoBackendChoice::kAuto, system);
    EXPECT_EQ(d.backend, IoBackendKind::kThreadPool);
    EXPECT_NE(d.reason.find(missing), std::string::npos) << d.reason;
    // Asking for io_uring by name is not overruled, but the reason says what is missing.
    EXPECT_NE(DecideIoBackend(IoBackendChoice::kIoUring, system).reason.find(missing),
              std::string::npos);
  }
}

// The opcode probe decides nothing by itself: the operations are tried.
TEST(ProbeIoUring, RefusedOpcodeProbeAloneKeepsIoUring) {
  if (!ProbeIoUring(false).available) GTEST_SKIP() << "io_uring unavailable here";
  const IoUringInfo info = RunIoUringProbe("opcode probe");
  EXPECT_TRUE(info.available) << info.unavailable_reason;
  EXPECT_TRUE(info.unavailable_reason.empty());
}

TEST(ProbeIoUring, UnusableTmpdirFallsBackToTmp) {
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old != nullptr ? old : "";
  ASSERT_EQ(setenv("TMPDIR", "/nonexistent/memascend-probe", 1), 0);
  const IoUringInfo info = RunIoUringProbe({});
  if (old != nullptr) {
    setenv("TMPDIR", saved.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  if (!ProbeIoUring(false).available) GTEST_SKIP() << "io_uring unavailable here";
  EXPECT_TRUE(info.available) << info.unavailable_reason;
  EXPECT_NE(info.probe_dir, "/nonexistent/memascend-probe");
}

}  // namespace
}  // namespace memascend::prim
