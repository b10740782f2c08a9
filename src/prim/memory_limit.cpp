// Note [memory limit] (memascend/system.h): the cgroup's limit and usage, MemAvailable.
#include "prim/memory_limit.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "util/strings.h"
#include "util/units.h"

namespace memascend {
namespace prim {
namespace {

// v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712); any
// figure this large is none.
constexpr std::uint64_t kNoLimitFloor = std::uint64_t{1} << 62;

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A limit file's value: bytes, kUnlimited for "max" or v1's huge figure, nullopt when
// the file is missing or holds something else.
std::optional<std::uint64_t> ReadLimit(const std::string& path) {
  const auto text = ReadText(path);
  if (!text) return std::nullopt;
  const std::string_view v = util::Trim(*text);
  if (v == "max") return kUnlimited;
  const auto n = util::ParseInt<std::uint64_t>(v);
  if (!n) return std::nullopt;
  return *n >= kNoLimitFloor ? kUnlimited : *n;
}

// The value of `key` in a memory.stat file.
std::optional<std::uint64_t> ReadStat(const std::string& path, std::string_view key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto kv = util::SplitKeyValue(line, ' ');
    if (kv && kv->key == key) return util::ParseInt<std::uint64_t>(util::Trim(kv->value));
  }
  return std::nullopt;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (std::size_t at = 0;;) {
    const std::size_t next = s.find(sep, at);
    out.push_back(
        s.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) return out;
    at = next + 1;
  }
}

struct Mount {
  std::string root;   // the cgroup path the mount shows at its mount point
  std::string point;  // where it is mounted
};

// The memory hierarchy's mount: a v1 "cgroup" mount with the memory option, or a
// "cgroup2" mount.
std::optional<Mount> FindMount(const std::string& mountinfo, int version) {
  std::istringstream in(mountinfo);
  std::string line;
  while (std::getline(in, line)) {
    const std::size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const std::vector<std::string_view> left = Split(std::string_view(line).substr(0, dash), ' ');
    const std::vector<std::string_view> right = Split(std::string_view(line).substr(dash + 3), ' ');
    if (left.size() < 5 || right.empty()) continue;
    if (version == 2 && right[0] == "cgroup2")
      return Mount{std::string(left[3]), std::string(left[4])};
    if (version == 1 && right[0] == "cgroup" && right.size() >= 3) {
      for (std::string_view opt : Split(right[2], ','))
        if (opt == "memory") return Mount{std::string(left[3]), std::string(left[4])};
    }
  }
  return std::nullopt;
}

std::string Show(std::uint64_t bytes) {
  return bytes == kUnlimited ? std::string("unlimited") : util::FormatBytes(bytes);
}

}  // namespace

MemoryLimit ReadMemoryLimit(const std::string& root) {
  MemoryLimit m;
  std::vector<std::string> missing;
  if (const auto meminfo = ReadText(root + "/proc/meminfo")) {
    std::istringstream in(*meminfo);
    std::string line;
    while (std::getline(in, line)) {
      const auto kv = util::SplitKeyValue(line, ':');
      if (!kv) continue;
      std::string_view value = kv->value;
      const bool in_kb = util::ConsumeSuffix(&value, " kB");
      const auto n = util::ParseInt<std::uint64_t>(util::Trim(value));
      if (!n) continue;
      if (kv->key == "MemTotal") m.total_bytes = in_kb ? *n * 1024 : *n;
      if (kv->key == "MemAvailable") m.available_bytes = in_kb ? *n * 1024 : *n;
    }
  } else {
    missing.push_back("/proc/meminfo");
  }

  // The process's own memory cgroup: v1's memory hierarchy, else v2's unified one.
  const auto cgroups = ReadText(root + "/proc/self/cgroup");
  const auto mountinfo = ReadText(root + "/proc/self/mountinfo");
  std::string path;
  int version = 0;
  if (cgroups) {
    std::istringstream in(*cgroups);
    std::string line;
    std::string unified;
    bool have_unified = false;
    while (std::getline(in, line)) {
      const std::size_t a = line.find(':');
      const std::size_t b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const std::string_view controllers = std::string_view(line).substr(a + 1, b - a - 1);
      const std::string_view p = std::string_view(line).substr(b + 1);
      if (controllers.empty() && line.compare(0, a, "0") == 0) {
        unified = std::string(p);
        have_unified = true;
      }
      for (std::string_view c : Split(controllers, ','))
        if (c == "memory") {
          path = std::string(p);
          version = 1;
        }
    }
    if (version == 0 && have_unified) {
      path = unified;
      version = 2;
    }
  } else {
    missing.push_back("/proc/self/cgroup");
  }
  std::optional<Mount> mount;
  if (version != 0 && mountinfo) mount = FindMount(*mountinfo, version);
  if (version != 0 && !mountinfo) missing.push_back("/proc/self/mountinfo");
  if (version != 0 && mountinfo && !mount) {
    missing.push_back(
        fmt::format("a cgroup{} mount in /proc/self/mountinfo", version == 2 ? "2" : " (memory)"));
  }
  if (mount) {
    // The cgroup path relative to what the mount shows; a path outside it (another
    // cgroup namespace) is the mount's own root.
    std::string rel;
    if (mount->root == "/") {
      rel = path;
    } else if (path == mount->root || path.rfind(mount->root + "/", 0) == 0) {
      rel = path.substr(mount->root.size());
    }
    while (!rel.empty() && rel.back() == '/') rel.pop_back();
    const std::string top = root + mount->point;
    const std::string own = top + rel;
    const char* limit_name = version == 2 ? "memory.max" : "memory.limit_in_bytes";
    const char* usage_name = version == 2 ? "memory.current" : "memory.usage_in_bytes";
    std::ifstream probe(own + "/" + usage_name);
    if (!probe) {
      missing.push_back(own + "/" + usage_name);
    } else {
      m.cgroup_version = version;
      m.cgroup_dir = own;
      m.cgroup_usage_bytes = ReadLimit(own + "/" + usage_name).value_or(0);
      const std::string stat = own + "/memory.stat";
      m.cgroup_reclaimable_bytes =
          std::min(m.cgroup_usage_bytes,
                   (version == 1 ? ReadStat(stat, "total_inactive_file") : std::nullopt)
                       .value_or(ReadStat(stat, "inactive_file").value_or(0)));
      // The hierarchy's root has no limit file in v2: not a missing one.
      if (own.size() > top.size() && !ReadLimit(own + "/" + limit_name))
        missing.push_back(own + "/" + limit_name);
      // The smallest limit from the own cgroup up to the hierarchy's root.
      for (std::string dir = own;;) {
        const auto limit = ReadLimit(dir + "/" + limit_name);
        if (limit && *limit < m.cgroup_limit_bytes) {
          m.cgroup_limit_bytes = *limit;
          m.cgroup_limit_file = dir + "/" + limit_name;
        }
        if (dir.size() <= top.size()) break;
        dir.resize(dir.rfind('/'));
      }
    }
  }
  if (!missing.empty()) {
    m.detail = "could not read ";
    for (std::size_t i = 0; i < missing.size(); ++i) m.detail += (i == 0 ? "" : ", ") + missing[i];
  }
  return m;
}

}  // namespace prim

