// FileObjectStore: a directory with a file per object (memascend/object_store.h).
//
// A file holds the object's bytes from offset 0, zero-padded to the I/O block, then a
// trailer of whole blocks. Trailer: magic (8), size (8), CRC-32C of the data (4),
// durability (4), metadata bytes (4), name bytes (4), the trailer's own CRC-32C (4, over
// the trailer with this field zero), the name, the metadata, zeros; its last 8 bytes give
// the trailer's length in blocks and a second magic, so Open() finds it from the end.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <map>
#include <optional>
#include <set>
#include <sys/file.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/object_store.h>
#include <memascend/status.h>

#include "prim/file.h"
#include "prim/unique_fd.h"
#include "storage/format.h"
#include "storage/transfer.h"
#include "util/align.h"
#include "util/crc32c.h"

namespace memascend {
namespace {

using storage::GetLe;
using storage::PutLe;

constexpr std::size_t kBlock = 4096;
constexpr std::uint64_t kMagic = 0x314A424F53464D41ull;     // "AMFSOBJ1"
constexpr std::uint64_t kEndMagic = 0x444E454A424F4D41ull;  // "AMOBJEND"
constexpr std::size_t kTrailerHead = 36;
constexpr const char* kMarker = ".memascend-objects";
constexpr const char* kObjectSuffix = ".obj";
constexpr const char* kNewSuffix = ".new";  // staged, committed by Sync()
constexpr const char* kTmpSuffix = ".tmp";  // being written, renamed when whole

std::string Escape(std::string_view name) {
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c == '/' || c == '%' || c < 0x20 || c == 0x7f || (i == 0 && c == '.')) {
      out += fmt::format("%{:02X}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

struct Trailer {
  std::uint64_t size = 0;
  std::uint32_t checksum = 0;
  Durability durability = Durability::kDurable;
  std::string name;
  std::string metadata;
};

storage::Aligned EncodeTrailer(const Trailer& t, std::size_t* bytes) {
  *bytes = util::RoundUp(kTrailerHead + t.name.size() + t.metadata.size() + 8, kBlock);
  storage::Aligned b = storage::AllocAligned(*bytes, kBlock);
  std::byte* p = b.get();
  std::memset(p, 0, *bytes);
  PutLe<std::uint64_t>(p, kMagic);
  PutLe<std::uint64_t>(p + 8, t.size);
  PutLe<std::uint32_t>(p + 16, t.checksum);
  PutLe<std::uint32_t>(p + 20, t.durability == Durability::kScratch ? 1 : 0);
  PutLe<std::uint32_t>(p + 24, static_cast<std::uint32_t>(t.metadata.size()));
  PutLe<std::uint32_t>(p + 28, static_cast<std::uint32_t>(t.name.size()));
  std::memcpy(p + kTrailerHead, t.name.data(), t.name.size());
  std::memcpy(p + kTrailerHead + t.name.size(), t.metadata.data(), t.metadata.size());
  PutLe<std::uint32_t>(p + *bytes - 8, static_cast<std::uint32_t>(*bytes / kBlock));
  PutLe<std::uint32_t>(p + *bytes - 4, static_cast<std::uint32_t>(kEndMagic));
  PutLe<std::uint32_t>(p + 32, util::Crc32c(p, *bytes));
  return b;
}

absl::StatusOr<Trailer> DecodeTrailer(std::span<const std::byte> b, const std::string& file) {
  auto bad = [&](std::string_view why) {
    return absl::DataLossError(fmt::format("{}: the object's trailer is damaged ({})", file, why));
  };
  if (b.size() < kBlock || GetLe<std::uint64_t>(b.data()) != kMagic) return bad("no magic");
  std::vector<std::byte> copy(b.begin(), b.end());
  PutLe<std::uint32_t>(copy.data() + 32, 0);
  if (util::Crc32c(copy.data(), copy.size()) != GetLe<std::uint32_t>(b.data() + 32))
    return bad("checksum mismatch");
  Trailer t;
  t.size = GetLe<std::uint64_t>(b.data() + 8);
  t.checksum = GetLe<std::uint32_t>(b.data() + 16);
  t.durability =
      GetLe<std::uint32_t>(b.data() + 20) == 1 ? Durability::kScratch : Durability::kDurable;
  const auto meta = GetLe<std::uint32_t>(b.data() + 24);
  const auto name = GetLe<std::uint32_t>(b.data() + 28);
  if (kTrailerHead + name + meta + 8 > b.size()) return bad("lengths past its end");
  t.name.assign(reinterpret_cast<const char*>(b.data() + kTrailerHead), name);
  t.metadata.assign(reinterpret_cast<const char*>(b.data() + kTrailerHead + name), meta);
  return t;
}

}  // namespace

struct FileObjectStore::Impl {
  std::string dir;
  prim::UniqueFd dir_fd;
  prim::UniqueFd lock_fd;  // the marker, flock'ed while open
  std::unique_ptr<IoEngine> own_engine;
  IoEngine* engine = nullptr;
  bool verify = true;

  struct Entry {
    ObjectInfo info;
    bool staged = false;  // the bytes are in NAME.new until Sync()
    // Staged over this object (NAME.obj, and why its bytes are gone, if they are), which
    // DropStaged brings back.
    std::optional<ObjectInfo> committed;
    std::string committed_lost;
    std::string lost;  // why the object's bytes are gone (a failed in-place write)
  };
  // Note [file store commits]: Sync() and DropStaged() hold it exclusively, from the
  // list of what is staged to the last rename; a put holds it shared while it renames its
  // file into place and records it. So what a commit renames to NAME.obj is the NAME.new
  // it flushed, never a file staged after the flush (its bytes not on stable storage)
  // nor over a Put's newer object. A put's bytes are written outside it, while a commit
  // runs.
  absl::Mutex sync_mu;
  mutable absl::Mutex mu;
  std::map<std::string, Entry, std::less<>> objects ABSL_GUARDED_BY(mu);
  std::uint64_t staged_total ABSL_GUARDED_BY(mu) = 0;  // the staged files' data (staged_bytes)
  // A commit's rename into NAME.obj, a durable Put's or a durable Delete's, not yet followed by a
  // flush of the directory that succeeded.
  bool dir_unsynced ABSL_GUARDED_BY(mu) = false;

  static std::uint64_t FileBytes(std::uint64_t size) {
    return util::RoundUp(size, std::uint64_t{kBlock});
  }
  void Unstage(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (e.staged) staged_total -= FileBytes(e.info.size);
    e.staged = false;
  }
  // A commit's end (sync_mu held exclusively: no rename runs meanwhile): flushes the
  // directory if a rename is not on stable storage yet; a failure is kept for the next.
  absl::Status SyncDirectory() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_mu) ABSL_LOCKS_EXCLUDED(mu) {
    {
      absl::MutexLock lock(&mu);
      if (!dir_unsynced) return absl::OkStatus();
      dir_unsynced = false;
    }
    return FlushDirectoryOrKeepIt();
  }

  // A durable Put's or Delete's flush of the directory; a failure is returned and kept for
  // the next Sync() to retry (the name's change happened; its durability is not known).
  absl::Status FlushDirectoryOrKeepIt() ABSL_LOCKS_EXCLUDED(mu) {
    absl::Status s = SyncDir();
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      dir_unsynced = true;
    }
    return s;
  }

