// memascend/types.h: the vocabulary every layer of MemAscend speaks, and nothing else:
// element types, memory tiers and uses, durability, reuse fences and CUDA stream views.
// It includes no other MemAscend header, so any header may include it.
//
//   memascend::DType t = memascend::DType::kBF16;   // memascend::SizeOf(t) == 2
//   memascend::CudaStreamView view{stream};         // a cudaStream_t, non-owning
//
// Thread-safety: the functions are pure. A ReuseFence may be polled from any thread.
// Lifetime: a stream view does not own its stream, which must outlive the calls that
// take the view.
#ifndef MEMASCEND_TYPES_H_
#define MEMASCEND_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace memascend {

// Element types of tensors.
enum class DType : std::uint8_t { kF32, kF16, kBF16 };
std::size_t SizeOf(DType t) noexcept;
std::string_view ToString(DType t) noexcept;  // "f32", "f16", "bf16"

// Where bytes live.
enum class Tier : int { kPinnedHost, kPageableHost, kGpu, kNvme };
inline constexpr int kTierCount = 4;

// What bytes are for. kCached and kFree describe reserved bytes that serve no caller
// right now: blocks idle in a pool, and arena space mapped but not carved into blocks.
enum class Use : int {
  kParameters,
  kGradients,
  kOptimizerState,
  kActivations,
  kStaging,
  kOther,
  kCached,
  kFree,
};
inline constexpr int kUseCount = 8;

std::string_view ToString(Tier tier) noexcept;
std::string_view ToString(Use use) noexcept;

// Whether an object outlives the process that wrote it (committed to a volume's journal)
// or lives only while its volume or store is open.
enum class Durability { kDurable, kScratch };
std::string_view ToString(Durability d) noexcept;

// Says when memory handed to asynchronous work may be touched again.
class ReuseFence {
 public:
  virtual ~ReuseFence() = default;
  // True once the work the fence guards has finished. Must be cheap and non-blocking.
  virtual bool Ready() = 0;
};

// A non-owning view of a cudaStream_t (nullptr: the legacy default stream), usable
// without the CUDA headers.
struct CudaStreamView {
  void* handle = nullptr;
  CudaStreamView() = default;
  template <typename Stream>
  explicit CudaStreamView(Stream* stream) : handle(static_cast<void*>(stream)) {}
};

}  // namespace memascend

#endif  // MEMASCEND_TYPES_H_
