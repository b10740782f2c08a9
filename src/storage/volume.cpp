#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <sys/file.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <absl/cleanup/cleanup.h>
#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/block_target.h>
#include <memascend/status.h>
#include <memascend/volume.h>

#include "prim/file.h"
#include "storage/extent_allocator.h"
#include "storage/format.h"
#include "storage/transfer.h"
#include "util/align.h"
#include "util/crc32c.h"
#include "util/units.h"

namespace memascend {

namespace {

using storage::Aligned;
using storage::AllocAligned;
using storage::Extent;
using storage::JournalRecord;
using storage::kMetaBlock;
using storage::kWindowBytes;
using storage::RecordType;
using storage::Superblock;
using storage::Transfer;

// What two valid superblocks of one volume must share (they differ in generation, active
// half and epoch only): "" when they do, else the first field that differs.
std::string GeometryDiffers(const Superblock& a, const Superblock& b) {
  if (a.uuid != b.uuid) return "uuid";
  if (a.block_size != b.block_size) return "block size";
  if (a.unit_bytes != b.unit_bytes) return "unit";
  if (a.capacity != b.capacity) return fmt::format("capacity ({} / {})", a.capacity, b.capacity);
  if (a.journal_offset != b.journal_offset || a.journal_half_bytes != b.journal_half_bytes)
    return "journal region";
  if (a.data_offset != b.data_offset || a.data_units != b.data_units) return "data region";
  return "";
}

// Note [volume growth]: `newer` and `older` agree but for a larger data region in `newer`.
bool InterruptedGrow(const Superblock& newer, const Superblock& older) {
  Superblock a = older;
  a.capacity = newer.capacity;
  a.data_units = newer.data_units;
  return newer.generation > older.generation && newer.capacity > older.capacity &&
         newer.data_units > older.data_units && GeometryDiffers(newer, a).empty();
}

std::string UuidString(const std::array<std::uint8_t, 16>& u) {
  std::string s;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += fmt::format("{:02x}", u[static_cast<std::size_t>(i)]);
  }
  return s;
}

struct Object {
  std::uint64_t size = 0;
  std::string metadata;
  std::uint32_t checksum = 0;
  std::vector<Extent> extents;
  Durability durability = Durability::kDurable;
};

}  // namespace

struct Volume::Impl {
  BlockTarget target;
  std::unique_ptr<IoEngine> own_engine;
  IoEngine* engine = nullptr;
  FileId file;
  bool verify = true;
  std::vector<std::string> open_warnings;
  std::vector<std::string> open_errors;

  mutable absl::Mutex mu;
  Superblock sb ABSL_GUARDED_BY(mu);
  std::map<std::string, Object, std::less<>> objects ABSL_GUARDED_BY(mu);
  // Note [staged puts]: written, not yet committed; they shadow `objects`. A Sync holds
  // sync_mu exclusively while it commits them, so their extents cannot change meanwhile.
  std::map<std::string, Object, std::less<>> staged ABSL_GUARDED_BY(mu);
  std::uint64_t staged_units ABSL_GUARDED_BY(mu) = 0;  // of `staged`'s extents
  absl::Mutex sync_mu;

  static std::uint64_t Units(const Object& o) {
    std::uint64_t units = 0;
    for (const Extent& e : o.extents) units += e.units;
    return units;
  }

  absl::StatusOr<std::vector<Extent>> WriteData(std::string_view name,
                                                std::span<const std::byte> data,
                                                std::string_view metadata);

