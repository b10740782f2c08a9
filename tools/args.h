// tools/args.h: command-line options of the memascend subcommands.
#ifndef MEMASCEND_TOOLS_ARGS_H_
#define MEMASCEND_TOOLS_ARGS_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/status/statusor.h>

namespace memascend::cli {

struct OptionSpec {
  std::string_view name;  // without the leading "--"
  bool takes_value;
  std::string_view help;
};

// Parsed "--name value", "--name=value" and "--flag" options. Unknown options,
// missing values and stray positional arguments are kInvalidArgument.
class Args {
 public:
  // Up to `max_positional` arguments that are not options are kept, in order.
  static absl::StatusOr<Args> Parse(std::span<char* const> argv, std::span<const OptionSpec> specs,
                                    std::size_t max_positional = 0);
  const std::vector<std::string>& positional() const { return positional_; }

  bool Has(std::string_view name) const { return values_.contains(std::string(name)); }
  std::string Get(std::string_view name, std::string_view fallback = {}) const;
  absl::StatusOr<std::uint64_t> GetBytes(std::string_view name, std::uint64_t fallback) const;
  absl::StatusOr<std::int64_t> GetInt(std::string_view name, std::int64_t fallback) const;

 private:
  std::map<std::string, std::string, std::less<>> values_;
  std::vector<std::string> positional_;
};

// The message of a status as a std::string (Note [absl string_view] in util/strings.h).
inline std::string Message(const absl::Status& status) { return std::string(status.message()); }

// "usage: memascend CMD [options]" plus one line per option.
std::string Usage(std::string_view command, std::string_view summary,
                  std::span<const OptionSpec> specs);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_ARGS_H_
