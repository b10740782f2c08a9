// memascend volume format|info|put|get|ls|rm|fsck: a volume from the command line.
#include <algorithm>
#include <cstdio>
#include <fcntl.h>
#include <iterator>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <memascend/volume.h>

#include "args.h"
#include "commands.h"
#include "util/json_writer.h"
#include "util/units.h"

namespace memascend::cli {
namespace {

struct Sub {
  std::string_view name;
  std::string_view usage;
  std::size_t positional;
  std::vector<OptionSpec> options;
};

const Sub kSubs[] = {
    {"format",
     "format PATH [--size BYTES] [--unit BYTES] [--journal BYTES] [--force]",
     1,
     {{"size", true, "create/grow a regular file to this size"},
      {"unit", true, "allocation unit (default 64K)"},
      {"journal", true, "journal bytes, both halves (default: capacity/512 in 2M..256M)"},
      {"force", false,
       "overwrite what is there: a file system, partition table, volume or any non-zero "
       "data (without it only a new or empty file or a device of zeros is formatted)"}}},
    {"info", "info PATH [--json]", 1, {{"json", false, "one JSON object"}}},
    {"put",
     "put PATH NAME FILE [--scratch [--replace-durable]] [--meta TEXT]",
     3,
     {{"scratch", false, "swap space for this open only (not journaled)"},
      {"meta", true, "opaque metadata kept with the object (e.g. dtype and shape)"},
      {"replace-durable", false,
       "let a --scratch object replace a durable one of that name (which is then lost)"}}},
    {"get",
     "get PATH NAME OUT [--force] [--allow-data-loss]",
     3,
     {{"force", false, "replace an existing OUT (without it an existing OUT is refused)"},
      {"allow-data-loss", false,
       "read a volume whose journal is damaged, as of the commits before the damage"}}},
    {"ls",
     "ls PATH [--json] [--allow-data-loss]",
     1,
     {{"json", false, "one JSON object"},
      {"allow-data-loss", false,
       "list a volume whose journal is damaged, as of the commits before the damage"}}},
    {"rm", "rm PATH NAME", 2, {}},
    {"fsck",
     "fsck PATH [--verify-data] [--repair] [--allow-data-loss] [--json]",
     1,
     {{"verify-data", false, "read every object and check its checksum"},
      {"repair", false, "rewrite what is redundant (a damaged superblock copy) first"},
      {"allow-data-loss", false,
       "open a volume whose journal is damaged, keeping the commits before the damage"},
      {"json", false, "one JSON object"}}},
};

void PrintUsage(std::FILE* out) {
  fmt::print(out, "usage: memascend volume COMMAND ...\n");
  for (const Sub& s : kSubs) fmt::print(out, "  memascend volume {}\n", s.usage);
  fmt::print(out, "memascend volume COMMAND --help describes COMMAND's options\n");
}

void PrintSubUsage(const Sub& sub) {
  fmt::print("usage: memascend volume {}\n", sub.usage);
  for (const OptionSpec& o : sub.options) {
    const std::string flag =
        o.takes_value ? fmt::format("--{} VALUE", o.name) : fmt::format("--{}", o.name);
    fmt::print("  {:<28} {}\n", flag, o.help);
  }
}

int Fail(const absl::Status& s) {
  fmt::print(stderr, "memascend volume: {}\n", Message(s));
  return kExitFailure;
}

// The whole of a regular file (a directory, a device or a FIFO is refused, not read), read
// to its end: a size the kernel reports as 0 (a /proc file) is not taken at its word.
absl::StatusOr<std::vector<std::byte>> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, fmt::format("open {}", path));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(fmt::format(
        "{} is not a regular file (a directory or a device): give a file to put", path));
  }
  std::vector<std::byte> out(static_cast<std::size_t>(st.st_size) + 1);
  std::size_t done = 0;
  for (;;) {
    if (done == out.size()) out.resize(std::max<std::size_t>(2 * out.size(), 64 * 1024));
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, fmt::format("read {} (after {} bytes)", path, done));
    }
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

