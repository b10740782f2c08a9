// memascend-train: trains a GPT (the demo's, or a Hugging Face Llama: --config,
// --init-from) with its parameters, gradients and optimizer states offloaded to a
// MemAscend volume (or, --mode reference, in ordinary memory).
//
// Read top to bottom: the command line (options.h: the table of every option; `--help`
// lists them), the model, the data, the host budget, the training (trainer.h), the
// report (report.h).
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <memascend/memory_ledger.h>

#include "comm.h"
#include "data.h"
#include "options.h"
#include "report.h"
#include "trainer.h"

namespace {

using offload_train::CommandLine;

// Under mpirun (Note [data parallel] in data_parallel.cpp): MPI_COMM_WORLD; null for one
// process.
std::unique_ptr<offload_train::Communicator> g_comm;

bool Root() { return g_comm == nullptr || g_comm->rank() == 0; }

// The error, named by rank under mpirun; there, every rank then stops (no rank waits in a
// collective for this one).
int Fail(const std::string& message) {
  if (g_comm != nullptr) {
    std::fprintf(stderr, "memascend-train: rank %d of %d: %s\n", g_comm->rank(), g_comm->size(),
                 message.c_str());
    std::fflush(stderr);
    g_comm->Abort(1);
  }
  std::fprintf(stderr, "memascend-train: %s\n", message.c_str());
  return 1;
}

int Fail(const absl::Status& status) { return Fail(std::string(status.message())); }

int Main(int argc, char** argv);

}  // namespace

// No input ends in an uncaught exception: an allocation the machine cannot satisfy (a
// model or batch too large) is reported like any other error.
int main(int argc, char** argv) {
  if (offload_train::LaunchedAsMpiRanks()) {
    auto comm = offload_train::MakeMpiCommunicator(&argc, &argv);
    if (!comm.ok()) return Fail(comm.status());
    g_comm = std::move(*comm);
  }
  try {
    const int rc = Main(argc, argv);
    g_comm.reset();  // MPI_Finalize
    return rc;
  } catch (const std::bad_alloc&) {
    return Fail("out of memory: the model, batch or budget is too large for this machine");
  } catch (const std::exception& e) {
    return Fail(fmt::format("internal error: {}", e.what()));
  }
}

namespace {

int Main(int argc, char** argv) {
  // The command line, then the model it names (a Hugging Face config gives the sizes),
  // then the places of the outputs, all checked before anything is read or built.
  CommandLine cl;
  bool help = false;
  if (absl::Status s = offload_train::ParseCommandLine(argc, argv, &cl, &help); !s.ok())
    return Fail(s);
  if (help) {
    std::fputs(offload_train::Usage().c_str(), stdout);
    return 0;
  }
  if (absl::Status s = offload_train::ResolveModel(&cl); !s.ok()) return Fail(s);
  if (absl::Status s = offload_train::CheckOutputs(cl); !s.ok()) return Fail(s);
  offload_train::TrainOptions& o = cl.train;

  // The data: token ids (--tokens), or a text and the tokenizer built from it. A run of
  // no steps (--steps 0: --eval or --export of a checkpoint) needs no training data.
  std::optional<offload_train::Tokenizer> tokenizer;
  std::vector<std::int32_t> tokens;
  if (!cl.tokens_path.empty()) {
    if (!cl.data_path.empty()) return Fail("--tokens and --data: give one");
    auto ids = offload_train::ReadTokenFile(cl.tokens_path, o.model.vocab);
    if (!ids.ok()) return Fail(ids.status());
    tokens = std::move(*ids);
  } else if (o.model.hf.has_value() && o.steps > 0) {
    return Fail(
        "a Hugging Face model trains on token ids from its own tokenizer: give --tokens FILE");
  } else if (!o.model.hf.has_value()) {
    auto corpus = cl.data_path.empty() ? offload_train::ReadLicenceCorpus()
                                       : offload_train::ReadTextFile(cl.data_path);
    if (!corpus.ok()) return Fail(corpus.status());
    auto built = offload_train::Tokenizer::Build(*corpus, o.model.vocab);
    if (!built.ok()) return Fail(built.status());
    tokenizer = std::move(*built);
    tokens = tokenizer->Encode(*corpus);
  }
  if (!cl.eval_path.empty()) {
    auto ids = offload_train::ReadTokenFile(cl.eval_path, o.model.vocab);
    if (!ids.ok()) return Fail(ids.status());
    o.eval_tokens = std::make_shared<const std::vector<std::int32_t>>(std::move(*ids));
  }

  // The pinned host budget: given, or chosen from what the machine leaves (memascend
  // Note [default host budget]); chosen here to be printed, and used by Train() as is.
  memascend::MemoryLedger ledger;
  o.ledger = &ledger;
  o.comm = g_comm.get();
  const int world = g_comm != nullptr ? g_comm->size() : 1;
  if (o.mode == offload_train::Mode::kOffload && o.policy == offload_train::Policy::kMemAscend &&
      o.optimizer_chunk != 0 && o.optimizer_chunk % offload_train::kOptimizerChunkQuantum == 0) {
    auto chosen =
        offload_train::ChooseTrainHostBudget(o, world, g_comm != nullptr ? g_comm->rank() : 0);
    if (!chosen.ok()) return Fail(chosen.status());
    o.host_budget_choice = *chosen;
    // One warning per run (rank 0's): the memlock limit and what to raise.
    if (!chosen->warning.empty() && Root()) std::fprintf(stderr, "%s\n", chosen->warning.c_str());
  }

  // Training: rank 0 reports, a line per step (to stderr under --json, for a watching
  // test); the other ranks print only their errors.
  if (!cl.json && Root()) offload_train::PrintPlan(cl, tokens.size(), tokenizer.has_value(), world);
  if (Root() && !cl.quiet && !cl.json) {
    o.on_step = offload_train::PrintStep;
  } else if (Root() && cl.json) {
    o.on_step = [](const offload_train::StepReport& r) {
      std::fprintf(stderr, "step %zu loss %.6f\n", r.step, r.loss);
    };
  }
  auto summary =
      tokenizer ? offload_train::Train(o, tokens, *tokenizer) : offload_train::Train(o, tokens);
  if (!summary.ok()) return Fail(summary.status());
  if (!Root()) return 0;

  // The report.
  if (!cl.timeline_path.empty()) {
    if (absl::Status s = ledger.WriteCsv(cl.timeline_path); !s.ok()) return Fail(s);
  }
  if (o.mode == offload_train::Mode::kOffload && o.policy == offload_train::Policy::kMemAscend &&
      o.host_budget != 0 && summary->host_budget < o.host_budget) {
    std::fprintf(stderr,
                 "memascend-train: --host-budget %s is more than the %s the training state can "
                 "ever hold in memory: capped to it\n",
                 offload_train::Gib(static_cast<double>(o.host_budget)).c_str(),
                 offload_train::Gib(static_cast<double>(summary->host_budget)).c_str());
  }
  if (cl.json) {
    offload_train::PrintJson(cl, *summary);
  } else {
    offload_train::PrintReport(cl, *summary);
  }
  return 0;
}

}  // namespace
