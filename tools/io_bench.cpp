#include "io_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/block_target.h>
#include <memascend/host_arena.h>
#include <memascend/status.h>

#include "prim/file.h"
#include "prim/unique_fd.h"

namespace memascend::cli {
namespace {

// Keeps `depth` requests in flight over [0, size): each completion submits the next
// block from the engine's completion path, so the queue never drains between requests.
class Stream {
 public:
  Stream(IoEngine* engine, FileId file, IoOp op, std::byte* buffers, std::size_t block,
         unsigned depth, std::uint64_t size)
      : engine_(engine),
        file_(file),
        op_(op),
        buffers_(buffers),
        block_(block),
        depth_(depth),
        size_(size) {}

  absl::Status Run() {
    const std::uint64_t blocks = (size_ + block_ - 1) / block_;
    const unsigned slots = static_cast<unsigned>(std::min<std::uint64_t>(depth_, blocks));
    for (unsigned slot = 0; slot < slots; ++slot) Next(slot);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Stream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->active_ == 0; }, this));
    return error_;
  }

 private:
  void Next(unsigned slot) {
    const std::uint64_t offset = next_.fetch_add(block_);
    if (offset >= size_ || failed_.load()) return;
    {
      absl::MutexLock lock(&mu_);
      ++active_;
    }
    const std::size_t length =
        static_cast<std::size_t>(std::min<std::uint64_t>(block_, size_ - offset));
    engine_
        ->Submit({op_, file_, offset, buffers_ + slot * block_, length},
                 [this, slot](const absl::Status& s, std::size_t) {
                   if (!s.ok()) {
                     failed_.store(true);
                     absl::MutexLock lock(&mu_);
                     if (error_.ok()) error_ = s;
                   } else {
                     Next(slot);
                   }
                   absl::MutexLock lock(&mu_);
                   --active_;
                 })
        .Detach();
  }

  IoEngine* engine_;
  FileId file_;
  IoOp op_;
  std::byte* buffers_;
  std::size_t block_;
  unsigned depth_;
  std::uint64_t size_;
  std::atomic<std::uint64_t> next_{0};
  std::atomic<bool> failed_{false};
  absl::Mutex mu_;
  unsigned active_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// What the benchmark writes: a target holding it (sampled at its head, middle and last
// block) is a benchmark's own scratch file, written over again without asking.
constexpr std::byte kPattern{0x5a};