  const Object* FindLocked(std::string_view name) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (auto it = staged.find(name); it != staged.end()) return &it->second;
    if (auto it = objects.find(name); it != objects.end()) return &it->second;
    return nullptr;
  }
  // Drops a staged version (its extents were never committed).
  void UnstageLocked(std::string_view name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (auto it = staged.find(name); it != staged.end()) {
      (void)alloc->Free(it->second.extents);
      staged_units -= Units(it->second);
      staged.erase(it);
    }
  }
  // Commits the staged objects (those `only` names, when given) in one journal commit.
  // Commit() flushes the data before the records and applies them: the committed
  // versions' old extents are freed, the staged ones become the objects. PutStaged holds
  // sync_mu shared, so nothing is staged again while the commit runs; the extents are
  // compared anyway before an entry leaves.
  absl::Status SyncStaged(const std::set<std::string_view>* only) {
    absl::MutexLock sync(&sync_mu);
    std::vector<JournalRecord> records;
    {
      absl::ReaderMutexLock lock(&mu);
      for (const auto& [name, o] : staged) {
        if (only == nullptr || only->contains(name))
          records.push_back({RecordType::kPut, name, o.metadata, o.size, o.checksum, o.extents});
      }
    }
    if (records.empty()) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(Commit(records));
    absl::MutexLock lock(&mu);
    if (only == nullptr) {
      staged.clear();
      staged_units = 0;
      return absl::OkStatus();
    }
    for (const JournalRecord& r : records) {
      auto it = staged.find(r.name);
      if (it == staged.end() || it->second.extents != r.extents) continue;
      staged_units -= Units(it->second);
      staged.erase(it);
    }
    return absl::OkStatus();
  }
  std::unique_ptr<storage::ExtentAllocator> alloc ABSL_GUARDED_BY(mu);
  std::uint64_t next_block ABSL_GUARDED_BY(mu) = 0;
  absl::Status poisoned ABSL_GUARDED_BY(mu);
  std::uint64_t commits ABSL_GUARDED_BY(mu) = 0;
  std::uint64_t compactions ABSL_GUARDED_BY(mu) = 0;

  struct Pending {
    std::vector<JournalRecord> records;
    absl::Status result;
    bool done = false;
  };
  absl::Mutex commit_mu;
  absl::CondVar commit_cv;
  std::deque<Pending*> queue ABSL_GUARDED_BY(commit_mu);
  bool leader ABSL_GUARDED_BY(commit_mu) = false;

  explicit Impl(BlockTarget t) : target(std::move(t)) {}
  ~Impl() {
    if (engine != nullptr && file.index >= 0) (void)engine->UnregisterFile(file);
  }

  std::size_t block() const { return target.io_block(); }

  absl::Status WriteBlocks(std::uint64_t offset, std::span<const std::byte> bytes) {
    Aligned buf = AllocAligned(bytes.size(), block());
    std::memcpy(buf.get(), bytes.data(), bytes.size());
    return Transfer(engine, file, block(), IoOp::kWrite, offset, buf.get(), bytes.size());
  }

  absl::StatusOr<std::vector<std::byte>> ReadBlocks(std::uint64_t offset, std::size_t bytes) {
    Aligned buf = AllocAligned(bytes, block());
    MEMASCEND_RETURN_IF_ERROR(
        Transfer(engine, file, block(), IoOp::kRead, offset, buf.get(), bytes));
    return std::vector<std::byte>(buf.get(), buf.get() + bytes);
  }

  // A failed superblock write leaves it unknown which superblock the disk holds: nothing
  // more is written (reopening reads whichever it is; both are whole). A failed journal
  // commit is sealed off instead (WriteBatch).
  absl::Status WriteMetadataOrPoison(std::uint64_t offset, std::span<const std::byte> bytes) {
    absl::Status s = WriteBlocks(offset, bytes);
    return s.ok() ? s : Poison("a superblock", s);
  }
  absl::Status Poison(std::string_view what, const absl::Status& why) {
    absl::MutexLock lock(&mu);
    poisoned = absl::DataLossError(
        fmt::format("writing {} failed ({}); whether it reached the disk is unknown, so the volume "
                    "accepts no more writes: reopen it",
                    what, std::string(why.message())));
    return poisoned;
  }

  // A failed flush leaves the device's contents unknown: nothing more is written.
  absl::Status SyncOrPoison() {
    absl::Status s = engine->Flush(target.fd(), FlushKind::kData, target.path());
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      poisoned = absl::DataLossError(
          fmt::format("the volume failed to flush ({}); it accepts no more writes: reopen it",
                      std::string(s.message())));
      return poisoned;
    }
    return absl::OkStatus();
  }

  std::uint64_t DataOffset(const Extent& e) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return sb.data_offset + e.start * sb.unit_bytes;
  }

  void ApplyLocked(const std::vector<JournalRecord>& records) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const JournalRecord& r : records) {
      auto it = objects.find(r.name);
      if (it != objects.end()) {
        (void)alloc->Free(it->second.extents);
        objects.erase(it);
      }
      if (r.type == RecordType::kPut) {
        objects.emplace(r.name,
                        Object{r.size, r.metadata, r.checksum, r.extents, Durability::kDurable});
      }
    }
  }

  // Note [journal seals] (storage/format.h): once a commit ending before `slot` is durable,
  // a seal goes into `slot` of the half at `half_offset`, unflushed (it becomes durable
  // with the next flush; a seal lost in a crash only leaves that commit's later damage
  // undetectable). Its failure fails nothing: the commit is durable without it.
  void Seal(std::uint64_t half_offset, std::uint64_t slot, std::uint64_t half_blocks,
            std::uint64_t epoch) {
    if (slot >= half_blocks) return;
    (void)WriteBlocks(half_offset + slot * kMetaBlock, storage::EncodeSeal(slot, epoch));
  }

  // Note [journal halves].
  absl::Status Compact(const std::vector<JournalRecord>& records) {
    // The snapshot is the state after `records`: a name they delete or put again is not
    // in it twice, so a delete always fits (the journal never traps the user: `rm` and
    // compaction work on a full journal), and so does a put that replaces an object.
    std::vector<JournalRecord> all;
    Superblock next;
    {
      absl::MutexLock lock(&mu);
      std::map<std::string_view, bool> replaced;  // named by `records`
      for (const JournalRecord& r : records) replaced[r.name] = true;
      for (const auto& [name, o] : objects) {
        if (o.durability != Durability::kDurable || replaced.contains(name)) continue;
        all.push_back({RecordType::kPut, name, o.metadata, o.size, o.checksum, o.extents});
      }
      next = sb;
    }
    // The records' last word on each name: a put stays, a delete is left out.
    std::map<std::string_view, const JournalRecord*> last;
    for (const JournalRecord& r : records) last[r.name] = &r;
    for (const JournalRecord& r : records) {
      if (last[r.name] == &r && r.type == RecordType::kPut) all.push_back(r);
    }
    const std::uint64_t half_blocks = next.journal_half_bytes / kMetaBlock;
    const std::size_t blocks = storage::CommitBlocks(all);
    if (blocks > half_blocks || blocks > 0xffff) {
      return absl::ResourceExhaustedError(
          fmt::format("journal full: {} objects need {} journal blocks, a half holds {}; reformat "
                      "with a larger "
                      "journal",
                      all.size(), blocks, half_blocks));
    }
    next.generation += 1;
    next.active_half = 1 - next.active_half;
    next.epoch += 1;
    const std::vector<std::byte> bytes = storage::EncodeCommit(all, 0, next.epoch);
    // Unreferenced until the superblock below lands: a failure here needs no more.
    MEMASCEND_RETURN_IF_ERROR(
        WriteBlocks(next.journal_offset + next.active_half * next.journal_half_bytes, bytes));
    MEMASCEND_RETURN_IF_ERROR(SyncOrPoison());
    const auto super = storage::EncodeSuperblock(next);
    MEMASCEND_RETURN_IF_ERROR(WriteMetadataOrPoison((next.generation % 2) * kMetaBlock, super));
    MEMASCEND_RETURN_IF_ERROR(SyncOrPoison());
    Seal(next.journal_offset + next.active_half * next.journal_half_bytes, blocks, half_blocks,
         next.epoch);
    absl::MutexLock lock(&mu);
    sb = next;
    next_block = blocks;
    ++compactions;
    ++commits;
    ApplyLocked(records);
    return absl::OkStatus();
  }

  absl::Status WriteBatch(const std::vector<JournalRecord>& records) {
    std::uint64_t slot, offset, epoch, half_blocks;
    {
      absl::MutexLock lock(&mu);
      if (!poisoned.ok()) return poisoned;
      slot = next_block;
      half_blocks = sb.journal_half_bytes / kMetaBlock;
      offset = sb.journal_offset + sb.active_half * sb.journal_half_bytes + slot * kMetaBlock;
      epoch = sb.epoch;
    }
    const std::size_t blocks = storage::CommitBlocks(records);
    if (slot + blocks > half_blocks || blocks > 0xffff) return Compact(records);
    MEMASCEND_RETURN_IF_ERROR(SyncOrPoison());  // the objects' data first
    if (absl::Status s = WriteBlocks(offset, storage::EncodeCommit(records, slot, epoch));
        !s.ok()) {
      // Whether the commit reached the disk is unknown (a write can fail after it landed),
      // and one that did names extents the caller's failure frees. A seal at its slot,
      // flushed, ends the journal before it for certain; if even that fails, nothing more
      // is written (Note [journal seals]).
      absl::Status sealed = WriteBlocks(offset, storage::EncodeSeal(slot, epoch));
      if (sealed.ok()) sealed = SyncOrPoison();
      if (!sealed.ok()) return Poison("a journal commit", s);
      return s;
    }
    MEMASCEND_RETURN_IF_ERROR(SyncOrPoison());  // then their records
    Seal(offset - slot * kMetaBlock, slot + blocks, half_blocks, epoch);
    absl::MutexLock lock(&mu);
    next_block = slot + blocks;
    ++commits;
    ApplyLocked(records);
    return absl::OkStatus();
  }

  // Group commit: the first waiter writes everything queued in one journal write.
  absl::Status Commit(std::vector<JournalRecord> records) {
    Pending me;
    me.records = std::move(records);
    absl::MutexLock lock(&commit_mu);
    queue.push_back(&me);
    while (!me.done) {
      if (leader) {
        commit_cv.Wait(&commit_mu);
        continue;
      }
      leader = true;
      std::vector<Pending*> batch(queue.begin(), queue.end());
      queue.clear();
      std::vector<JournalRecord> all;
      for (Pending* p : batch) all.insert(all.end(), p->records.begin(), p->records.end());
      commit_mu.Unlock();
      const absl::Status s = WriteBatch(all);
      commit_mu.Lock();
      for (Pending* p : batch) {
        p->result = s;
        p->done = true;
      }
      leader = false;
      commit_cv.SignalAll();
    }
    return me.result;
  }
};

