// Volume::Format and Volume::OpenOrCreate: writing an empty volume (volume.cpp opens it).
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <memascend/block_target.h>
#include <memascend/status.h>
#include <memascend/volume.h>

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
using storage::kMetaBlock;
using storage::kWindowBytes;
using storage::Superblock;

std::uint64_t Random64() {
  std::uint64_t v = 0;
  while (::getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
  }
  return v;
}

}  // namespace

namespace {

// An empty volume's superblocks and cleared journal, written on `target`.
absl::Status WriteEmptyVolume(BlockTarget& target, const std::string& path,
                              const VolumeFormatOptions& options) {
  const std::uint64_t capacity = target.size();
  std::uint64_t journal = options.journal_bytes;
  if (journal == 0) journal = std::clamp<std::uint64_t>(capacity / 512, 2u << 20, 256u << 20);
  // A journal beyond the target is refused before anything is computed from it: 2 * half
  // and the data offset would wrap for a journal near 2^64, pass the size check and clear
  // far past the target. Within the capacity (an off_t, below 2^63) every sum below fits.
  // (The default journal, at least 2 MiB, is not refused here: a target under it is
  // "too small" below.)
  if (options.journal_bytes > capacity) {
    return absl::InvalidArgumentError(fmt::format(
        "journal_bytes (--journal) {} is more than {} holds ({}): give a smaller journal, or 0 "
        "for the default (capacity/512 in 2M..256M)",
        journal, path, capacity));
  }
  const std::uint64_t half = util::RoundDown(journal / 2, kMetaBlock);
  if (half < 4 * kMetaBlock)
    return absl::InvalidArgumentError(fmt::format(
        "journal_bytes (--journal) {} is below the least journal, 32 KiB (two halves of 16 KiB)",
        journal));
  Superblock sb;
  sb.block_size = target.io_block();
  sb.unit_bytes = options.unit_bytes;
  sb.capacity = capacity;
  sb.journal_offset = 2 * kMetaBlock;
  sb.journal_half_bytes = half;
  sb.data_offset =
      util::RoundUp(sb.journal_offset + 2 * half, std::max<std::uint64_t>(sb.unit_bytes, 1u << 20));
  if (capacity <= sb.data_offset || (capacity - sb.data_offset) / sb.unit_bytes == 0) {
    return absl::InvalidArgumentError(
        fmt::format("{} holds {}: too small for a {} journal and one {} unit", path,
                    util::FormatBytes(capacity), util::FormatBytes(2 * half),
                    util::FormatBytes(sb.unit_bytes)));
  }
  sb.data_units = (capacity - sb.data_offset) / sb.unit_bytes;
  for (std::uint64_t i = 0; i < 2; ++i) {
    const std::uint64_t a = Random64();
    std::memcpy(sb.uuid.data() + 8 * i, &a, 8);
  }
  sb.epoch = Random64() >> 1;
  sb.active_half = 0;

  IoEngineOptions eo;
  eo.backend = IoBackendChoice::kSync;
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, IoEngine::Create(eo));
  MEMASCEND_ASSIGN_OR_RETURN(FileId file, engine->RegisterFile(target.fd()));
  // Clear the journal region, so nothing of an earlier life of the target remains there.
  const std::uint64_t total = 2 * half;
  Aligned zeros = AllocAligned(kWindowBytes, target.io_block());
  std::memset(zeros.get(), 0, kWindowBytes);
  for (std::uint64_t done = 0; done < total;) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(kWindowBytes, total - done));
    MEMASCEND_RETURN_IF_ERROR(
        engine->Submit({IoOp::kWrite, file, sb.journal_offset + done, zeros.get(), n})
            .Wait()
            .status());
    done += n;
    if (options.progress) options.progress(done, total);
  }
  for (std::uint64_t generation : {0, 1}) {
    sb.generation = generation;
    const auto block = storage::EncodeSuperblock(sb);
    std::memcpy(zeros.get(), block.data(), kMetaBlock);
    MEMASCEND_RETURN_IF_ERROR(
        engine->Submit({IoOp::kWrite, file, generation * kMetaBlock, zeros.get(), kMetaBlock})
            .Wait()
            .status());
  }
  MEMASCEND_RETURN_IF_ERROR(engine->UnregisterFile(file));
  return target.Sync();
}

}  // namespace

absl::Status Volume::Format(const std::string& path, const VolumeFormatOptions& options) {
  if (options.unit_bytes < kMetaBlock || options.unit_bytes % kMetaBlock != 0) {
    return absl::InvalidArgumentError(
        fmt::format("unit_bytes {} is not a positive multiple of 4096", options.unit_bytes));
  }
  // A journal larger than the size asked for is refused before the file is created or
  // grown (WriteEmptyVolume checks it against a device's or an existing file's capacity).
  if (options.size > 0 && options.journal_bytes > options.size) {
    return absl::InvalidArgumentError(fmt::format(
        "journal_bytes (--journal) {} is more than the volume's size (--size) {}: give a "
        "smaller journal, or 0 for the default (capacity/512 in 2M..256M)",
        options.journal_bytes, options.size));
  }
  struct stat before {};
  const bool existed = ::stat(path.c_str(), &before) == 0;
  if (!existed && errno == ENOENT && options.size == 0) {
    return absl::InvalidArgumentError(
        fmt::format("{} does not exist: a size is needed to create it (--size, "
                    "VolumeFormatOptions::size)",
                    path));
  }
  BlockTargetOptions to;
  to.create_size = options.size;
  to.check_signatures = true;
  to.force = options.force;
  MEMASCEND_ASSIGN_OR_RETURN(BlockTarget target, BlockTarget::Open(path, to));
  absl::Status written = WriteEmptyVolume(target, path, options);
  if (!written.ok() && !existed) {
    // A file this call created goes again: a refused format leaves nothing behind.
    (void)target.Close();
    ::unlink(path.c_str());
  }
  return written;
}

absl::StatusOr<std::unique_ptr<Volume>> Volume::OpenOrCreate(const std::string& path,
                                                             const VolumeFormatOptions& format,
                                                             const VolumeOpenOptions& open) {
  struct stat st {};
  bool fresh = false;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) return absl::ErrnoToStatus(errno, fmt::format("stat({})", path));
    fresh = true;
  } else {
    fresh = S_ISREG(st.st_mode) && st.st_size == 0;
  }
  if (fresh) {
    if (format.size == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{} does not exist: give VolumeFormatOptions::size to create a volume there", path));
    }
    VolumeFormatOptions f = format;
    f.force = false;  // only a new or empty file is formatted here
    MEMASCEND_RETURN_IF_ERROR(Format(path, f));
  }
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<Volume> volume, Open(path, open));
  // A volume in a regular file smaller than asked for grows (Note [volume growth]).
  if (!fresh && S_ISREG(st.st_mode) && format.size > volume->stats().capacity_bytes)
    MEMASCEND_RETURN_IF_ERROR(volume->Grow(format.size));
  return volume;
}

}  // namespace memascend