// Whether `a` and `b` name the same file (both exist).
bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// Writes `data` to `path` whole or not at all: into a new temporary file in path's folder,
// fsync'ed, then renamed over `path`. A failure (a full file system) leaves an existing
// `path` as it was and removes the temporary.
absl::Status WriteFile(const std::string& path, std::span<const std::byte> data, mode_t mode) {
  const std::size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : path.substr(0, std::max<std::size_t>(slash, 1));
  std::string temp = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
                     "." + path.substr(slash == std::string::npos ? 0 : slash + 1) +
                     ".memascend-get-XXXXXX";
  const int fd = ::mkstemp(temp.data());
  if (fd < 0)
    return absl::ErrnoToStatus(errno,
                               fmt::format("create a temporary file in {} for {}", dir, path));
  const auto fail = [&](int err, std::string what) {
    ::close(fd);
    ::unlink(temp.c_str());
    return absl::ErrnoToStatus(
        err, fmt::format("{} {} (for {}; {} is unchanged)", what, temp, path, path));
  };
  ::fchmod(fd, mode);  // mkstemp makes it 0600
  for (std::size_t done = 0; done < data.size();) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(errno, fmt::format("write {} bytes to", data.size()));
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) return fail(errno, "fsync");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return absl::ErrnoToStatus(err, fmt::format("close {} (for {})", temp, path));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return absl::ErrnoToStatus(err, fmt::format("rename {} to {}", temp, path));
  }
  // The rename itself is durable once the folder is.
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

int Format(const Args& a) {
  VolumeFormatOptions o;
  auto size = a.GetBytes("size", 0);
  auto unit = a.GetBytes("unit", 64 * 1024);
  auto journal = a.GetBytes("journal", 0);
  for (const absl::Status& s : {size.status(), unit.status(), journal.status()}) {
    if (!s.ok()) return Fail(s);
  }
  // VolumeFormatOptions::unit_bytes is 32-bit: a larger --unit is refused, not truncated.
  constexpr std::uint64_t kMaxUnit = std::uint64_t{1} << 31;
  if (*unit < 4096 || *unit > kMaxUnit || *unit % 4096 != 0) {
    return Fail(absl::InvalidArgumentError(
        fmt::format("--unit {} is not a multiple of 4096 from 4K to 2G", *unit)));
  }
  o.size = *size;
  o.unit_bytes = static_cast<std::uint32_t>(*unit);
  o.journal_bytes = *journal;
  o.force = a.Has("force");
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  o.progress = [tty](std::uint64_t done, std::uint64_t total) {
    if (total < (64u << 20)) return;
    fmt::print(stderr, "{}format: clearing the journal {:3.0f}%{}", tty ? "\r" : "",
               100.0 * static_cast<double>(done) / static_cast<double>(total),
               tty && done < total ? "" : "\n");
  };
  const std::string& path = a.positional()[0];
  if (absl::Status s = Volume::Format(path, o); !s.ok()) return Fail(s);
  auto v = Volume::Open(path, {});
  if (!v.ok()) return Fail(v.status());
  const VolumeStats st = (*v)->stats();
  fmt::print("formatted {}: {} data in {} units, journal 2 x {}, uuid {}\n", path,
             util::FormatBytes(st.data_bytes), util::FormatBytes(st.unit_bytes),
             util::FormatBytes(st.journal_bytes), st.uuid);
  return kExitOk;
}