Volume::Volume(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Volume::~Volume() = default;

IoEngine* Volume::engine() const noexcept { return impl_->engine; }

absl::StatusOr<std::unique_ptr<Volume>> Volume::Open(const std::string& path,
                                                     const VolumeOpenOptions& options) {
  MEMASCEND_ASSIGN_OR_RETURN(BlockTarget target, BlockTarget::Open(path, {}));
  const auto give_up = std::chrono::steady_clock::now() + options.lock_wait;
  while (::flock(target.fd(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR)
      return absl::ErrnoToStatus(errno, fmt::format("flock({})", path));
    if (std::chrono::steady_clock::now() >= give_up) {
      return absl::UnavailableError(
          fmt::format("{} is open in another process (the volume's lock is held; waited {} ms)",
                      path, options.lock_wait.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto impl = std::make_unique<Impl>(std::move(target));
  Impl& m = *impl;
  m.verify = options.verify_checksums;
  if (options.engine != nullptr) {
    m.engine = options.engine;
  } else {
    IoEngineOptions eo;
    eo.notice = [](std::string_view) {};  // the volume reports its backend in stats
    MEMASCEND_ASSIGN_OR_RETURN(m.own_engine, IoEngine::Create(eo));
    m.engine = m.own_engine.get();
  }
  MEMASCEND_ASSIGN_OR_RETURN(m.file, m.engine->RegisterFile(m.target.fd()));
  if (m.target.size() < 2 * kMetaBlock)
    return absl::FailedPreconditionError(fmt::format("{} is not a MemAscend volume", path));
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<std::byte> head, m.ReadBlocks(0, 2 * kMetaBlock));
  absl::StatusOr<Superblock> copies[2] = {
      storage::DecodeSuperblock({head.data(), kMetaBlock}),
      storage::DecodeSuperblock({head.data() + kMetaBlock, kMetaBlock})};
  if (!copies[0].ok() && !copies[1].ok()) {
    if (!DetectSignature(head).has_value() || *DetectSignature(head) != "memascend") {
      return absl::FailedPreconditionError(
          fmt::format("{} is not a MemAscend volume (format it first)", path));
    }
    return absl::DataLossError(fmt::format("{}: both superblocks are damaged ({}; {})", path,
                                           std::string(copies[0].status().message()),
                                           std::string(copies[1].status().message())));
  }
  int pick = !copies[0].ok()   ? 1
             : !copies[1].ok() ? 0
                               : (copies[1]->generation > copies[0]->generation ? 1 : 0);
  if (!copies[1 - pick].ok()) {
    m.open_errors.push_back(fmt::format(
        "superblock {} is damaged ({}); using superblock {} (generation {}); `fsck --repair` "
        "rewrites it",
        1 - pick, std::string(copies[1 - pick].status().message()), pick,
        copies[pick]->generation));
  } else if (const std::string why = GeometryDiffers(*copies[0], *copies[1]);
             !why.empty() && InterruptedGrow(*copies[pick], *copies[1 - pick])) {
    // Note [volume growth]: the newer is larger and alone differs in size.
    m.open_warnings.push_back(fmt::format(
        "superblock {} has the size before a grow that did not finish ({}); using superblock "
        "{} (generation {}); `fsck --repair` rewrites it",
        1 - pick, why, pick, copies[pick]->generation));
  } else if (!why.empty()) {
    // Both valid, but not of one volume: which one to trust cannot be told.
    const std::string e = fmt::format("superblocks 0 and 1 disagree: {}", why);
    if (!options.allow_data_loss) {
      return absl::DataLossError(
          fmt::format("{}: {} (to read the volume by the newer, generation {}: `memascend "
                      "volume ls|get|fsck PATH --allow-data-loss`, or "
                      "VolumeOpenOptions::allow_data_loss in the API)",
                      path, e, copies[pick]->generation));
    }
    m.open_errors.push_back(e);
  }
  Superblock sb = *copies[pick];
  if (sb.capacity > m.target.size()) {
    return absl::DataLossError(fmt::format("{}: the volume spans {} but the target holds {}", path,
                                           sb.capacity, m.target.size()));
  }
  MEMASCEND_ASSIGN_OR_RETURN(
      std::vector<std::byte> half,
      m.ReadBlocks(sb.journal_offset + sb.active_half * sb.journal_half_bytes,
                   sb.journal_half_bytes));
  storage::Replay replay = storage::ReplayJournal(half, sb.epoch);
  if (replay.corrupt) {
    if (!options.allow_data_loss) {
      return absl::DataLossError(
          fmt::format("{}: journal damaged: {} (to read what the {} commits before it hold: "
                      "`memascend volume ls|get|fsck PATH --allow-data-loss`, or "
                      "VolumeOpenOptions::allow_data_loss in the API)",
                      path, replay.detail, replay.commits));
    }
    m.open_errors.push_back("journal damaged: " + replay.detail);
  } else if (replay.torn_tail) {
    m.open_warnings.push_back(replay.detail);
  }
  absl::MutexLock lock(&m.mu);
  m.sb = sb;
  for (JournalRecord& r : replay.records) {  // the last record of a name wins
    m.objects.erase(r.name);
    if (r.type == RecordType::kPut) {
      m.objects.emplace(r.name, Object{r.size, std::move(r.metadata), r.checksum,
                                       std::move(r.extents), Durability::kDurable});
    }
  }
  m.alloc = std::make_unique<storage::ExtentAllocator>(sb.data_units);
  for (const auto& [name, o] : m.objects) {  // free space: whatever no object holds
    if (absl::Status s = m.alloc->Reserve(o.extents); !s.ok()) {
      return absl::DataLossError(
          fmt::format("{}: object '{}': {}", path, name, std::string(s.message())));
    }
  }
  m.next_block = replay.blocks_used;
  return std::unique_ptr<Volume>(new Volume(std::move(impl)));
}

// Allocates extents for `data` and writes it; the caller commits or frees them.
absl::StatusOr<std::vector<Extent>> Volume::Impl::WriteData(std::string_view name,
                                                            std::span<const std::byte> data,
                                                            std::string_view metadata) {
  Impl& m = *this;
  MEMASCEND_RETURN_IF_ERROR(storage::CheckObject(name, metadata));
  std::vector<Extent> extents;
  std::uint64_t unit;
  {
    absl::MutexLock lock(&m.mu);
    if (!m.poisoned.ok()) return m.poisoned;
    unit = m.sb.unit_bytes;
    auto got = m.alloc->Allocate((data.size() + unit - 1) / unit);
    if (!got.ok()) {
      return absl::ResourceExhaustedError(
          fmt::format("put '{}' ({}): {}; free {}, largest free extent {}", name,
                      util::FormatBytes(data.size()), std::string(got.status().message()),
                      util::FormatBytes(m.alloc->free_units() * unit),
                      util::FormatBytes(m.alloc->largest_free() * unit)));
    }
    extents = *std::move(got);
  }
  std::uint64_t done = 0;
  for (const Extent& e : extents) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(e.units * unit, data.size() - done));
    std::uint64_t offset;
    {
      absl::ReaderMutexLock lock(&m.mu);
      offset = m.DataOffset(e);
    }
    if (absl::Status s = Transfer(m.engine, m.file, m.block(), IoOp::kWrite, offset,
                                  const_cast<std::byte*>(data.data()) + done, n);
        !s.ok()) {
      absl::MutexLock lock(&m.mu);
      (void)m.alloc->Free(extents);
      return s;
    }
    done += n;
  }
  return extents;
}

absl::Status Volume::Put(std::string_view name, std::span<const std::byte> data,
                         Durability durability, std::string_view metadata) {
  Impl& m = *impl_;
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<Extent> extents, m.WriteData(name, data, metadata));
  {
    // A staged version is superseded by this one.
    absl::ReaderMutexLock sync(&m.sync_mu);
    absl::MutexLock lock(&m.mu);
    m.UnstageLocked(name);
  }
  const auto release = [&] {
    absl::MutexLock lock(&m.mu);
    (void)m.alloc->Free(extents);
  };
  const std::uint32_t checksum = util::Crc32c(data.data(), data.size());
  if (durability == Durability::kDurable) {
    absl::Status s = m.Commit({{RecordType::kPut, std::string(name), std::string(metadata),
                                data.size(), checksum, extents}});
    if (!s.ok()) release();
    return s;
  }
  bool replaces_durable = false;
  {
    absl::ReaderMutexLock lock(&m.mu);
    auto it = m.objects.find(name);
    replaces_durable = it != m.objects.end() && it->second.durability == Durability::kDurable;
  }
  if (replaces_durable) {  // its record must not resurrect it after a reopen
    if (absl::Status s = m.Commit({{RecordType::kDelete, std::string(name), {}, 0, 0, {}}});
        !s.ok()) {
      release();
      return s;
    }
  }
  absl::MutexLock lock(&m.mu);
  if (auto it = m.objects.find(name); it != m.objects.end()) {
    (void)m.alloc->Free(it->second.extents);
    m.objects.erase(it);
  }
  m.objects.emplace(std::string(name), Object{data.size(), std::string(metadata), checksum, extents,
                                              Durability::kScratch});
  return absl::OkStatus();
}

absl::StatusOr<std::size_t> Volume::Get(std::string_view name, std::span<std::byte> out) {
  Impl& m = *impl_;
  Object o;
  std::uint64_t unit, data_offset;
  {
    absl::ReaderMutexLock lock(&m.mu);
    const Object* found = m.FindLocked(name);
    if (found == nullptr) return absl::NotFoundError(fmt::format("no object '{}'", name));
    o = *found;
    unit = m.sb.unit_bytes;
    data_offset = m.sb.data_offset;
  }
  if (out.size() < o.size) {
    return absl::InvalidArgumentError(
        fmt::format("object '{}' holds {} bytes; the buffer has {}", name, o.size, out.size()));
  }
  std::uint64_t done = 0;
  std::uint32_t crc = 0;  // accumulated chunk by chunk, while later chunks are in flight
  std::function<void(std::span<const std::byte>)> check;
  if (m.verify) {
    check = [&crc](std::span<const std::byte> chunk) {
      crc = util::Crc32c(crc, chunk.data(), chunk.size());
    };
  }
  for (const Extent& e : o.extents) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(e.units * unit, o.size - done));
    MEMASCEND_RETURN_IF_ERROR(Transfer(m.engine, m.file, m.block(), IoOp::kRead,
                                       data_offset + e.start * unit, out.data() + done, n, check));
    done += n;
  }
  if (m.verify) {
    if (crc != o.checksum) {
      return absl::DataLossError(fmt::format(
          "object '{}': checksum mismatch (stored {:08x}, read {:08x})", name, o.checksum, crc));
    }
  }
  return static_cast<std::size_t>(o.size);
}

