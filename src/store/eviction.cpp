#include "store/eviction.h"

#include <algorithm>

namespace memascend::store {

int EvictionRank(bool wanted, bool kept) noexcept { return wanted ? 2 : kept ? 1 : 0; }

EvictionChoice ChooseVictim(std::span<const EvictionCandidate> candidates, bool prefetch) noexcept {
  const EvictionCandidate* victim = nullptr;
  std::size_t index = 0;
  int writing_rank = 3;  // the lowest rank of an eligible tensor being written back
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const EvictionCandidate& c = candidates[i];
    if (!c.eligible) continue;
    if (c.writing) writing_rank = std::min(writing_rank, c.rank);
    if (!c.resident) continue;
    if (victim == nullptr || c.rank < victim->rank ||
        (c.rank == victim->rank && c.last_use < victim->last_use)) {
      victim = &c;
      index = i;
    }
  }
  if (victim == nullptr) return {EvictionAction::kNothing, 0};
  // A tensor of a lower rank is being written back: it will be evictable as soon as its
  // write ends, and evicting it then costs nothing a later read must undo.
  if (victim->rank > writing_rank) return {EvictionAction::kWaitForWriteBack, 0};
  if (prefetch && victim->rank > 0) return {EvictionAction::kRefusePrefetch, 0};
  return {EvictionAction::kEvict, index};
}

}  // namespace memascend::store
