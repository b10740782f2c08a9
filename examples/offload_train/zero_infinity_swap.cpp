#include "zero_infinity_swap.h"

#include <fmt/format.h>

#include "zero_infinity.h"

namespace offload_train {
namespace zero_infinity {

std::string SwapPath(const std::string& root, Kind k, std::size_t g) {
  switch (k) {
    case Kind::kParameters:
      return fmt::format("{}/params/rank0/{}_param.tensor.swp", root, g);
    case Kind::kMaster:
      return fmt::format("{}/optimizer/rank0/{}_fp32_param.tensor.swp", root, g);
    case Kind::kExpAvg:
      return fmt::format("{}/optimizer/rank0/{}_exp_avg.tensor.swp", root, g);
    case Kind::kGradient:
      return fmt::format("{}/optimizer/rank0/{}_gradient.tensor.swp", root, g);
    default:
      return fmt::format("{}/optimizer/rank0/{}_exp_avg_sq.tensor.swp", root, g);
  }
}

Layout MakeLayout(const TrainOptions& o) {
  Layout l;
  l.groups = GroupCount(o.model);
  for (std::size_t g = 0; g < l.groups; ++g) {
    l.numel.push_back(GroupParams(o.model, g));
    l.offset.push_back(l.total);
    l.total += l.numel.back();
    l.largest = std::max(l.largest, l.numel.back());
  }
  std::vector<std::size_t> current;
  std::size_t elements = 0;
  for (std::size_t g = 0; g < l.groups; ++g) {
    current.push_back(g);
    elements += l.numel[g];
    if (elements >= o.zero.sub_group_size || g + 1 == l.groups) {
      l.largest_sub_group = std::max(l.largest_sub_group, elements);
      l.sub_groups.push_back(std::move(current));
      current.clear();
      elements = 0;
    }
  }
  // max_in_cpu: the sub-groups whose parameters fit, in order, in a flat buffer of at most
  // that many elements live there; the rest on NVMe.
  l.flat_param_elements =
      static_cast<std::size_t>(std::min<std::uint64_t>(l.total, o.zero.max_in_cpu));
  l.param_in_cpu.assign(l.groups, false);
  std::size_t flat_offset = 0;
  bool on_nvme = false;
  for (const std::vector<std::size_t>& sub : l.sub_groups) {
    std::size_t n = 0;
    for (std::size_t g : sub) n += l.numel[g];
    const bool fits = flat_offset + n <= l.flat_param_elements;
    for (std::size_t g : sub) l.param_in_cpu[g] = fits;
    on_nvme = on_nvme || !fits;
    flat_offset += n;
  }
  // Each tensor of a sub-group at a 4 KiB boundary (O_DIRECT).
  if (on_nvme)
    l.partitioned_swap_bytes =
        Round4k(l.largest_sub_group * memascend::SizeOf(o.dtype)) + 4096 * l.groups;
  // "More elements ... than buffer size": the rule raises buffer_size to the largest.
  l.param_buffer_elements = std::max<std::size_t>(o.zero.param_buffer_size, l.largest);
  l.param_buffer_bytes = Round4k(l.param_buffer_elements * memascend::SizeOf(o.dtype));
  l.optimizer_buffer_bytes = Round4k(l.largest_sub_group * 4);
  return l;
}

}  // namespace zero_infinity

using zero_infinity::Layout;
using zero_infinity::MakeLayout;
using zero_infinity::Pow2;

std::string_view ToString(ZeroRelease release) noexcept {
  return release == ZeroRelease::k0_19_5 ? "0.19.5" : "0.16.5";
}

ZeroOptions ZeroDefaults(ZeroRelease release) {
  ZeroOptions z;
  z.release = release;
  // 0.19.5's offload_config.py: pin_memory True for both offloads.
  z.optimizer_pin_memory = z.param_pin_memory = release >= ZeroRelease::k0_19_5;
  return z;
}

std::uint64_t ZeroPinnedBytes(const TrainOptions& o) {
  const Layout l = MakeLayout(o);
  const std::size_t half = memascend::SizeOf(o.dtype);
  // The swap buffers: pow2 blocks up to 0.16.5, page-locked at their size from 0.19.5
  // (multiples of 4096 already). The rest through torch's allocator either way.
  const bool exact = o.zero.release >= ZeroRelease::k0_19_5;
  const auto swap = [exact](std::size_t n) -> std::uint64_t { return exact ? n : Pow2(n); };
  std::uint64_t bytes =
      swap(l.param_buffer_bytes * o.zero.param_buffer_count) +
      o.zero.optimizer_buffer_count * swap(l.optimizer_buffer_bytes + 4096 * l.groups);
  if (l.partitioned_swap_bytes > 0) bytes += swap(l.partitioned_swap_bytes);
  if (o.zero.optimizer_pin_memory) bytes += Pow2(l.total * half);
  if (l.flat_param_elements > 0) bytes += Pow2(l.flat_param_elements * half);
  if (o.zero.param_pin_memory) {  // the parameters too small to swap, outside the flat buffer
    for (std::size_t g = 0; g < l.groups; ++g) {
      if (!l.param_in_cpu[g] && l.numel[g] * half < o.zero.SwapThresholdBytes())
        bytes += Pow2(std::max<std::size_t>(l.numel[g] * half, 4096));
    }
  }
  return bytes;
}

}  // namespace offload_train