namespace {
ObjectInfo Info(const std::string& name, const Object& o, const Superblock& sb) {
  ObjectInfo info{name, o.size, o.metadata, o.durability, o.checksum, {}};
  for (const Extent& e : o.extents)
    info.extents.push_back({sb.data_offset + e.start * sb.unit_bytes, e.units * sb.unit_bytes});
  return info;
}
}  // namespace

absl::StatusOr<ObjectInfo> Volume::Stat(std::string_view name) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  const Object* found = impl_->FindLocked(name);
  if (found == nullptr) return absl::NotFoundError(fmt::format("no object '{}'", name));
  return Info(std::string(name), *found, impl_->sb);
}

std::uint64_t Volume::staged_bytes() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->staged_units * impl_->sb.unit_bytes;
}

std::vector<ObjectInfo> Volume::List() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  std::vector<ObjectInfo> out;
  for (const auto& [name, o] : impl_->objects) {
    if (!impl_->staged.contains(name)) out.push_back(Info(name, o, impl_->sb));
  }
  for (const auto& [name, o] : impl_->staged) out.push_back(Info(name, o, impl_->sb));
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.name < b.name; });
  return out;
}

absl::Status Volume::PutStaged(std::string_view name, std::span<const std::byte> data,
                               std::string_view metadata) {
  Impl& m = *impl_;
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<Extent> extents, m.WriteData(name, data, metadata));
  const std::uint32_t checksum = util::Crc32c(data.data(), data.size());
  absl::ReaderMutexLock sync(&m.sync_mu);
  absl::MutexLock lock(&m.mu);
  m.UnstageLocked(name);
  auto [it, added] =
      m.staged.emplace(std::string(name), Object{data.size(), std::string(metadata), checksum,
                                                 std::move(extents), Durability::kDurable});
  m.staged_units += Impl::Units(it->second);
  return absl::OkStatus();
}