bool HoldsOnlyThePattern(int fd, std::uint64_t size, std::size_t block) {
  if (size < block) return false;
  std::unique_ptr<std::byte, decltype(&std::free)> buf(
      static_cast<std::byte*>(std::aligned_alloc(block, block)), &std::free);
  if (buf == nullptr) return false;
  for (const std::uint64_t at :
       {std::uint64_t{0}, size / 2 / block * block, (size - 1) / block * block}) {
    if (prim::PreadOnce(fd, buf.get(), block, at) != static_cast<std::int64_t>(block)) return false;
    if (!std::all_of(buf.get(), buf.get() + block, [](std::byte b) { return b == kPattern; }))
      return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<IoBenchResult> RunIoBench(const IoBenchConfig& c) {
  if (c.block == 0 || c.block % 4096 != 0) {
    return absl::InvalidArgumentError(
        fmt::format("--block {} is not a positive multiple of 4096", c.block));
  }
  if (c.queue_depth == 0 || c.queue_depth > 1024) {
    return absl::InvalidArgumentError("--qd must be in 1..1024");
  }
  struct stat st {};
  const bool exists = ::stat(c.target.c_str(), &st) == 0;
  const bool device = exists && S_ISBLK(st.st_mode);
  // What can be told from the arguments is refused before the target is created: a usage
  // error leaves no empty file behind.
  if (!exists && c.size == 0)
    return absl::InvalidArgumentError(
        fmt::format("--size is needed for a new file ({} does not exist)", c.target));
  if (c.size != 0 && c.size < c.block) {
    return absl::InvalidArgumentError(
        fmt::format("--size {} is smaller than one block (--block {})", c.size, c.block));
  }
  MEMASCEND_ASSIGN_OR_RETURN(
      prim::UniqueFd fd, prim::Open(c.target, O_RDWR | O_DIRECT | (device ? 0 : O_CREAT), 0644));
  // A file this run created is removed again if the run fails: it held nothing of anyone's.
  struct RemoveIfFailed {
    const std::string* path;
    bool armed;
    ~RemoveIfFailed() {
      if (armed) ::unlink(path->c_str());
    }
  } created{&c.target, !exists};
  MEMASCEND_ASSIGN_OR_RETURN(prim::FileFacts facts, prim::StatFile(fd.get()));
  std::uint64_t size = c.size != 0 ? c.size : facts.size;
  if (size == 0) return absl::InvalidArgumentError("--size is needed for an empty or new file");
  size = size / c.block * c.block;
  if (size == 0) return absl::InvalidArgumentError("--size is smaller than one block");
  if (device && size > facts.size) {
    return absl::InvalidArgumentError(fmt::format("the device holds only {} bytes", facts.size));
  }
  if (c.block % facts.dio_align != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "--block {} is not a multiple of the target's alignment {}", c.block, facts.dio_align));
  }
  const bool grew = !device && facts.size < size;
  // Note [bench targets]: what a write would destroy is checked before anything is written.
  const bool writes = c.op == IoOp::kWrite || grew;
  struct Unlock {
    int fd = -1;
    ~Unlock() {
      if (fd >= 0) ::flock(fd, LOCK_UN);
    }
  } unlock;
  if (writes && (device || facts.size > 0)) {
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      return absl::UnavailableError(fmt::format(
          "{} is locked by another process (a MemAscend volume in use?): a benchmark never "
          "writes over it",
          c.target));
    }
    // Released explicitly on the way out: a ring that registered the file lets go of it
    // only when the kernel gets to it, and the lock with it.
    unlock.fd = fd.get();
    if (!c.destroy &&
        !HoldsOnlyThePattern(fd.get(), facts.size, std::max<std::size_t>(4096, facts.dio_align))) {
      BlockTargetOptions check;
      check.check_signatures = true;
      check.override_hint = "--destroy-data to let the benchmark write over it";
      MEMASCEND_RETURN_IF_ERROR(BlockTarget::Open(c.target, check).status());
    }
  }
  if (grew) MEMASCEND_RETURN_IF_ERROR(prim::Preallocate(fd.get(), size));

  IoEngineOptions eo;
  eo.backend = c.backend;
  eo.queue_depth = c.queue_depth;
  eo.threads = c.queue_depth;  // one outstanding pread/pwrite per worker, as QD intends
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, IoEngine::Create(eo));
  MEMASCEND_ASSIGN_OR_RETURN(FileId file, engine->RegisterFile(fd.get()));

  HostArenaOptions ao;
  ao.budget_bytes = c.block * c.queue_depth;
  ao.chunk_bytes = 0;
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena, HostArena::Create(ao));
  MEMASCEND_ASSIGN_OR_RETURN(ArenaAllocation buffers, arena->Allocate(ao.budget_bytes));
  std::memset(buffers.data, static_cast<int>(kPattern), buffers.size);
  const std::span<std::byte> ranges[] = {{buffers.data, buffers.size}};
  MEMASCEND_RETURN_IF_ERROR(engine->RegisterBuffers(ranges));

  IoBenchResult result;
  result.backend = engine->backend();
  if (c.op == IoOp::kRead && grew) {
    // Unwritten extents read back as zeros without touching the device: write first.
    Stream fill(engine.get(), file, IoOp::kWrite, buffers.data, c.block, c.queue_depth, size);
    MEMASCEND_RETURN_IF_ERROR(fill.Run());
    result.filled = true;
  }
  Stream stream(engine.get(), file, c.op, buffers.data, c.block, c.queue_depth, size);
  const auto start = std::chrono::steady_clock::now();
  MEMASCEND_RETURN_IF_ERROR(stream.Run());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.bytes = size;
  result.requests = size / c.block;
  MEMASCEND_RETURN_IF_ERROR(engine->RegisterBuffers({}));
  created.armed = false;
  return result;
}

}  // namespace memascend::cli
