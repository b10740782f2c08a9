// store/eviction.h: the tensor store's eviction policy (Note [residency] and Note
// [retention] in memascend/tensor_store.h), apart from residency and I/O so that it can be
// tested on its own.
//
// Thread-safety: pure functions. Lifetime: nothing is kept.
#ifndef MEMASCEND_SRC_STORE_EVICTION_H_
#define MEMASCEND_SRC_STORE_EVICTION_H_

#include <cstddef>
#include <cstdint>
#include <span>

namespace memascend::store {

// Eviction order: tensors neither wanted nor kept first (rank 0), then kept ones (1),
// then wanted ones (2); least recently used first within a rank.
int EvictionRank(bool wanted, bool kept) noexcept;

// A tensor as eviction sees it when another one needs room.
struct EvictionCandidate {
  bool eligible = false;  // unleased and not the tensor that needs room
  bool resident = false;  // in memory and idle: can be evicted now
  bool writing = false;   // being written back: evictable once the write ends
  int rank = 0;           // EvictionRank
  std::uint64_t last_use = 0;
};

enum class EvictionAction {
  kEvict,             // evict `victim`
  kWaitForWriteBack,  // a tensor of a lower rank is being written back: wait for it
  kRefusePrefetch,    // a prefetch would evict something wanted or kept: drop or defer it
  kNothing,           // nothing is evictable
};
struct EvictionChoice {
  EvictionAction action = EvictionAction::kNothing;
  std::size_t victim = 0;  // index into the candidates, for kEvict
};

// Chooses what to evict among `candidates` for a demand (prefetch false) or a prefetch.
EvictionChoice ChooseVictim(std::span<const EvictionCandidate> candidates, bool prefetch) noexcept;

}  // namespace memascend::store

#endif  // MEMASCEND_SRC_STORE_EVICTION_H_
