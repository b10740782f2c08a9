#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include <memascend/workload.h>

#include "util/strings.h"

namespace memascend {
namespace {

int LayerOf(std::string_view name) {
  std::size_t start = 0;
  while (start <= name.size()) {
    const std::size_t dot = name.find('.', start);
    const std::string_view part =
        name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (const auto n = util::ParseInt<int>(part); n.has_value() && *n >= 0) return *n;
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return -1;
}

std::string StemOf(std::string_view path) {
  const auto slash = path.find_last_of('/');
  std::string_view base = slash == std::string_view::npos ? path : path.substr(slash + 1);
  const auto dot = base.find_last_of('.');
  if (dot != std::string_view::npos && dot > 0) base = base.substr(0, dot);
  return std::string(base);
}

}  // namespace

absl::StatusOr<Workload> ParseWorkload(std::string_view text, std::string_view fallback_name) {
  Workload w;
  std::size_t line_no = 0;
  bool first_comment = true;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (util::Trim(line).empty()) continue;
    if (line.front() == '#') {
      if (first_comment) {
        std::string_view header = util::Trim(line.substr(1));
        if (const auto colon = header.find(':'); colon != std::string_view::npos && colon > 0) {
          w.name = std::string(util::Trim(header.substr(0, colon)));
        }
        first_comment = false;
      }
      continue;
    }
    const std::size_t tab = line.find('\t');
    if (tab == std::string_view::npos) {
      return absl::InvalidArgumentError(
          fmt::format("workload line {}: expected 'name<TAB>shape', got '{}'", line_no, line));
    }
    WorkloadTensor t;
    t.name = std::string(util::Trim(line.substr(0, tab)));
    if (t.name.empty()) {
      return absl::InvalidArgumentError(
          fmt::format("workload line {}: empty tensor name", line_no));
    }
    std::string_view shape = util::Trim(line.substr(tab + 1));
    t.numel = 1;
    while (true) {
      const std::size_t comma = shape.find(',');
      const std::string_view dim_text = util::Trim(shape.substr(0, comma));
      const auto dim = util::ParseInt<std::uint64_t>(dim_text);
      if (!dim || *dim == 0) {
        return absl::InvalidArgumentError(fmt::format(
            "workload line {}: bad dimension '{}' in shape of {}", line_no, dim_text, t.name));
      }
      if (t.numel > UINT64_MAX / *dim) {
        return absl::InvalidArgumentError(
            fmt::format("workload line {}: element count of {} overflows", line_no, t.name));
      }
      t.numel *= *dim;
      t.shape.push_back(*dim);
      if (comma == std::string_view::npos) break;
      shape = shape.substr(comma + 1);
    }
    t.layer = LayerOf(t.name);
    w.total_parameters += t.numel;
    w.largest_numel = std::max(w.largest_numel, t.numel);
    w.tensors.push_back(std::move(t));
  }
  if (w.tensors.empty()) {
    return absl::InvalidArgumentError(fmt::format("workload '{}' lists no tensors", fallback_name));
  }
  if (w.name.empty()) w.name = std::string(fallback_name);
  return w;
}

absl::StatusOr<Workload> LoadWorkload(const std::string& path) {
  // Only a regular file, and at most kMaxWorkloadBytes of it: /dev/zero or a FIFO would
  // otherwise be read without end (a workload of a trillion-parameter model is a few MB).
  constexpr std::size_t kMaxWorkloadBytes = std::size_t{64} << 20;
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
    return absl::InvalidArgumentError(fmt::format(
        "workload {} is not a regular file (a device, FIFO or folder): give a workload file",
        path));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::ErrnoToStatus(errno, fmt::format("open workload {}", path));
  std::string text;
  char chunk[65536];
  while (file.read(chunk, sizeof(chunk)) || file.gcount() > 0) {
    text.append(chunk, static_cast<std::size_t>(file.gcount()));
    if (text.size() > kMaxWorkloadBytes) {
      return absl::InvalidArgumentError(fmt::format(
          "workload {} is larger than {} MiB: not a workload file", path, kMaxWorkloadBytes >> 20));
    }
  }
  if (file.bad()) return absl::ErrnoToStatus(errno, fmt::format("read workload {}", path));
  auto w = ParseWorkload(text, StemOf(path));
  if (!w.ok()) {
    return absl::Status(w.status().code(),
                        fmt::format("{}: {}", path, std::string(w.status().message())));
  }
  return w;
}

std::vector<TensorGroup> GroupByLayer(const Workload& workload) {
  std::vector<TensorGroup> groups;
  for (std::size_t i = 0; i < workload.tensors.size(); ++i) {
    const WorkloadTensor& t = workload.tensors[i];
    if (groups.empty() || groups.back().layer != t.layer) groups.push_back({t.layer, {}, 0});
    groups.back().tensors.push_back(i);
    groups.back().numel += t.numel;
  }
  return groups;
}

}  // namespace memascend