int Info(Volume& v, bool json) {
  const VolumeStats s = v.stats();
  if (json) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("uuid", s.uuid);
    w.Field("generation", s.generation);
    w.Field("capacity_bytes", s.capacity_bytes);
    w.Field("data_bytes", s.data_bytes);
    w.Field("used_bytes", s.used_bytes);
    w.Field("free_bytes", s.free_bytes);
    w.Field("largest_free_extent_bytes", s.largest_free_extent_bytes);
    w.Field("fragmentation", s.fragmentation);
    w.Field("unit_bytes", s.unit_bytes);
    w.Field("block_bytes", s.block_bytes);
    w.Field("objects", s.objects);
    w.Field("durable_objects", s.durable_objects);
    w.Field("journal_bytes", s.journal_bytes);
    w.Field("journal_used_bytes", s.journal_used_bytes);
    w.Field("io_backend", ToString(v.engine()->backend()));
    w.EndObject();
    fmt::print("{}\n", w.str());
    return kExitOk;
  }
  fmt::print(
      "uuid        {}\ngeneration  {}\ncapacity    {}\ndata        {} ({} used, {} free, largest "
      "free extent {}, "
      "fragmentation {:.1f}%)\nunit        {}\nobjects     {} ({} durable)\njournal     2 x {} ({} "
      "used)\n"
      "io backend  {}\n",
      s.uuid, s.generation, util::FormatBytes(s.capacity_bytes), util::FormatBytes(s.data_bytes),
      util::FormatBytes(s.used_bytes), util::FormatBytes(s.free_bytes),
      util::FormatBytes(s.largest_free_extent_bytes), 100 * s.fragmentation,
      util::FormatBytes(s.unit_bytes), s.objects, s.durable_objects,
      util::FormatBytes(s.journal_bytes), util::FormatBytes(s.journal_used_bytes),
      ToString(v.engine()->backend()));
  return kExitOk;
}

int Ls(Volume& v, bool json) {
  const std::vector<ObjectInfo> objects = v.List();
  if (json) {
    util::JsonWriter w;
    w.BeginObject();
    w.Key("objects").BeginArray();
    for (const ObjectInfo& o : objects) {
      w.BeginObject();
      w.Field("name", o.name);
      w.Field("size", o.size);
      w.Field("durability", ToString(o.durability));
      w.Field("metadata", o.metadata);
      w.Field("checksum", fmt::format("{:08x}", o.checksum));
      w.Field("extents", o.extents.size());
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    fmt::print("{}\n", w.str());
    return kExitOk;
  }
  for (const ObjectInfo& o : objects) {
    fmt::print("{:>12}  {:<8} {:08x}  {}{}\n", o.size, ToString(o.durability), o.checksum, o.name,
               o.metadata.empty() ? "" : "  [" + o.metadata + "]");
  }
  return kExitOk;
}

int Fsck(Volume& v, bool verify, bool json) {
  auto r = v.Fsck(verify);
  if (!r.ok()) return Fail(r.status());
  if (json) {
    util::JsonWriter w;
    w.BeginObject();
    w.Field("clean", r->clean);
    w.Field("objects", r->objects);
    w.Field("used_bytes", r->used_bytes);
    w.Field("free_bytes", r->free_bytes);
    w.Key("errors").BeginArray();
    for (const std::string& e : r->errors) w.String(e);
    w.EndArray();
    w.Key("warnings").BeginArray();
    for (const std::string& e : r->warnings) w.String(e);
    w.EndArray();
    w.EndObject();
    fmt::print("{}\n", w.str());
  } else {
    for (const std::string& e : r->errors) fmt::print("error: {}\n", e);
    for (const std::string& e : r->warnings) fmt::print("warning: {}\n", e);
    fmt::print("{}: {} objects, {} used, {} free\n", r->clean ? "clean" : "NOT CLEAN", r->objects,
               util::FormatBytes(r->used_bytes), util::FormatBytes(r->free_bytes));
  }
  return r->clean ? kExitOk : kExitFailure;
}

}  // namespace

