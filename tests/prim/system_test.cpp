#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include <memascend/kernels.h>
#include <memascend/system.h>
#include <memascend/version.h>

#include "prim/os.h"

namespace memascend {
namespace {

TEST(ProbeSystem, ReportsKernelFacts) {
  const SystemInfo info = ProbeSystem(ProbeOptions{});
  EXPECT_EQ(info.memory.page_size, static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE)));
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &lim), 0);
  const std::uint64_t soft = lim.rlim_cur == RLIM_INFINITY ? kUnlimited : lim.rlim_cur;
  EXPECT_EQ(info.memory.memlock_soft_bytes, soft);
  EXPECT_GE(info.cpu.online_cpus, 1);
  EXPECT_GT(info.memory.total_bytes, 0u);
  EXPECT_FALSE(info.kernel_release.empty());
  EXPECT_GE(info.numa.node_count, 1);
  if (info.numa.available) {
    EXPECT_EQ(static_cast<int>(info.numa.node_memory_bytes.size()), info.numa.node_count);
  }
}

TEST(ProbeSystem, PicksBackendsFromFacts) {
  const SystemInfo info = ProbeSystem(ProbeOptions{});
  EXPECT_EQ(info.io_backend,
            info.io_uring.available ? IoBackendKind::kIoUring : IoBackendKind::kThreadPool);
  EXPECT_EQ(info.io_uring.available, info.io_uring.unavailable_reason.empty())
      << info.io_uring.unavailable_reason;
  EXPECT_EQ(info.host_backing, info.cuda.device_count > 0 ? HostBackingKind::kCudaRegistered
                                                          : HostBackingKind::kMlock);
  EXPECT_EQ(info.cuda.built_with_cuda, BuiltWithCuda());
  EXPECT_EQ(static_cast<int>(info.cuda.devices.size()), info.cuda.device_count);
  EXPECT_FALSE(info.cuda.status.empty());
  if (info.simd == SimdLevel::kAvx512) {
    EXPECT_TRUE(info.cpu.avx512f);
  }
  if (info.simd == SimdLevel::kAvx2) {
    EXPECT_TRUE(info.cpu.avx2);
  }
}

TEST(ProbeSystem, OptionsForceFallbacks) {
  ProbeOptions options;
  options.disable_io_uring = true;
  options.disable_cuda = true;
  options.max_simd = SimdLevel::kScalar;
  const SystemInfo info = ProbeSystem(options);
  EXPECT_FALSE(info.io_uring.available);
  EXPECT_NE(info.io_uring.unavailable_reason.find("MEMASCEND_DISABLE_IO_URING"), std::string::npos);
  EXPECT_EQ(info.io_backend, IoBackendKind::kThreadPool);
  EXPECT_EQ(info.cuda.device_count, 0);
  EXPECT_EQ(info.host_backing, HostBackingKind::kMlock);
  EXPECT_EQ(info.simd, SimdLevel::kScalar);
}

TEST(ProbeOptions, ReadsEnvironment) {
  setenv("MEMASCEND_DISABLE_IO_URING", "1", 1);
  setenv("MEMASCEND_DISABLE_CUDA", "0", 1);
  setenv("MEMASCEND_MAX_SIMD", "avx2", 1);
  const ProbeOptions options = ProbeOptions::FromEnvironment();
  unsetenv("MEMASCEND_DISABLE_IO_URING");
  unsetenv("MEMASCEND_DISABLE_CUDA");
  unsetenv("MEMASCEND_MAX_SIMD");
  EXPECT_TRUE(options.disable_io_uring);
  EXPECT_FALSE(options.disable_cuda);
  EXPECT_EQ(options.max_simd, SimdLevel::kAvx2);
  EXPECT_FALSE(ProbeOptions::FromEnvironment().disable_io_uring);
}

TEST(ToJson, HasTheDocumentedTopLevelKeys) {
  const SystemInfo info = ProbeSystem(ProbeOptions{});
  const std::string json = ToJson(info);
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_TRUE(std::regex_search(json, std::regex(R"("io_uring":(true|false)[,}])")));
  EXPECT_TRUE(std::regex_search(json, std::regex(R"("cuda_devices":[0-9]+[,}])")));
  EXPECT_TRUE(std::regex_search(json, std::regex(R"("numa_nodes":[1-9][0-9]*[,}])")));
  EXPECT_TRUE(std::regex_search(json, std::regex(R"("memlock_limit_bytes":(-1|[0-9]+)[,}])")));
  EXPECT_NE(json.find(std::string("\"io_backend\":\"") + std::string(ToString(info.io_backend))),
            std::string::npos);
}

// The names of this process's threads (/proc/self/task/*/comm).
std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name)) names.push_back(name);
  }
  return names;
}

std::string CommOf(long tid) {
  std::ifstream comm("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

TEST(NameThisThread, NamesTheCallingThreadCutTo15Characters) {
  std::string short_name, long_name;
  std::thread([&] {
    const long tid = syscall(SYS_gettid);
    prim::NameThisThread("ma-test");
    short_name = CommOf(tid);
    prim::NameThisThread("ma-a-name-longer-than-fifteen");
    long_name = CommOf(tid);
  }).join();
  EXPECT_EQ(short_name, "ma-test");
  EXPECT_EQ(long_name, "ma-a-name-longe");
}

// Note [current device] (prim/cuda_memory.h): a device guard leaves the SDK's own threads
// on its device, and gives any other thread its own back; which is which is this mark.
TEST(StartThread, MarksItsThreadsOursAndNoOther) {
  bool started = false, other = true;
  prim::StartThread("ma-test", [&] { started = prim::IsOurThread(); }).join();
  std::thread([&] { other = prim::IsOurThread(); }).join();
  EXPECT_TRUE(started);
  EXPECT_FALSE(other);
  EXPECT_FALSE(prim::IsOurThread());  // the test's own
}

TEST(NameThisThread, TheKernelPoolsWorkersAreNamed) {
  const auto named = [] { return std::ranges::count(ThreadNames(), std::string("ma-kernel")); };
  // Threads name themselves as they start, and leave /proc a moment after they are joined.
  const auto await = [&](auto done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  await([&] { return named() == 0; });  // an earlier repeat's workers gone
  const auto before = named();
  {
    KernelThreads three(3);  // the caller and two workers
    await([&] { return named() - before >= 2; });
    EXPECT_EQ(named() - before, 2);
  }
  await([&] { return named() == before; });
  EXPECT_EQ(named(), before);  // joined
}

TEST(Version, MatchesHeader) { EXPECT_EQ(VersionString(), MEMASCEND_VERSION_STRING); }

}  // namespace
}  // namespace memascend
