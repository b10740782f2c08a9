#include "sim/zero_swap_buffers.h"

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include <memascend/status.h>

namespace memascend {

ZeroSwapSizes ZeroSwapBufferSizes(const ZeroSwapConfig& config, std::uint64_t largest_param_numel,
                                  std::uint64_t largest_sub_group) {
  ZeroSwapSizes s;
  const std::uint64_t elements = std::max(config.param_buffer_elements, largest_param_numel);
  s.param_buffer_bytes = elements * config.param_element_bytes;
  s.optimizer_buffer_bytes = largest_sub_group * config.optimizer_element_bytes;
  s.pinned_bytes =
      std::bit_ceil(std::uint64_t{s.param_buffer_bytes * config.param_buffer_count}) +
      config.optimizer_buffer_count * std::bit_ceil(std::uint64_t{s.optimizer_buffer_bytes});
  return s;
}

std::vector<std::uint64_t> ZeroSubGroups(const Workload& workload, std::uint64_t sub_group_size) {
  std::vector<std::uint64_t> groups;
  std::uint64_t current = 0;
  for (std::size_t i = 0; i < workload.tensors.size(); ++i) {
    current += workload.tensors[i].numel;
    if (current >= sub_group_size || i + 1 == workload.tensors.size()) {
      groups.push_back(current);
      current = 0;
    }
  }
  return groups;
}

absl::StatusOr<std::unique_ptr<ZeroSwapBuffers>> ZeroSwapBuffers::Create(
    PinnedPool* pow2_pool, const ZeroSwapConfig& config, std::uint64_t largest_param_numel,
    std::uint64_t largest_sub_group) {
  if (pow2_pool == nullptr || pow2_pool->policy() != PoolPolicy::kPow2) {
    return absl::InvalidArgumentError("ZeRO swap buffers are allocated through a pow2 pool");
  }
  if (config.param_buffer_count == 0 || config.optimizer_buffer_count == 0) {
    return absl::InvalidArgumentError("ZeRO swap buffers: buffer counts must be positive");
  }
  std::unique_ptr<ZeroSwapBuffers> z(new ZeroSwapBuffers());
  z->config_ = config;
  const ZeroSwapSizes sizes = ZeroSwapBufferSizes(config, largest_param_numel, largest_sub_group);
  z->param_buffer_bytes_ = sizes.param_buffer_bytes;
  z->optimizer_buffer_bytes_ = sizes.optimizer_buffer_bytes;
  MEMASCEND_ASSIGN_OR_RETURN(
      z->param_pool_,
      pow2_pool->Allocate(z->param_buffer_bytes_ * config.param_buffer_count, Use::kStaging));
  for (std::size_t i = 0; i < config.optimizer_buffer_count; ++i) {
    MEMASCEND_ASSIGN_OR_RETURN(PinnedBlock block,
                               pow2_pool->Allocate(z->optimizer_buffer_bytes_, Use::kStaging));
    z->optimizer_pool_.push_back(std::move(block));
  }
  z->param_busy_.assign(config.param_buffer_count, false);
  z->optimizer_busy_.assign(config.optimizer_buffer_count, false);
  return z;
}

absl::StatusOr<ZeroSwapBuffers::Buffer> ZeroSwapBuffers::Acquire(Kind kind, std::size_t bytes) {
  const bool param = kind == Kind::kParameter;
  const std::size_t capacity = param ? param_buffer_bytes_ : optimizer_buffer_bytes_;
  if (bytes > capacity) {
    return absl::InvalidArgumentError(
        fmt::format("More elements ({} bytes) than {} swap buffer size ({} bytes)", bytes,
                    param ? "parameter" : "optimizer", capacity));
  }
  std::vector<bool>& busy = param ? param_busy_ : optimizer_busy_;
  const auto it = std::find(busy.begin(), busy.end(), false);
  if (it == busy.end()) {
    return absl::ResourceExhaustedError(
        fmt::format("all {} {} swap buffers are in use (raise buffer_count)", busy.size(),
                    param ? "parameter" : "optimizer"));
  }
  *it = true;
  const int index = static_cast<int>(it - busy.begin());
  std::byte* data = param ? param_pool_.data() + static_cast<std::size_t>(index) * capacity
                          : optimizer_pool_[static_cast<std::size_t>(index)].data();
  return Buffer{data, capacity, kind, index};
}

absl::Status ZeroSwapBuffers::Release(const Buffer& buffer) {
  std::vector<bool>& busy = buffer.kind == Kind::kParameter ? param_busy_ : optimizer_busy_;
  if (buffer.index < 0 || static_cast<std::size_t>(buffer.index) >= busy.size() ||
      !busy[static_cast<std::size_t>(buffer.index)]) {
    return absl::InvalidArgumentError("ZeRO swap buffer released twice or never acquired");
  }
  busy[static_cast<std::size_t>(buffer.index)] = false;
  return absl::OkStatus();
}

}  // namespace memascend