absl::Status Volume::Sync() { return impl_->SyncStaged(nullptr); }

absl::Status Volume::SyncOnly(std::span<const std::string> names) {
  const std::set<std::string_view> only(names.begin(), names.end());
  return impl_->SyncStaged(&only);
}

absl::Status Volume::DropStaged(std::span<const std::string> names) {
  Impl& m = *impl_;
  absl::MutexLock sync(&m.sync_mu);  // not while a commit runs
  absl::MutexLock lock(&m.mu);
  for (const std::string& name : names) m.UnstageLocked(name);
  return absl::OkStatus();
}

absl::Status Volume::Delete(std::string_view name) {
  Impl& m = *impl_;
  {
    absl::ReaderMutexLock sync(&m.sync_mu);
    absl::MutexLock lock(&m.mu);
    const bool was_staged = m.staged.contains(name);
    m.UnstageLocked(name);
    auto it = m.objects.find(name);
    if (it == m.objects.end()) {
      if (was_staged) return absl::OkStatus();
      return absl::NotFoundError(fmt::format("no object '{}'", name));
    }
    if (it->second.durability == Durability::kScratch) {
      (void)m.alloc->Free(it->second.extents);
      m.objects.erase(it);
      return absl::OkStatus();
    }
  }
  return m.Commit({{RecordType::kDelete, std::string(name), {}, 0, 0, {}}});
}

