// tools/commands.h: the subcommands of the memascend CLI. Each takes the arguments
// after its name and returns the process exit code: 0 success, 1 failure, 2 usage.
#ifndef MEMASCEND_TOOLS_COMMANDS_H_
#define MEMASCEND_TOOLS_COMMANDS_H_

#include <span>
#include <string_view>

namespace memascend::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct Command {
  std::string_view name;
  std::string_view summary;
  int (*run)(std::span<char* const> args);
};

int RunInfo(std::span<char* const> args);
int RunPoolSim(std::span<char* const> args);
int RunBench(std::span<char* const> args);
int RunVolume(std::span<char* const> args);
int RunPlan(std::span<char* const> args);

}  // namespace memascend::cli

#endif  // MEMASCEND_TOOLS_COMMANDS_H_
