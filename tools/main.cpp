// memascend: the command-line tool of the MemAscend SDK.
#include <cstdio>
#include <exception>
#include <new>
#include <span>
#include <string_view>

#include <fmt/format.h>

#include <memascend/version.h>

#include "commands.h"

namespace memascend::cli {
namespace {

constexpr Command kCommands[] = {
    {"plan", "what a run needs (host RSS, pinned, disk, I/O per step) beside ZeRO-Infinity",
     RunPlan},
    {"info", "print what this machine offers and which backends MemAscend picks", RunInfo},
    {"pool-sim", "replay a training step's pinned-buffer schedule under a memory policy",
     RunPoolSim},
    {"volume", "format, inspect and use a volume: format|info|put|get|ls|rm|fsck", RunVolume},
    {"bench", "measure: `bench io` (direct-I/O throughput), `bench tune`, `bench kernels`",
     RunBench},
};

void PrintHelp(std::FILE* out) {
  fmt::print(out,
             "memascend {}: memory and storage offload SDK for LLM training\n\n"
             "usage: memascend [--version] [--help] COMMAND [options]\n\ncommands:\n",
             VersionString());
  for (const Command& c : kCommands) fmt::print(out, "  {:<12} {}\n", c.name, c.summary);
  fmt::print(out, "\n'memascend COMMAND --help' describes each command's options.\n");
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    PrintHelp(stderr);
    return kExitUsage;
  }
  const std::string_view first(argv[1]);
  if (first == "--version" || first == "-V") {
    fmt::print("memascend {}{}\n", VersionString(), BuiltWithCuda() ? " (cuda)" : "");
    return kExitOk;
  }
  if (first == "--help" || first == "-h" || first == "help") {
    PrintHelp(stdout);
    return kExitOk;
  }
  for (const Command& c : kCommands) {
    if (c.name == first) {
      return c.run(std::span<char* const>(argv + 2, static_cast<std::size_t>(argc - 2)));
    }
  }
  fmt::print(stderr, "memascend: unknown command '{}'\n\n", first);
  PrintHelp(stderr);
  return kExitUsage;
}

}  // namespace
}  // namespace memascend::cli

// No input ends in an uncaught exception: whatever escapes a subcommand (an allocation the
// machine cannot satisfy) is reported with exit status 1.
int main(int argc, char** argv) {
  try {
    return memascend::cli::Main(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("memascend: out of memory (a size too large for this machine)\n", stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memascend: internal error: %s\n", e.what());
  }
  return 1;
}