VolumeStats Volume::stats() const {
  const Impl& m = *impl_;
  absl::ReaderMutexLock lock(&m.mu);
  VolumeStats s;
  s.uuid = UuidString(m.sb.uuid);
  s.generation = m.sb.generation;
  s.capacity_bytes = m.sb.capacity;
  s.unit_bytes = m.sb.unit_bytes;
  s.block_bytes = m.sb.block_size;
  s.data_bytes = m.sb.data_units * m.sb.unit_bytes;
  s.free_bytes = m.alloc->free_units() * m.sb.unit_bytes;
  s.used_bytes = s.data_bytes - s.free_bytes;
  s.largest_free_extent_bytes = m.alloc->largest_free() * m.sb.unit_bytes;
  s.fragmentation = m.alloc->fragmentation();
  s.objects = m.objects.size();
  for (const auto& [name, o] : m.objects) s.durable_objects += o.durability == Durability::kDurable;
  s.journal_bytes = m.sb.journal_half_bytes;
  s.journal_used_bytes = m.next_block * kMetaBlock;
  s.commits = m.commits;
  s.compactions = m.compactions;
  return s;
}

absl::Status Volume::Grow(std::uint64_t size) {
  Impl& m = *impl_;
  // Alone with the journal: no commit (nor compaction, which writes a superblock) runs.
  {
    absl::MutexLock lock(&m.commit_mu);
    while (m.leader) m.commit_cv.Wait(&m.commit_mu);
    m.leader = true;
  }
  absl::Cleanup done = [&m] {
    absl::MutexLock lock(&m.commit_mu);
    m.leader = false;
    m.commit_cv.SignalAll();
  };
  Superblock next;
  {
    absl::ReaderMutexLock lock(&m.mu);
    if (!m.poisoned.ok()) return m.poisoned;
    next = m.sb;
  }
  if (size <= next.capacity) return absl::OkStatus();
  const std::uint64_t units = (size - next.data_offset) / next.unit_bytes;
  if (units <= next.data_units) return absl::OkStatus();
  if (m.target.is_device()) {
    return absl::FailedPreconditionError(
        fmt::format("{} is a block device of {} bytes: a volume on it cannot grow to {}",
                    m.target.path(), m.target.size(), size));
  }
  const std::uint64_t capacity = next.data_offset + units * next.unit_bytes;
  if (capacity > m.target.size()) {
    auto free = prim::FreeBytes(m.target.path());
    if (free.ok() && *free < capacity - m.target.size()) {
      return absl::ResourceExhaustedError(fmt::format(
          "{}: growing the volume to {} needs {} more bytes; the file system has {} free",
          m.target.path(), util::FormatBytes(capacity), capacity - m.target.size(), *free));
    }
    MEMASCEND_RETURN_IF_ERROR(m.target.Grow(capacity));
  }
  next.capacity = capacity;
  next.data_units = units;
  for (int copy = 0; copy < 2; ++copy) {  // the older slot first, then the live one
    next.generation += 1;
    const auto super = storage::EncodeSuperblock(next);
    MEMASCEND_RETURN_IF_ERROR(m.WriteMetadataOrPoison((next.generation % 2) * kMetaBlock, super));
    MEMASCEND_RETURN_IF_ERROR(m.SyncOrPoison());
  }
  absl::MutexLock lock(&m.mu);
  m.sb = next;
  m.alloc->Extend(units);
  return absl::OkStatus();
}

