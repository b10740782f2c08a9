// splitmix64: the initialisations' random stream, the same on every platform.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_SPLIT_MIX_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_SPLIT_MIX_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace offload_train {

struct SplitMix {
  std::uint64_t state;
  std::uint64_t Next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // As if Next() were called n times (its state is a counter).
  void Skip(std::uint64_t n) { state += n * 0x9e3779b97f4a7c15ull; }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Normal() {  // Box-Muller: two draws
    const double u1 = std::max(Uniform(), 1e-300), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_SPLIT_MIX_H_
