#include "prim/uring.h"

#include <gtest/gtest.h>
#include <liburing.h>

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

}  // namespace
}  // namespace memascend::prim
