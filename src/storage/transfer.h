// storage/transfer.h: moving bytes between a caller's buffer and a volume's target
// through the io engine, direct where aligned and through a staging window elsewhere.
//
// Thread-safety: the functions may be called from any thread (the engine's rules).
#ifndef MEMASCEND_SRC_STORAGE_TRANSFER_H_
#define MEMASCEND_SRC_STORAGE_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <span>

#include <absl/status/status.h>

#include <memascend/io_engine.h>

namespace memascend::storage {

inline constexpr std::size_t kWindowBytes = 16u << 20;  // staging window of unaligned transfers
inline constexpr std::size_t kRequestBytes = 4u << 20;  // one engine request (several in flight)

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using Aligned = std::unique_ptr<std::byte, FreeDeleter>;

// At least `bytes` (rounded up to `align`), aligned to `align`.
Aligned AllocAligned(std::size_t bytes, std::size_t align);

// Moves bytes between a caller buffer and the target: zero-copy for the aligned part,
// through an aligned staging window for the rest. Requests of one window run together.
// `on_chunk(bytes)`, if given, sees the transferred bytes in order as they complete, so a
// reader can checksum one chunk while the next ones are still in flight.
absl::Status Transfer(IoEngine* engine, FileId file, std::size_t block, IoOp op,
                      std::uint64_t offset, std::byte* user, std::size_t length,
                      const std::function<void(std::span<const std::byte>)>& on_chunk = nullptr);

}  // namespace memascend::storage

#endif  // MEMASCEND_SRC_STORAGE_TRANSFER_H_