absl::StatusOr<bool> Volume::RepairSuperblocks() {
  Impl& m = *impl_;
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<std::byte> head, m.ReadBlocks(0, 2 * kMetaBlock));
  Superblock next;
  {
    absl::MutexLock lock(&m.mu);
    if (!m.poisoned.ok()) return m.poisoned;
    next = m.sb;
  }
  const int live = static_cast<int>(next.generation % 2);
  auto other = storage::DecodeSuperblock({head.data() + (1 - live) * kMetaBlock, kMetaBlock});
  if (other.ok() && !InterruptedGrow(next, *other)) {
    if (const std::string why = GeometryDiffers(*other, next); !why.empty()) {
      return absl::DataLossError(fmt::format(
          "superblocks 0 and 1 disagree ({}): fsck cannot tell which is right; restore the "
          "volume or reformat it",
          why));
    }
    return false;  // both copies are whole
  }
  // The live superblock again, as the next generation, into the damaged copy's slot.
  next.generation += 1;
  const auto block = storage::EncodeSuperblock(next);
  MEMASCEND_RETURN_IF_ERROR(m.WriteMetadataOrPoison((next.generation % 2) * kMetaBlock, block));
  MEMASCEND_RETURN_IF_ERROR(m.SyncOrPoison());
  absl::MutexLock lock(&m.mu);
  m.sb.generation = next.generation;
  std::erase_if(m.open_errors, [](const std::string& e) { return e.starts_with("superblock "); });
  std::erase_if(m.open_warnings, [](const std::string& e) { return e.starts_with("superblock "); });
  return true;
}

