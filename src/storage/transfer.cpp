#include "storage/transfer.h"

#include <algorithm>
#include <cstring>

#include <memascend/status.h>

#include "util/align.h"

namespace memascend::storage {
Aligned AllocAligned(std::size_t bytes, std::size_t align) {
  auto* p = static_cast<std::byte*>(
      std::aligned_alloc(align, util::RoundUp(std::max<std::size_t>(bytes, 1), align)));
  return Aligned(p);
}

absl::Status Transfer(IoEngine* engine, FileId file, std::size_t block, IoOp op,
                      std::uint64_t offset, std::byte* user, std::size_t length,
                      const std::function<void(std::span<const std::byte>)>& on_chunk) {
  std::size_t direct = 0;
  if (reinterpret_cast<std::uintptr_t>(user) % block == 0) direct = length / block * block;
  {
    IoBatch batch;
    for (std::size_t done = 0; done < direct; done += kRequestBytes) {
      batch.Add(engine->Submit(
          {op, file, offset + done, user + done, std::min(kRequestBytes, direct - done)}));
    }
    std::size_t done = 0;
    for (IoTicket& t : batch.tickets()) {
      auto n = t.Wait();
      if (!n.ok()) return n.status();  // the batch waits for the rest as it goes
      if (on_chunk) on_chunk({user + done, *n});
      done += *n;
    }
  }
  if (direct == length) return absl::OkStatus();
  const std::size_t rest = length - direct;
  Aligned window = AllocAligned(std::min(util::RoundUp(rest, block), kWindowBytes), block);
  for (std::size_t done = direct; done < length;) {
    const std::size_t n = std::min(kWindowBytes, length - done);
    const std::size_t padded = util::RoundUp(n, block);
    if (op == IoOp::kWrite) {
      std::memcpy(window.get(), user + done, n);
      std::memset(window.get() + n, 0, padded - n);
    }
    IoBatch batch;
    for (std::size_t at = 0; at < padded; at += kRequestBytes) {
      batch.Add(engine->Submit(
          {op, file, offset + done + at, window.get() + at, std::min(kRequestBytes, padded - at)}));
    }
    batch.WaitAll();
    MEMASCEND_RETURN_IF_ERROR(batch.FirstError());
    if (op == IoOp::kRead) std::memcpy(user + done, window.get(), n);
    if (on_chunk) on_chunk({user + done, n});
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace memascend::storage
