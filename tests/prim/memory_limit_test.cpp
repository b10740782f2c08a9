// Note [memory limit]: the cgroup and meminfo readers on fake /proc and /sys trees.
#include "prim/memory_limit.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include <memascend/system.h>

namespace memascend {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

// A fake root: files written under a fresh temporary directory, removed afterwards.
class FakeRoot : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/memascend-memlimit-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  void Write(const std::string& path, const std::string& text) {
    const fs::path p = fs::path(root_) / path.substr(1);
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  void Meminfo(std::uint64_t total_kb, std::uint64_t available_kb) {
    Write("/proc/meminfo", "MemTotal:       " + std::to_string(total_kb) +
                               " kB\nMemFree:        1000 kB\nMemAvailable:   " +
                               std::to_string(available_kb) + " kB\n");
  }
  void V1(const std::string& path) {
    Write("/proc/self/cgroup", "5:devices:/\n4:memory:" + path + "\n3:cpu,cpuacct:/\n0::/\n");
    Write("/proc/self/mountinfo",
          "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
          "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
          "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n");
  }
  void V2(const std::string& path) {
    Write("/proc/self/cgroup", "0::" + path + "\n");
    Write("/proc/self/mountinfo",
          "22 1 0:21 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 "
          "cgroup2 rw,nsdelegate,memory_recursiveprot\n");
  }
  std::string root_;
};

TEST_F(FakeRoot, V1TakesTheSmallestLimitAlongThePath) {
  Meminfo(24 * 1024 * 1024, 20 * 1024 * 1024);
  V1("/a/b");
  const std::string m = "/sys/fs/cgroup/memory";
  Write(m + "/memory.limit_in_bytes", "9223372036854771712\n");
  Write(m + "/a/memory.limit_in_bytes", std::to_string(4 * kGiB) + "\n");
  Write(m + "/a/b/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "unlimited"
  Write(m + "/a/b/memory.usage_in_bytes", std::to_string(kGiB) + "\n");
  Write(m + "/a/b/memory.stat",
        "cache 100\ninactive_file 7\ntotal_inactive_file " + std::to_string(kGiB / 4) + "\n");
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 1);
  EXPECT_EQ(l.cgroup_dir, root_ + m + "/a/b");
  EXPECT_EQ(l.cgroup_limit_bytes, 4 * kGiB);
  EXPECT_EQ(l.cgroup_limit_file, root_ + m + "/a/memory.limit_in_bytes");
  EXPECT_EQ(l.cgroup_usage_bytes, kGiB);
  EXPECT_EQ(l.cgroup_reclaimable_bytes, kGiB / 4);  // the hierarchical total
  EXPECT_EQ(l.total_bytes, 24 * kGiB);
  EXPECT_EQ(l.available_bytes, 20 * kGiB);
  EXPECT_EQ(l.headroom_bytes(), 4 * kGiB - 3 * kGiB / 4);
  EXPECT_EQ(l.limit_bytes(), 4 * kGiB);
  EXPECT_NE(l.limit_source().find("memory.limit_in_bytes of " + root_ + m + "/a/"),
            std::string::npos)
      << l.limit_source();
  EXPECT_NE(l.limit_source().find("4.00 GiB"), std::string::npos) << l.limit_source();
  EXPECT_NE(l.headroom_source().find("768.00 MiB of it in use"), std::string::npos)
      << l.headroom_source();
  EXPECT_TRUE(l.detail.empty()) << l.detail;
}

TEST_F(FakeRoot, V1UnlimitedEverywhereIsNoLimit) {
  Meminfo(8 * 1024 * 1024, 6 * 1024 * 1024);
  V1("/job");
  const std::string m = "/sys/fs/cgroup/memory";
  Write(m + "/memory.limit_in_bytes", "9223372036854771712\n");
  Write(m + "/job/memory.limit_in_bytes", "9223372036854771712\n");
  Write(m + "/job/memory.usage_in_bytes", "1000\n");
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 1);
  EXPECT_EQ(l.cgroup_limit_bytes, kUnlimited);
  EXPECT_TRUE(l.cgroup_limit_file.empty());
  EXPECT_EQ(l.headroom_bytes(), 6 * kGiB);  // MemAvailable decides
  EXPECT_NE(l.headroom_source().find("MemAvailable"), std::string::npos);
  EXPECT_EQ(l.limit_bytes(), 8 * kGiB);  // MemTotal
  EXPECT_NE(l.limit_source().find("MemTotal"), std::string::npos);
}

