// What memascend-train prints: the plan before the first step, a line per step, and the
// summary after the last, as a report for people or (--json) one JSON object.
//
// Thread-safety: the training thread only.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_REPORT_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_REPORT_H_

#include <cstddef>
#include <string>

#include "options.h"
#include "trainer.h"

namespace offload_train {

// "1.50 GiB", "3.2 MiB" or "12.0 KiB".
std::string Gib(double bytes);

// The model, the data and where the state goes, before the first step.
void PrintPlan(const CommandLine& cl, std::size_t tokens, bool text, int world);

// A line per committed step.
void PrintStep(const StepReport& r);

// The run's summary: one JSON object (--json), or the report.
void PrintJson(const CommandLine& cl, const TrainSummary& s);
void PrintReport(const CommandLine& cl, const TrainSummary& s);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_REPORT_H_