std::uint64_t MemoryLimit::headroom_bytes() const noexcept {
  std::uint64_t cgroup = kUnlimited;
  if (cgroup_limit_bytes != kUnlimited) {
    const std::uint64_t used =
        cgroup_usage_bytes - std::min(cgroup_usage_bytes, cgroup_reclaimable_bytes);
    cgroup = cgroup_limit_bytes - std::min(cgroup_limit_bytes, used);
  }
  return std::min(cgroup, available_bytes);
}

std::string MemoryLimit::headroom_source() const {
  std::uint64_t cgroup = kUnlimited;
  std::uint64_t used = 0;
  if (cgroup_limit_bytes != kUnlimited) {
    used = cgroup_usage_bytes - std::min(cgroup_usage_bytes, cgroup_reclaimable_bytes);
    cgroup = cgroup_limit_bytes - std::min(cgroup_limit_bytes, used);
  }
  if (cgroup == kUnlimited && available_bytes == kUnlimited)
    return "no memory limit found (" + (detail.empty() ? std::string("none set") : detail) + ")";
  if (cgroup <= available_bytes) {
    return fmt::format("{}, {} of it in use", limit_source(), prim::Show(used));
  }
  return fmt::format("MemAvailable of /proc/meminfo = {}", prim::Show(available_bytes));
}

std::uint64_t MemoryLimit::limit_bytes() const noexcept {
  if (cgroup_limit_bytes != kUnlimited) return cgroup_limit_bytes;
  return total_bytes != 0 ? total_bytes : kUnlimited;
}

std::string MemoryLimit::limit_source() const {
  if (cgroup_limit_bytes != kUnlimited) {
    const std::size_t slash = cgroup_limit_file.rfind('/');
    return fmt::format(
        "cgroup {} of {} = {}",
        slash == std::string::npos ? cgroup_limit_file : cgroup_limit_file.substr(slash + 1),
        cgroup_limit_file, prim::Show(cgroup_limit_bytes));
  }
  if (total_bytes != 0)
    return fmt::format("MemTotal of /proc/meminfo = {}", prim::Show(total_bytes));
  return "no memory limit found";
}

MemoryLimit ReadMemoryLimit() { return prim::ReadMemoryLimit(""); }

}  // namespace memascend