TEST_F(FakeRoot, V2NestedWithMaxAndAMountRootBelowTheHierarchy) {
  Meminfo(64 * 1024 * 1024, 60 * 1024 * 1024);
  V2("/user.slice/job/step");
  const std::string c = "/sys/fs/cgroup";
  Write(c + "/user.slice/memory.max", std::to_string(16 * kGiB) + "\n");
  Write(c + "/user.slice/job/memory.max", std::to_string(2 * kGiB) + "\n");
  Write(c + "/user.slice/job/step/memory.max", "max\n");
  Write(c + "/user.slice/job/step/memory.current", std::to_string(kGiB / 2) + "\n");
  Write(c + "/user.slice/job/step/memory.stat", "anon 1\nfile 2\ninactive_file 0\n");
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 2);
  EXPECT_EQ(l.cgroup_limit_bytes, 2 * kGiB);
  EXPECT_EQ(l.cgroup_limit_file, root_ + c + "/user.slice/job/memory.max");
  EXPECT_EQ(l.cgroup_usage_bytes, kGiB / 2);
  EXPECT_EQ(l.headroom_bytes(), 2 * kGiB - kGiB / 2);
  EXPECT_NE(l.headroom_source().find("cgroup memory.max of"), std::string::npos);
  EXPECT_TRUE(l.detail.empty()) << l.detail;
}

TEST_F(FakeRoot, V2InsideANamespaceReadsTheMountItself) {
  // A container's cgroup namespace: /proc/self/cgroup says "/", the mount is the group.
  Meminfo(64 * 1024 * 1024, 60 * 1024 * 1024);
  V2("/");
  Write("/sys/fs/cgroup/memory.max", std::to_string(3 * kGiB) + "\n");
  Write("/sys/fs/cgroup/memory.current", "4096\n");
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 2);
  EXPECT_EQ(l.cgroup_dir, root_ + "/sys/fs/cgroup");
  EXPECT_EQ(l.cgroup_limit_bytes, 3 * kGiB);
  EXPECT_EQ(l.headroom_bytes(), 3 * kGiB - 4096);
}

TEST_F(FakeRoot, MissingFilesAreNoLimitAndSaidInDetail) {
  V2("/gone");  // no cgroup files at all, no meminfo
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 0);
  EXPECT_EQ(l.cgroup_limit_bytes, kUnlimited);
  EXPECT_EQ(l.available_bytes, kUnlimited);
  EXPECT_EQ(l.headroom_bytes(), kUnlimited);
  EXPECT_EQ(l.limit_bytes(), kUnlimited);
  EXPECT_NE(l.detail.find("/proc/meminfo"), std::string::npos) << l.detail;
  EXPECT_NE(l.detail.find("memory.current"), std::string::npos) << l.detail;
  EXPECT_NE(l.headroom_source().find("no memory limit found"), std::string::npos);

  const MemoryLimit none = prim::ReadMemoryLimit(root_ + "/nothing-here");
  EXPECT_EQ(none.headroom_bytes(), kUnlimited);
  EXPECT_NE(none.detail.find("/proc/self/cgroup"), std::string::npos) << none.detail;
}

TEST_F(FakeRoot, AMissingLimitFileInTheOwnGroupIsSaid) {
  Meminfo(8 * 1024 * 1024, 6 * 1024 * 1024);
  V1("/job");
  Write("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "1000\n");
  Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "garbage\n");
  const MemoryLimit l = prim::ReadMemoryLimit(root_);
  EXPECT_EQ(l.cgroup_version, 1);
  EXPECT_EQ(l.cgroup_limit_bytes, kUnlimited);
  EXPECT_NE(l.detail.find("job/memory.limit_in_bytes"), std::string::npos) << l.detail;
}

TEST(ReadMemoryLimit, ThisMachine) {
  const MemoryLimit l = ReadMemoryLimit();
  EXPECT_GT(l.total_bytes, 0u);
  EXPECT_LE(l.headroom_bytes(), l.available_bytes);
  const SystemInfo info = ProbeSystem(ProbeOptions{});
  EXPECT_EQ(info.memory_limit.cgroup_limit_bytes, l.cgroup_limit_bytes);
  EXPECT_NE(ToJson(info).find("\"memory_limit\":{"), std::string::npos);
}

}  // namespace
}  // namespace memascend
