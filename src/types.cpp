#include <memascend/types.h>

namespace memascend {

std::size_t SizeOf(DType t) noexcept { return t == DType::kF32 ? 4 : 2; }

std::string_view ToString(DType t) noexcept {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

std::string_view ToString(Tier tier) noexcept {
  switch (tier) {
    case Tier::kPinnedHost:
      return "pinned_host";
    case Tier::kPageableHost:
      return "pageable_host";
    case Tier::kGpu:
      return "gpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

std::string_view ToString(Use use) noexcept {
  switch (use) {
    case Use::kParameters:
      return "parameters";
    case Use::kGradients:
      return "gradients";
    case Use::kOptimizerState:
      return "optimizer_state";
    case Use::kActivations:
      return "activations";
    case Use::kStaging:
      return "staging";
    case Use::kOther:
      return "other";
    case Use::kCached:
      return "cached";
    case Use::kFree:
      return "free";
  }
  return "unknown";
}

std::string_view ToString(Durability d) noexcept {
  return d == Durability::kDurable ? "durable" : "scratch";
}

}  // namespace memascend