int RunVolume(std::span<char* const> argv) {
  const std::string_view name = argv.empty() ? std::string_view() : std::string_view(argv[0]);
  const Sub* sub = nullptr;
  for (const Sub& s : kSubs) {
    if (s.name == name) sub = &s;
  }
  if (sub == nullptr) {
    PrintUsage(name == "--help" ? stdout : stderr);
    return name == "--help" ? kExitOk : kExitUsage;
  }
  for (char* const arg : argv.subspan(1)) {
    if (std::string_view(arg) == "--help" || std::string_view(arg) == "-h") {
      PrintSubUsage(*sub);
      return kExitOk;
    }
  }
  auto args = Args::Parse(argv.subspan(1), sub->options, sub->positional);
  if (!args.ok() || args->positional().size() != sub->positional) {
    fmt::print(stderr, "memascend volume: {}\nusage: memascend volume {}\n",
               args.ok() ? "wrong number of arguments" : Message(args.status()), sub->usage);
    return kExitUsage;
  }
  const std::vector<std::string>& pos = args->positional();
  if (sub->name == "format") return Format(*args);
  VolumeOpenOptions open;
  // get, ls and fsck only read: with --allow-data-loss they show what a damaged journal's
  // intact commits hold (Volume::Open's refusal names them).
  open.allow_data_loss = args->Has("allow-data-loss");
  auto volume = Volume::Open(pos[0], open);
  if (!volume.ok()) return Fail(volume.status());
  Volume& v = **volume;
  if (sub->name == "fsck" && args->Has("repair")) {
    auto repaired = v.RepairSuperblocks();
    if (!repaired.ok()) return Fail(repaired.status());
    if (*repaired && !args->Has("json")) fmt::print("repaired: the damaged superblock copy\n");
  }
  if (sub->name == "info") return Info(v, args->Has("json"));
  if (sub->name == "ls") return Ls(v, args->Has("json"));
  if (sub->name == "fsck") return Fsck(v, args->Has("verify-data"), args->Has("json"));
  if (sub->name == "rm") {
    if (absl::Status s = v.Delete(pos[1]); !s.ok()) return Fail(s);
    return kExitOk;
  }
  if (sub->name == "put") {
    auto data = ReadFile(pos[2]);
    if (!data.ok()) return Fail(data.status());
    const Durability d = args->Has("scratch") ? Durability::kScratch : Durability::kDurable;
    // A scratch object lives until the volume closes: over a durable one, the durable
    // object's data would be gone when this command exits.
    if (auto old = v.Stat(pos[1]); d == Durability::kScratch && old.ok() &&
                                   old->durability == Durability::kDurable &&
                                   !args->Has("replace-durable")) {
      return Fail(absl::FailedPreconditionError(fmt::format(
          "{} holds a durable object '{}' ({} bytes): a --scratch put would replace it and it "
          "would be gone when this command exits; rm it first, put it without --scratch, or "
          "pass --replace-durable",
          pos[0], pos[1], old->size)));
    }
    if (absl::Status s = v.Put(pos[1], *data, d, args->Get("meta")); !s.ok()) return Fail(s);
    return kExitOk;
  }
  // get: never writes its output over its own input, nor over an existing file unless
  // --force.
  if (SameFile(pos[2], pos[0])) {
    return Fail(absl::InvalidArgumentError(
        fmt::format("{} is the volume itself: give another output file", pos[2])));
  }
  // A new OUT gets the mode a plain create would give it; a replaced one keeps its own.
  const mode_t umask_now = ::umask(0);
  ::umask(umask_now);
  mode_t mode = 0666 & ~umask_now;
  if (struct stat st{}; ::lstat(pos[2].c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return Fail(absl::InvalidArgumentError(fmt::format(
          "{} exists and is not a regular file (a link, folder or device): give a new or "
          "regular output file",
          pos[2])));
    }
    if (!args->Has("force")) {
      return Fail(absl::FailedPreconditionError(
          fmt::format("{} exists ({} bytes): refusing to replace it (--force to replace it)",
                      pos[2], st.st_size)));
    }
    mode = st.st_mode & 07777;
  }
  auto info = v.Stat(pos[1]);
  if (!info.ok()) return Fail(info.status());
  std::vector<std::byte> out(info->size);
  if (auto n = v.Get(pos[1], out); !n.ok()) return Fail(n.status());
  if (absl::Status s = WriteFile(pos[2], out, mode); !s.ok()) return Fail(s);
  return kExitOk;
}

}  // namespace memascend::cli