  std::string Path(std::string_view name, const char* suffix) const {
    return fmt::format("{}/{}{}", dir, Escape(name), suffix);
  }
  absl::Status SyncDir() const { return engine->Flush(dir_fd.get(), FlushKind::kAll, dir); }

  static absl::Status CheckPut(std::string_view name, std::string_view metadata) {
    MEMASCEND_RETURN_IF_ERROR(storage::CheckObject(name, metadata));
    if (Escape(name).size() + 4 > 255) {
      return absl::InvalidArgumentError(
          fmt::format("object name '{}' is too long for a file name once escaped", name));
    }
    return absl::OkStatus();
  }

  // Writes data and trailer to `path` (opened per transfer, as DeepSpeed's swapper does),
  // cutting off what an earlier, longer object left.
  absl::Status WriteFile(const std::string& path, std::span<const std::byte> data, const Trailer& t,
                         bool truncate_first, bool sync) {
    const int flags = O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC | (truncate_first ? O_TRUNC : 0);
    prim::UniqueFd fd(::open(path.c_str(), flags, 0600));
    if (!fd) return absl::ErrnoToStatus(errno, fmt::format("open({})", path));
    MEMASCEND_ASSIGN_OR_RETURN(FileId file, engine->RegisterFile(fd.get()));
    std::size_t trailer_bytes = 0;
    storage::Aligned trailer = EncodeTrailer(t, &trailer_bytes);
    const std::uint64_t at = util::RoundUp(std::uint64_t{data.size()}, std::uint64_t{kBlock});
    absl::Status s = storage::Transfer(engine, file, kBlock, IoOp::kWrite, 0,
                                       const_cast<std::byte*>(data.data()), data.size());
    if (s.ok()) {
      s = storage::Transfer(engine, file, kBlock, IoOp::kWrite, at, trailer.get(), trailer_bytes);
    }
    (void)engine->UnregisterFile(file);
    // The engine's error names no file: a full file system says which object's file.
    if (!s.ok()) {
      s = absl::Status(s.code(), fmt::format("write {} bytes to {}: {}", data.size(), path,
                                             std::string(s.message())));
    }
    if (s.ok() && !truncate_first &&
        ::ftruncate(fd.get(), static_cast<off_t>(at + trailer_bytes)) != 0)
      s = absl::ErrnoToStatus(errno, fmt::format("ftruncate({})", path));
    if (s.ok() && sync) s = engine->Flush(fd.get(), FlushKind::kAll, path);
    if (s.ok()) s = fd.Close();
    return s;
  }
};

FileObjectStore::FileObjectStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FileObjectStore::~FileObjectStore() = default;

const std::string& FileObjectStore::dir() const noexcept { return impl_->dir; }
std::string FileObjectStore::PathOf(std::string_view name) const {
  return impl_->Path(name, kObjectSuffix);
}

absl::StatusOr<std::unique_ptr<FileObjectStore>> FileObjectStore::Open(
    const std::string& dir, const FileObjectStoreOptions& options) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT || !options.create)
      return absl::ErrnoToStatus(errno, fmt::format("stat({})", dir));
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      return absl::ErrnoToStatus(errno, fmt::format("mkdir({})", dir));
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        fmt::format("{} is not a directory: a file object store is a directory", dir));
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.dir = dir;
  m.verify = options.verify_checksums;
  m.dir_fd = prim::UniqueFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!m.dir_fd) return absl::ErrnoToStatus(errno, fmt::format("open({})", dir));

  // Ours, or empty: anything else is not touched.
  std::vector<std::string> entries;
  {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return absl::ErrnoToStatus(errno, fmt::format("opendir({})", dir));
    while (const dirent* e = ::readdir(d)) {
      const std::string_view n = e->d_name;
      if (n != "." && n != "..") entries.emplace_back(n);
    }
    ::closedir(d);
  }
  const std::string marker = fmt::format("{}/{}", dir, kMarker);
  const bool ours = std::find(entries.begin(), entries.end(), kMarker) != entries.end();
  if (!ours && !entries.empty()) {
    std::sort(entries.begin(), entries.end());
    return absl::FailedPreconditionError(fmt::format(
        "{} holds {} entries ('{}'{}) and is not a MemAscend file object store (no {}): "
        "nothing was touched; give an empty or new directory",
        dir, entries.size(), entries.front(), entries.size() > 1 ? ", ..." : "", kMarker));
  }
  // Every flush goes through the engine (Note [flushes]), the marker's first.
  if (options.engine != nullptr) {
    m.engine = options.engine;
  } else {
    IoEngineOptions eo;
    eo.notice = [](std::string_view) {};
    MEMASCEND_ASSIGN_OR_RETURN(m.own_engine, IoEngine::Create(eo));
    m.engine = m.own_engine.get();
  }
  m.lock_fd = prim::UniqueFd(::open(marker.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!m.lock_fd) return absl::ErrnoToStatus(errno, fmt::format("open({})", marker));
  if (!ours) MEMASCEND_RETURN_IF_ERROR(m.SyncDir());
  const auto give_up = std::chrono::steady_clock::now() + options.lock_wait;
  while (::flock(m.lock_fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR)
      return absl::ErrnoToStatus(errno, fmt::format("flock({})", marker));
    if (std::chrono::steady_clock::now() >= give_up) {
      return absl::UnavailableError(
          fmt::format("{} is open in another process (its lock is held; waited {} ms)", dir,
                      options.lock_wait.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {  // O_DIRECT or nothing: a page-cached store would hide the I/O it stands for.
    prim::UniqueFd probe(::open(marker.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
    if (!probe) {
      if (errno == EINVAL) {
        return absl::FailedPreconditionError(fmt::format(
            "{}: the file system does not support O_DIRECT (tmpfs?): put the store on a disk",
            dir));
      }
      return absl::ErrnoToStatus(errno, fmt::format("open({}, O_DIRECT)", marker));
    }
  }

  // What an earlier open left: its durable objects stay; a .new (an uncommitted write) and
  // a scratch object go, as a volume forgets both on reopen. A damaged trailer is kDataLoss.
  bool removed = false;
  for (const std::string& e : entries) {
    const std::string path = fmt::format("{}/{}", dir, e);
    if (e == kMarker) continue;
    if (EndsWith(e, kNewSuffix) || EndsWith(e, kTmpSuffix)) {
      prim::RemoveQuietly(path);
      removed = true;
      continue;
    }
    if (!EndsWith(e, kObjectSuffix)) {
      return absl::FailedPreconditionError(fmt::format(
          "{}: not an object of this store (objects end in {}): nothing was touched; move it "
          "out of {}",
          path, kObjectSuffix, dir));
    }
    prim::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return absl::ErrnoToStatus(errno, fmt::format("open({})", path));
    struct stat fs {};
    if (::fstat(fd.get(), &fs) != 0)
      return absl::ErrnoToStatus(errno, fmt::format("fstat({})", path));
    const auto length = static_cast<std::uint64_t>(fs.st_size);
    std::byte end[8];
    const std::int64_t got =
        length < kBlock || length % kBlock != 0 ? 0 : prim::PreadFull(fd.get(), end, 8, length - 8);
    if (got < 0) return absl::ErrnoToStatus(static_cast<int>(-got), fmt::format("{}: read", path));
    if (got != 8 || GetLe<std::uint32_t>(end + 4) != static_cast<std::uint32_t>(kEndMagic)) {
      return absl::DataLossError(fmt::format(
          "{}: the object's trailer is damaged ({} bytes, no end marker)", path, length));
    }
    const std::uint64_t trailer_bytes = std::uint64_t{GetLe<std::uint32_t>(end)} * kBlock;
    if (trailer_bytes == 0 || trailer_bytes > length)
      return absl::DataLossError(fmt::format("{}: the object's trailer is damaged", path));
    std::vector<std::byte> tb(trailer_bytes);
    const std::int64_t read =
        prim::PreadFull(fd.get(), tb.data(), tb.size(), length - trailer_bytes);
    if (read < 0)
      return absl::ErrnoToStatus(static_cast<int>(-read), fmt::format("{}: read", path));
    if (static_cast<std::size_t>(read) != tb.size())
      return absl::DataLossError(fmt::format("{}: short read of the object's trailer", path));
    MEMASCEND_ASSIGN_OR_RETURN(Trailer t, DecodeTrailer(tb, path));
    if (util::RoundUp(t.size, std::uint64_t{kBlock}) + trailer_bytes != length ||
        Escape(t.name) + kObjectSuffix != e) {
      return absl::DataLossError(fmt::format(
          "{}: the trailer names '{}' of {} bytes, which is not this file", path, t.name, t.size));
    }
    (void)fd.Close();
    if (t.durability == Durability::kScratch) {
      prim::RemoveQuietly(path);
      removed = true;
      continue;
    }
    Impl::Entry entry;
    entry.info = {t.name, t.size, t.metadata, t.durability, t.checksum, {}};
    absl::MutexLock lock(&m.mu);
    m.objects.emplace(t.name, std::move(entry));
  }
  if (removed) MEMASCEND_RETURN_IF_ERROR(m.SyncDir());
  return std::unique_ptr<FileObjectStore>(new FileObjectStore(std::move(impl)));
}

absl::Status FileObjectStore::Put(std::string_view name, std::span<const std::byte> data,
                                  Durability durability, std::string_view metadata) {
  Impl& m = *impl_;
  MEMASCEND_RETURN_IF_ERROR(m.CheckPut(name, metadata));
  const Trailer t{data.size(), util::Crc32c(data.data(), data.size()), durability,
                  std::string(name), std::string(metadata)};
  const std::string path = m.Path(name, kObjectSuffix);
  bool in_place;
  {
    absl::MutexLock lock(&m.mu);
    auto it = m.objects.find(name);
    // In place only over a scratch object or none: a durable or staged one is never put
    // at risk (and no commit touches a scratch object's file).
    in_place = durability == Durability::kScratch &&
               (it == m.objects.end() ||
                (it->second.info.durability == Durability::kScratch && !it->second.staged));
  }
  const bool durable = durability == Durability::kDurable;
  absl::Status s;
  std::optional<absl::ReaderMutexLock> no_commit;  // while the file goes into place
  if (in_place) {
    s = m.WriteFile(path, data, t, /*truncate_first=*/false, /*sync=*/false);
  } else {
    const std::string tmp = m.Path(name, kTmpSuffix);
    s = m.WriteFile(tmp, data, t, /*truncate_first=*/true, /*sync=*/durable);
    if (!s.ok()) {
      prim::RemoveQuietly(tmp);  // the old object, staged or not, stays
      return s;
    }
    no_commit.emplace(&m.sync_mu);
  }
  {
    // The rename and the record together (Note [file store commits]): a Delete, a Get or
    // a commit sees the object before or after, never the file without its entry.
    absl::MutexLock lock(&m.mu);
    if (!in_place) {
      s = prim::Rename(m.Path(name, kTmpSuffix), path);
      if (!s.ok()) {
        prim::RemoveQuietly(m.Path(name, kTmpSuffix));
        return s;
      }
      prim::RemoveQuietly(m.Path(name, kNewSuffix));  // a staged version, superseded
    }
    Impl::Entry& e = m.objects[std::string(name)];
    m.Unstage(e);
    e.info = {t.name, t.size, t.metadata, durability, t.checksum, {}};
    e.committed.reset();
    e.lost.clear();
    if (!s.ok()) {
      // The old bytes were overwritten in place (Note [file store commits]).
      e.lost = fmt::format(
          "the write of '{}' to {} failed ({}): its old contents were overwritten in place", name,
          path, std::string(s.message()));
      return s;
    }
  }
  no_commit.reset();
  // Renamed, the object is the new one whether or not the directory's flush succeeds; a
  // failed flush is returned (its durability is not known) and retried by the next Sync().
  return durable ? m.FlushDirectoryOrKeepIt() : absl::OkStatus();
}

absl::Status FileObjectStore::PutStaged(std::string_view name, std::span<const std::byte> data,
                                        std::string_view metadata) {
  Impl& m = *impl_;
  MEMASCEND_RETURN_IF_ERROR(m.CheckPut(name, metadata));
  const Trailer t{data.size(), util::Crc32c(data.data(), data.size()), Durability::kDurable,
                  std::string(name), std::string(metadata)};
  // Through NAME.tmp, written while a commit may run, and renamed to NAME.new when no
  // commit does (Note [file store commits]): a failure leaves a staged version as it was.
  const std::string tmp = m.Path(name, kTmpSuffix);
  if (absl::Status s = m.WriteFile(tmp, data, t, /*truncate_first=*/true, /*sync=*/false);
      !s.ok()) {
    prim::RemoveQuietly(tmp);
    return s;
  }
  absl::ReaderMutexLock no_commit(&m.sync_mu);
  absl::MutexLock lock(&m.mu);
  if (absl::Status s = prim::Rename(tmp, m.Path(name, kNewSuffix)); !s.ok()) {
    prim::RemoveQuietly(tmp);
    return s;
  }
  Impl::Entry& e = m.objects[std::string(name)];
  if (!e.staged && !e.info.name.empty()) {  // what DropStaged goes back to
    e.committed = e.info;
    e.committed_lost = e.lost;
  }
  m.Unstage(e);
  e.info = {t.name, t.size, t.metadata, Durability::kDurable, t.checksum, {}};
  e.staged = true;
  m.staged_total += Impl::FileBytes(t.size);
  e.lost.clear();
  return absl::OkStatus();
}

absl::Status FileObjectStore::DropStaged(std::span<const std::string> names) {
  Impl& m = *impl_;
  absl::MutexLock one_at_a_time(&m.sync_mu);
  absl::MutexLock lock(&m.mu);
  for (const std::string& name : names) {
    auto it = m.objects.find(name);
    if (it == m.objects.end() || !it->second.staged) continue;
    Impl::Entry& e = it->second;
    prim::RemoveQuietly(m.Path(name, kNewSuffix));
    m.Unstage(e);
    if (!e.committed.has_value()) {
      m.objects.erase(it);
      continue;
    }
    e.info = *std::move(e.committed);
    e.lost = std::move(e.committed_lost);
    e.committed.reset();
  }
  return absl::OkStatus();
}

absl::Status FileObjectStore::Sync() { return SyncStaged(nullptr); }

absl::Status FileObjectStore::SyncOnly(std::span<const std::string> names) {
  const std::set<std::string_view> only(names.begin(), names.end());
  return SyncStaged(&only);
}

std::uint64_t FileObjectStore::staged_bytes() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->staged_total;
}

absl::Status FileObjectStore::SyncStaged(const std::set<std::string_view>* only) {
  Impl& m = *impl_;
  absl::MutexLock one_at_a_time(&m.sync_mu);
  std::vector<std::string> staged;
  {
    absl::MutexLock lock(&m.mu);
    for (const auto& [name, e] : m.objects)
      if (e.staged && (only == nullptr || only->contains(name))) staged.push_back(name);
  }
  auto still_staged = [&](const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m.mu) {
    auto it = m.objects.find(name);
    return it != m.objects.end() && it->second.staged;
  };
  for (const std::string& name : staged) {  // their bytes first, then the names
    const std::string fresh = m.Path(name, kNewSuffix);
    prim::UniqueFd fd(::open(fresh.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) {
      const int err = errno;
      absl::MutexLock lock(&m.mu);
      if (err == ENOENT && !still_staged(name)) continue;  // a Delete since
      return absl::ErrnoToStatus(err, fmt::format("open({})", fresh));
    }
    MEMASCEND_RETURN_IF_ERROR(m.engine->Flush(fd.get(), FlushKind::kAll, fresh));
  }
  for (const std::string& name : staged) {
    // Under the lock: a Get sees the staged file or the committed one, and looks again if
    // the rename came between its lookup and its open.
    absl::MutexLock lock(&m.mu);
    if (!still_staged(name)) continue;
    m.dir_unsynced = true;  // from here until a directory flush succeeds
    MEMASCEND_RETURN_IF_ERROR(prim::Rename(m.Path(name, kNewSuffix), m.Path(name, kObjectSuffix)));
    Impl::Entry& e = m.objects.find(name)->second;
    m.Unstage(e);
    e.committed.reset();
  }
  // Also when nothing was staged: an earlier rename whose directory flush failed.
  return m.SyncDirectory();
}

absl::StatusOr<std::size_t> FileObjectStore::Get(std::string_view name, std::span<std::byte> out) {
  Impl& m = *impl_;
  ObjectInfo info;
  std::string path;
  prim::UniqueFd fd;
  // A staged object's file is renamed by a Sync() on another thread (the committer) between
  // the lookup and the open: look again.
  for (int attempt = 0; !fd; ++attempt) {
    {
      absl::MutexLock lock(&m.mu);
      auto it = m.objects.find(name);
      if (it == m.objects.end()) return absl::NotFoundError(fmt::format("no object '{}'", name));
      if (!it->second.lost.empty()) return absl::DataLossError(it->second.lost);
      info = it->second.info;
      path = m.Path(name, it->second.staged ? kNewSuffix : kObjectSuffix);
    }
    if (out.size() < info.size) {
      return absl::InvalidArgumentError(
          fmt::format("object '{}' holds {} bytes, the buffer {}", name, info.size, out.size()));
    }
    fd = prim::UniqueFd(::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
    if (!fd && (errno != ENOENT || attempt == 3))
      return absl::ErrnoToStatus(errno, fmt::format("open({})", path));
  }
  MEMASCEND_ASSIGN_OR_RETURN(FileId file, m.engine->RegisterFile(fd.get()));
  std::uint32_t crc = 0;
  absl::Status s = storage::Transfer(
      m.engine, file, kBlock, IoOp::kRead, 0, out.data(), info.size,
      m.verify ? std::function<void(std::span<const std::byte>)>([&](std::span<const std::byte> c) {
        crc = util::Crc32c(crc, c.data(), c.size());
      })
               : nullptr);
  (void)m.engine->UnregisterFile(file);
  MEMASCEND_RETURN_IF_ERROR(s);
  if (m.verify && crc != info.checksum) {
    return absl::DataLossError(
        fmt::format("object '{}' ({}): checksum mismatch (stored {:08x}, read {:08x})", name, path,
                    info.checksum, crc));
  }
  return info.size;
}

absl::StatusOr<ObjectInfo> FileObjectStore::Stat(std::string_view name) const {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->objects.find(name);
  if (it == impl_->objects.end()) return absl::NotFoundError(fmt::format("no object '{}'", name));
  if (!it->second.lost.empty()) return absl::DataLossError(it->second.lost);
  return it->second.info;
}

std::vector<ObjectInfo> FileObjectStore::List() const {
  absl::MutexLock lock(&impl_->mu);
  std::vector<ObjectInfo> out;
  for (const auto& [name, e] : impl_->objects)
    if (e.lost.empty()) out.push_back(e.info);
  return out;
}

absl::Status FileObjectStore::Delete(std::string_view name) {
  Impl& m = *impl_;
  bool durable;
  {
    absl::MutexLock lock(&m.mu);
    auto it = m.objects.find(name);
    if (it == m.objects.end()) return absl::NotFoundError(fmt::format("no object '{}'", name));
    durable = it->second.info.durability == Durability::kDurable;
    // The committed file first: if it cannot go, nothing has (a staged one stays staged).
    if (::unlink(m.Path(name, kObjectSuffix).c_str()) != 0 && errno != ENOENT)
      return absl::ErrnoToStatus(errno, fmt::format("unlink({})", m.Path(name, kObjectSuffix)));
    prim::RemoveQuietly(m.Path(name, kNewSuffix));
    m.Unstage(it->second);
    m.objects.erase(it);
  }
  return durable ? m.FlushDirectoryOrKeepIt() : absl::OkStatus();
}

}  // namespace memascend
