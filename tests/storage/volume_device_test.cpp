// The volume on a real block device: a loop device over a file, with 512-byte and
// 4 KiB logical blocks. Skips, saying why, unless running as root with losetup working.
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <unistd.h>

#include <gtest/gtest.h>

#include <memascend/block_target.h>
#include <memascend/volume.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::Pattern;
using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr std::uint64_t kMiB = 1 << 20;

std::string Shell(const std::string& command, int* rc) {
  std::string out;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) {
    *rc = -1;
    return out;
  }
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  *rc = ::pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

class LoopDevice : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root for losetup";
    const int fd = ::open(backing_.path().c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 64 * kMiB), 0);
    ::close(fd);
    int rc = 0;
    device_ = Shell(
        "losetup -f --show --sector-size " + std::to_string(GetParam()) + " " + backing_.path(),
        &rc);
    if (rc != 0 || device_.rfind("/dev/loop", 0) != 0) {
      device_.clear();
      GTEST_SKIP() << "losetup does not work here: " << device_;
    }
  }
  void TearDown() override {
    if (device_.empty()) return;
    int rc = 0;
    Shell("losetup -d " + device_, &rc);
  }

  ScratchPath backing_{"loop"};
  std::string device_;
};

TEST_P(LoopDevice, LearnsTheDeviceGeometry) {
  ASSERT_OK_AND_ASSIGN(BlockTarget t, BlockTarget::Open(device_, {}));
  EXPECT_TRUE(t.is_device());
  EXPECT_EQ(t.size(), 64 * kMiB);
  EXPECT_EQ(t.logical_block(), static_cast<std::uint32_t>(GetParam()));
  EXPECT_GE(t.io_block(), 4096u);
}

TEST_P(LoopDevice, RoundTripsReopensAndChecks) {
  VolumeFormatOptions f;
  f.force = true;  // a fresh loop device may look like anything
  ASSERT_OK(Volume::Format(device_, f));
  const std::vector<std::size_t> sizes = {0, 1, 511, 4097, 65536, 3 * kMiB + 5};
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(device_, {}));
    for (std::size_t s : sizes) {
      ASSERT_OK(v->Put("d" + std::to_string(s), Pattern("d", s, s), Durability::kDurable));
    }
    ASSERT_OK(v->Put("d1", Pattern("d", 2, 1), Durability::kDurable));  // overwrite
    ASSERT_OK(v->Put("scratch", Pattern("s", 1, 100000), Durability::kScratch));
  }
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(device_, {}));
  EXPECT_EQ(v->List().size(), sizes.size());
  for (std::size_t s : sizes) {
    std::vector<std::byte> out(s);
    ASSERT_OK(v->Get("d" + std::to_string(s), out));
    EXPECT_TRUE(out == Pattern("d", s == 1 ? 2 : s, s)) << s;
  }
  ASSERT_OK_AND_ASSIGN(FsckReport r, v->Fsck(true));
  EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
  // Full device: the error, and nothing else damaged.
  EXPECT_THAT(v->Put("huge", Pattern("h", 1, 80 * kMiB), Durability::kDurable),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(r, v->Fsck(true));
  EXPECT_TRUE(r.clean);
}

TEST_P(LoopDevice, RefusesAFileSystemUnlessForced) {
  int rc = 0;
  Shell("mkfs.ext4 -q -F " + device_, &rc);
  if (rc != 0) GTEST_SKIP() << "mkfs.ext4 unavailable";
  EXPECT_THAT(Volume::Format(device_, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ext4")));
  VolumeFormatOptions f;
  f.force = true;
  EXPECT_OK(Volume::Format(device_, f));
}

TEST_P(LoopDevice, RefusesADeviceInUse) {
  const int holder = ::open(device_.c_str(), O_RDONLY | O_EXCL);  // as a mount would
  ASSERT_GE(holder, 0);
  VolumeFormatOptions f;
  f.force = true;  // force overrides signatures, never a device in use
  EXPECT_THAT(Volume::Format(device_, f),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("in use")));
  ::close(holder);
}

TEST_P(LoopDevice, DetectsDamagedData) {
  VolumeFormatOptions f;
  f.force = true;
  ASSERT_OK(Volume::Format(device_, f));
  std::uint64_t offset = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(device_, {}));
    ASSERT_OK(v->Put("x", Pattern("x", 1, 200000), Durability::kDurable));
    offset = v->Stat("x")->extents[0].offset;
  }
  ::memascend::testing::FlipByte(device_, offset + 777, 0x04);
  ASSERT_OK_AND_ASSIGN(auto v, Volume::Open(device_, {}));
  std::vector<std::byte> out(200000);
  EXPECT_THAT(v->Get("x", out), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'x'")));
}

INSTANTIATE_TEST_SUITE_P(SectorSizes, LoopDevice, ::testing::Values(512, 4096),
                         [](const auto& p) { return "Sector" + std::to_string(p.param); });

}  // namespace
}  // namespace memascend
