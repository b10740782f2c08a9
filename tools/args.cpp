#include "args.h"

#include <optional>

#include <fmt/format.h>

#include "util/strings.h"
#include "util/units.h"

namespace memascend::cli {

absl::StatusOr<Args> Args::Parse(std::span<char* const> argv, std::span<const OptionSpec> specs,
                                 std::size_t max_positional) {
  Args args;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    std::string_view arg(argv[i]);
    if (!arg.starts_with("--") && args.positional_.size() < max_positional) {
      args.positional_.emplace_back(arg);
      continue;
    }
    if (!arg.starts_with("--")) {
      return absl::InvalidArgumentError(fmt::format("unexpected argument \'{}\'", arg));
    }
    arg.remove_prefix(2);
    std::string_view name = arg;
    std::optional<std::string_view> inline_value;
    if (const auto eq = arg.find('='); eq != std::string_view::npos) {
      name = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) {
      return absl::InvalidArgumentError(fmt::format("unknown option --{}", name));
    }
    std::string value;
    if (spec->takes_value) {
      if (inline_value) {
        value = std::string(*inline_value);
      } else if (i + 1 < argv.size()) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(fmt::format("option --{} needs a value", name));
      }
    } else if (inline_value) {
      return absl::InvalidArgumentError(fmt::format("option --{} takes no value", name));
    }
    args.values_[std::string(name)] = std::move(value);
  }
  return args;
}

std::string Args::Get(std::string_view name, std::string_view fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? std::string(fallback) : it->second;
}

absl::StatusOr<std::uint64_t> Args::GetBytes(std::string_view name, std::uint64_t fallback) const {
  const auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  auto bytes = util::ParseByteSize(it->second);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(fmt::format("--{}: {}", name, Message(bytes.status())));
  }
  return *bytes;
}

absl::StatusOr<std::int64_t> Args::GetInt(std::string_view name, std::int64_t fallback) const {
  const auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const auto value = util::ParseInt<std::int64_t>(it->second);
  if (!value) {
    return absl::InvalidArgumentError(fmt::format("--{}: not an integer: '{}'", name, it->second));
  }
  return *value;
}

std::string Usage(std::string_view command, std::string_view summary,
                  std::span<const OptionSpec> specs) {
  std::string out = fmt::format("usage: memascend {} [options]\n  {}\n", command, summary);
  for (const OptionSpec& s : specs) {
    const std::string flag =
        s.takes_value ? fmt::format("--{} VALUE", s.name) : fmt::format("--{}", s.name);
    out += fmt::format("  {:<28} {}\n", flag, s.help);
  }
  return out;
}

}  // namespace memascend::cli
