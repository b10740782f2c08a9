#include "prim/os.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <pthread.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "util/strings.h"

namespace memascend::prim {
namespace {

std::uint64_t RlimToBytes(rlim_t value) {
  return value == RLIM_INFINITY ? kUnlimited : static_cast<std::uint64_t>(value);
}

// CAP_IPC_LOCK is bit 14 of the effective capability set.
bool HasCapIpcLock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    std::string_view view(line);
    if (util::ConsumePrefix(&view, "CapEff:")) {
      const auto caps = util::ParseInt<std::uint64_t>(util::Trim(view), 16);
      return caps.has_value() && ((*caps >> 14) & 1u) != 0;
    }
  }
  return false;
}

}  // namespace

namespace {
thread_local bool our_thread = false;
}  // namespace

bool IsOurThread() noexcept { return our_thread; }
void MarkThisThreadOurs() noexcept { our_thread = true; }

void NameThisThread(const char* name) noexcept {
  char cut[16] = {};
  std::strncpy(cut, name, sizeof(cut) - 1);
  (void)pthread_setname_np(pthread_self(), cut);
}

std::uint64_t PageSize() noexcept {
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

std::string KernelRelease() {
  utsname u{};
  if (::uname(&u) != 0) return {};
  return u.release;
}

CpuInfo ProbeCpu() {
  CpuInfo cpu;
  cpu.online_cpus = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    const auto kv = util::SplitKeyValue(line, ':');
    if (kv && kv->key == "model name") {
      cpu.model = std::string(kv->value);
      break;
    }
  }
#if defined(__x86_64__)
  // libgcc's cpu model also checks that the OS saves the AVX/AVX-512 register state.
  __builtin_cpu_init();
  cpu.sse42 = __builtin_cpu_supports("sse4.2");
  cpu.avx = __builtin_cpu_supports("avx");
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.fma = __builtin_cpu_supports("fma");
  // F16C and AVX512-BF16 straight from CPUID: not every compiler's builtin knows them.
  // Both depend on AVX / AVX-512 state, whose OS support the checks above include.
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) cpu.f16c = cpu.avx && (c & bit_F16C) != 0;
  cpu.avx512f = __builtin_cpu_supports("avx512f");
  cpu.avx512bw = __builtin_cpu_supports("avx512bw");
  cpu.avx512vl = __builtin_cpu_supports("avx512vl");
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) cpu.avx512bf16 = cpu.avx512f && (a & (1u << 5)) != 0;
#endif
  return cpu;
}

MemoryInfo ProbeMemory() {
  MemoryInfo mem;
  mem.page_size = PageSize();
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    const auto kv = util::SplitKeyValue(line, ':');
    if (!kv) continue;
    std::string_view value = kv->value;
    const bool in_kb = util::ConsumeSuffix(&value, " kB");
    const auto parsed = util::ParseInt<std::uint64_t>(value);
    if (!parsed) continue;
    const std::uint64_t n = in_kb ? *parsed * 1024 : *parsed;
    if (kv->key == "MemTotal")
      mem.total_bytes = n;
    else if (kv->key == "MemAvailable")
      mem.available_bytes = n;
    else if (kv->key == "Hugepagesize")
      mem.huge_page_size = n;
    else if (kv->key == "HugePages_Total")
      mem.huge_pages_total = n;
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0) {
    mem.memlock_soft_bytes = RlimToBytes(lim.rlim_cur);
    mem.memlock_hard_bytes = RlimToBytes(lim.rlim_max);
  }
  mem.cap_ipc_lock = HasCapIpcLock();
  return mem;
}

bool EnvFlag(const char* name) noexcept {
  const char* value = std::getenv(name);
  if (value == nullptr) return false;
  const std::string_view v(value);
  return !(v.empty() || v == "0" || v == "false" || v == "no" || v == "off");
}

}  // namespace memascend::prim
