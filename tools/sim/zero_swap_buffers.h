// sim/zero_swap_buffers.h (tools/, not in libmemascend): ZeRO-Infinity's swap-buffer rules, as the
// baseline.
//
// DeepSpeed's NVMe offload stages every swapped tensor through fixed pinned buffers:
// - parameters: `buffer_count` buffers of `buffer_size` elements (defaults 5 x 1e8), one
//   pinned allocation of buffer_count x buffer_size, and buffer_size must be at least
//   the largest parameter ("More elements ... than buffer size");
// - optimizer: `buffer_count` (default 4) buffers, each the largest optimizer sub-group
//   in fp32 (sub-groups pack consecutive parameters up to `sub_group_size`, default 1e9);
// - tensors under 1 MiB are not swapped.
// Every buffer is allocated through the pow2 pool (PyTorch's pinned allocator), so its
// size is rounded up to a power of two. See ../shared/guide/ANCHORS.md.
#ifndef MEMASCEND_TOOLS_SIM_ZERO_SWAP_BUFFERS_H_
#define MEMASCEND_TOOLS_SIM_ZERO_SWAP_BUFFERS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <absl/status/statusor.h>

#include <memascend/pinned_pool.h>
#include <memascend/workload.h>

namespace memascend {

struct ZeroSwapConfig {
  std::size_t param_buffer_count = 5;
  std::uint64_t param_buffer_elements = 100'000'000;  // raised to the largest parameter
  std::size_t param_element_bytes = 2;                // fp16 / bf16
  std::size_t optimizer_buffer_count = 4;
  std::uint64_t sub_group_size = 1'000'000'000;  // elements
  std::size_t optimizer_element_bytes = 4;       // fp32
  std::size_t min_swap_bytes = 1u << 20;         // smaller tensors are not swapped
};

// The buffers' sizes as Create makes them: each parameter buffer holds
// max(param_buffer_elements, largest_param_numel) 16-bit elements, each optimizer buffer the
// largest sub-group in fp32; `pinned_bytes` is what the pow2 pool reserves for them all.
struct ZeroSwapSizes {
  std::size_t param_buffer_bytes = 0;
  std::size_t optimizer_buffer_bytes = 0;
  std::uint64_t pinned_bytes = 0;
};
ZeroSwapSizes ZeroSwapBufferSizes(const ZeroSwapConfig& config, std::uint64_t largest_param_numel,
                                  std::uint64_t largest_sub_group);

// Element counts of ZeRO's optimizer sub-groups: consecutive tensors packed until a
// group reaches sub_group_size (a group may pass it by its last tensor).
std::vector<std::uint64_t> ZeroSubGroups(const Workload& workload, std::uint64_t sub_group_size);

class ZeroSwapBuffers {
 public:
  enum class Kind { kParameter, kOptimizer };
  struct Buffer {
    std::byte* data = nullptr;
    std::size_t bytes = 0;  // capacity
    Kind kind = Kind::kParameter;
    int index = -1;
  };

  // Allocates every buffer up front from `pow2_pool` (PoolPolicy::kPow2).
  static absl::StatusOr<std::unique_ptr<ZeroSwapBuffers>> Create(PinnedPool* pow2_pool,
                                                                 const ZeroSwapConfig& config,
                                                                 std::uint64_t largest_param_numel,
                                                                 std::uint64_t largest_sub_group);

  // A free buffer of `kind` for a tensor of `bytes`. kInvalidArgument past the buffer
  // size; kResourceExhausted when all buffers of that kind are taken.
  absl::StatusOr<Buffer> Acquire(Kind kind, std::size_t bytes);
  absl::Status Release(const Buffer& buffer);

  std::size_t param_buffer_bytes() const noexcept { return param_buffer_bytes_; }
  std::size_t optimizer_buffer_bytes() const noexcept { return optimizer_buffer_bytes_; }
  const ZeroSwapConfig& config() const noexcept { return config_; }

 private:
  ZeroSwapBuffers() = default;

  ZeroSwapConfig config_;
  std::size_t param_buffer_bytes_ = 0;
  std::size_t optimizer_buffer_bytes_ = 0;
  PinnedBlock param_pool_;                   // one allocation, as DeepSpeed pins it
  std::vector<PinnedBlock> optimizer_pool_;  // one allocation per buffer
  std::vector<bool> param_busy_, optimizer_busy_;
};

}  // namespace memascend

#endif  // MEMASCEND_TOOLS_SIM_ZERO_SWAP_BUFFERS_H_