absl::StatusOr<FsckReport> Volume::Fsck(bool verify_data) {
  Impl& m = *impl_;
  FsckReport r;
  r.errors = m.open_errors;
  r.warnings = m.open_warnings;
  // The on-disk structures as they are now.
  MEMASCEND_ASSIGN_OR_RETURN(std::vector<std::byte> head, m.ReadBlocks(0, 2 * kMetaBlock));
  Superblock sb;
  std::uint64_t next_block;
  std::vector<std::pair<std::string, Object>> objects;
  {
    absl::ReaderMutexLock lock(&m.mu);
    sb = m.sb;
    next_block = m.next_block;
    objects.assign(m.objects.begin(), m.objects.end());
    storage::ExtentAllocator fresh(sb.data_units);
    for (const auto& [name, o] : m.staged) {  // written, not yet committed: in use
      if (absl::Status s = fresh.Reserve(o.extents); !s.ok()) {
        r.errors.push_back(fmt::format("staged '{}': {}", name, std::string(s.message())));
      }
    }
    std::uint64_t used_units = 0;
    for (const auto& [name, o] : objects) {
      if (absl::Status s = fresh.Reserve(o.extents); !s.ok()) {
        r.errors.push_back(fmt::format("object '{}': {}", name, std::string(s.message())));
      }
      std::uint64_t units = 0;
      for (const Extent& e : o.extents) units += e.units;
      if (units * sb.unit_bytes < o.size)
        r.errors.push_back(fmt::format("object '{}': extents hold less than its size", name));
      used_units += units;
    }
    if (fresh.free_units() != m.alloc->free_units()) {
      r.errors.push_back(
          fmt::format("free space: {} units accounted free, {} free by the objects' extents",
                      m.alloc->free_units(), fresh.free_units()));
    }
    if (absl::Status s = m.alloc->CheckInvariants(); !s.ok())
      r.errors.push_back(std::string(s.message()));
    r.objects = objects.size();
    r.used_bytes = used_units * sb.unit_bytes;
    r.free_bytes = m.alloc->free_units() * sb.unit_bytes;
  }
  for (int i = 0; i < 2; ++i) {
    auto copy = storage::DecodeSuperblock({head.data() + i * kMetaBlock, kMetaBlock});
    if (!copy.ok()) {
      const std::string e =
          fmt::format("superblock {}: {}", i, std::string(copy.status().message()));
      if (std::find(r.errors.begin(), r.errors.end(), e) == r.errors.end()) r.errors.push_back(e);
    }
  }
  MEMASCEND_ASSIGN_OR_RETURN(
      std::vector<std::byte> half,
      m.ReadBlocks(sb.journal_offset + sb.active_half * sb.journal_half_bytes,
                   sb.journal_half_bytes));
  const storage::Replay replay = storage::ReplayJournal(half, sb.epoch);
  if (replay.corrupt) r.errors.push_back("journal: " + replay.detail);
  if (replay.blocks_used != next_block) {
    r.errors.push_back(fmt::format("journal: {} blocks replay, {} written since open",
                                   replay.blocks_used, next_block));
  }
  if (verify_data) {
    std::vector<std::byte> buf;
    for (const auto& [name, o] : objects) {
      buf.resize(o.size);
      auto got = Get(name, buf);
      if (!got.ok() && got.status().code() != absl::StatusCode::kNotFound) {
        r.errors.push_back(std::string(got.status().message()));
      }
    }
  }
  r.clean = r.errors.empty();
  return r;
}

}  // namespace memascend
