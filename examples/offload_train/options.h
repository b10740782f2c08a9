// memascend-train's command line, declared once: a table of options (options.cpp), each
// with its name, its value's form and range, its default and its help. The parser and
// `--help` are both made from that table.
//
//   CommandLine cl;
//   bool help = false;
//   if (absl::Status s = ParseCommandLine(argc, argv, &cl, &help); !s.ok()) ...
//   if (help) std::fputs(Usage().c_str(), stdout);
//
// Values are parsed strictly: a whole number is digits only (no sign, fraction, exponent
// or overflow of its type), a real a finite number >= 0, a flag 0 or 1, a byte size an
// integer with an optional K, M, G or T suffix (util/units.h). A refusal says what was
// expected: "--steps: '1.5' is not a whole number from 0 to ... (see --help)".
//
// Thread-safety: none needed (one call, at start-up).
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPTIONS_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPTIONS_H_

#include <string>

#include <absl/status/status.h>

#include "trainer.h"

namespace offload_train {

// What the command line asks for: the trainer's options, and the program's own.
struct CommandLine {
  TrainOptions train;
  std::string data_path;      // --data: training text (empty: the licence texts)
  std::string tokens_path;    // --tokens: training token ids
  std::string eval_path;      // --eval: token ids to evaluate on
  std::string config_path;    // --config: a Hugging Face config.json
  std::string timeline_path;  // --timeline: the ledger's CSV
  std::string export_dtype;   // --export-dtype; empty: the import's, else the config's
  std::string matmul;         // "blas" or "exact"
  bool json = false;
  bool quiet = false;
  bool loss_scale_given = false;  // --loss-scale given (bf16 defaults to 1 otherwise)
  // --zero-pin-optimizer / --zero-pin-param given (--zero-release's defaults otherwise)
  bool zero_pin_optimizer_given = false;
  bool zero_pin_param_given = false;
  // --host-budget Fx or P%: F times the minimum, or P/100 of the training state, applied
  // once the model is known (ApplyHostBudgetFactor); 0: bytes or the default.
  double budget_factor = 0;
  bool budget_of_state = false;
};

// Fills `*out` from argv, starting from the defaults of the table. `--help` (or `-h`)
// sets `*help` and stops. kInvalidArgument naming the option and what it expected.
absl::Status ParseCommandLine(int argc, char** argv, CommandLine* out, bool* help);

// The text of `--help`, made from the table.
std::string Usage();

// Once the model is known: the Hugging Face config (--config or --init-from's) read into
// the model, the export's dtype chosen, the sizes validated, --host-budget's factor made
// bytes, bf16's loss scale. kInvalidArgument (or the reader's error) otherwise.
absl::Status ResolveModel(CommandLine* cl);

// A command never writes its output over its own input, and every output's place is
// checked before the first step, not after the last.
absl::Status CheckOutputs(const CommandLine& cl);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_OPTIONS_H_
