#include "report.h"

#include <cmath>
#include <cstdio>
#include <string_view>

#include <fmt/format.h>

#include <memascend/io_engine.h>
#include <memascend/memory_ledger.h>
#include <memascend/system.h>

#include "util/json_writer.h"
#include "zero_infinity.h"

namespace offload_train {
namespace {

// fn(tier, use, peak reserved bytes) for every tier and use the run touched.
template <typename F>
void ForEachLedgerPeak(const memascend::LedgerSnapshot& ledger, F&& fn) {
  for (int t = 0; t < memascend::kTierCount; ++t) {
    for (int u = 0; u < memascend::kUseCount; ++u) {
      const auto& c = ledger.uses[static_cast<std::size_t>(t)][static_cast<std::size_t>(u)];
      if (c.reserved_peak != 0) {
        fn(memascend::ToString(static_cast<memascend::Tier>(t)),
           memascend::ToString(static_cast<memascend::Use>(u)), c.reserved_peak);
      }
    }
  }
}

}  // namespace

std::string Gib(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", bytes / (1 << 30));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  return fmt::format("{:.1f} KiB", bytes / 1024);
}

void PrintPlan(const CommandLine& cl, std::size_t tokens, bool text, int world) {
  const TrainOptions& o = cl.train;
  const std::uint64_t state = ModelStateBytes(o.model, o.dtype);
  const std::size_t budget = o.host_budget_choice ? o.host_budget_choice->bytes : o.host_budget;
  fmt::print(
      "memascend-train: {} {} layers x {} channels, {} heads, vocab {}, {:.2f} M parameters{}; "
      "{} tokens of {}\n",
      ArchName(o.model), o.model.layers, o.model.channels, o.model.heads, o.model.vocab,
      static_cast<double>(TotalParams(o.model)) / 1e6,
      o.init_from.empty() ? "" : fmt::format(" from {}", o.init_from), tokens,
      text ? "text" : "token ids");
  if (o.mode == Mode::kOffload && o.policy == Policy::kZeroInfinity) {
    fmt::print(
        "  training state {} offloaded under ZeRO-Infinity's rules to {}/zero_stage_3 "
        "({} pinned for swap buffers and gradients)\n",
        Gib(static_cast<double>(state)),
        o.zero.nvme_path.empty() ? o.volume_path + ".zero" : o.zero.nvme_path,
        Gib(static_cast<double>(ZeroPinnedBytes(o))));
  } else if (o.mode == Mode::kOffload && world > 1) {
    fmt::print(
        "  data-parallel over {} ranks (MPI): {} sequences per rank of the global batch of {}; "
        "each rank offloads its shard of the {} training state to {} through a pinned host "
        "budget of {}\n",
        world, o.model.batch / static_cast<std::size_t>(world), o.model.batch,
        Gib(static_cast<double>(state)), o.volume_path, Gib(static_cast<double>(budget)));
  } else if (o.mode == Mode::kOffload) {
    fmt::print("  training state {} offloaded to {} through a pinned host budget of {} ({:.0f}%)\n",
               Gib(static_cast<double>(state)), o.volume_path, Gib(static_cast<double>(budget)),
               100.0 * static_cast<double>(budget) / static_cast<double>(state));
  } else {
    fmt::print("  reference mode: training state {} in ordinary memory\n",
               Gib(static_cast<double>(state)));
  }
  if (o.host_budget_choice.has_value()) {
    fmt::print("  host budget {}{}: {}\n", Gib(static_cast<double>(o.host_budget_choice->bytes)),
               o.host_budget_choice->locked ? "" : " (unlocked)", o.host_budget_choice->reason);
  }
  std::fflush(stdout);
}

void PrintStep(const StepReport& r) {
  fmt::print(
      "step {:4}/{} | loss {:.4f} | scale {:g}{} | {:7.0f} tok/s | io {:.3f} GiB/s | "
      "pinned {}\n",
      r.step, r.steps, r.loss, r.loss_scale, r.skipped ? " (skipped: overflow)" : "",
      r.tokens_per_second, r.io_gib_per_second, Gib(static_cast<double>(r.pinned_bytes)));
  std::fflush(stdout);
}

void PrintJson(const CommandLine& cl, const TrainSummary& s) {
  const TrainOptions& o = cl.train;
  memascend::util::JsonWriter w;
  w.BeginObject()
      .Field("policy", o.policy == Policy::kZeroInfinity ? "zero-infinity" : "memascend")
      .Field("mode", o.mode == Mode::kOffload ? "offload" : "reference")
      .Field("steps", s.last_step)
      .Field("first_step", s.first_step)
      .Key("final_loss");
  // No step ran (--steps 0, or a run already at --steps): no loss to claim.
  if (s.losses.empty()) {
    w.Null();
  } else {
    w.Double(s.final_loss);
  }
  {
    // The I/O engine's backend, as the volume's automatic choice made it, and why.
    memascend::ProbeOptions probe = memascend::ProbeOptions::FromEnvironment();
    probe.disable_cuda = true;
    const memascend::IoBackendDecision io = memascend::DecideIoBackend(
        memascend::IoBackendChoice::kAuto, memascend::ProbeSystem(probe));
    w.Field("io_backend", memascend::ToString(io.backend)).Field("io_backend_reason", io.reason);
  }
  w.Key("losses").BeginArray();
  for (double l : s.losses) w.Double(l);
  w.EndArray().Key("step_seconds").BeginArray();
  for (double t : s.step_seconds) w.Double(t);
  w.EndArray().Key("step_skipped").BeginArray();
  for (bool k : s.step_skipped) w.Bool(k);
  w.EndArray().Key("step_io_bytes").BeginArray();
  for (std::uint64_t b : s.step_io_bytes) w.Uint(b);
  w.EndArray().Field("world", s.world);
  if (s.world > 1) {
    w.Key("step_comm_bytes").BeginArray();
    for (std::uint64_t b : s.step_comm_bytes) w.Uint(b);
    w.EndArray().Key("ranks").BeginArray();
    for (const auto& r : s.ranks) {
      w.BeginObject()
          .Field("peak_rss_bytes", r.peak_rss_bytes)
          .Field("peak_pinned_bytes", r.peak_pinned_bytes)
          .Field("mean_step_seconds", r.mean_step_seconds)
          .Field("comm_bytes_per_step", r.comm_bytes_per_step)
          .Field("io_bytes_per_step", r.io_bytes_per_step)
          .Field("state_elements", r.state_elements)
          .EndObject();
    }
    w.EndArray();
  }
  w.Field("params", s.params)
      .Field("model_state_bytes", s.model_state_bytes)
      .Field("host_budget_bytes", s.host_budget)
      .Field("host_budget_default", o.host_budget_choice && !o.host_budget_choice->given)
      .Field("host_budget_locked", !o.host_budget_choice || o.host_budget_choice->locked)
      .Field("host_budget_reason", o.host_budget_choice ? o.host_budget_choice->reason : "")
      .Field("peak_pinned_bytes", s.peak_pinned_bytes)
      .Field("peak_rss_bytes", s.peak_rss_bytes)
      .Field("activation_bytes", s.activation_bytes)
      .Field("io_read_bytes", s.io_read_bytes)
      .Field("io_write_bytes", s.io_write_bytes)
      .Field("skipped_steps", s.skipped_steps)
      .Field("seconds", s.seconds);
  w.Key("phase_seconds")
      .BeginObject()
      .Field("forward", s.phases.forward)
      .Field("backward", s.phases.backward)
      .Field("optimizer", s.phases.optimizer)
      .Field("commit", s.phases.commit)
      .EndObject();
  w.Key("ledger").BeginArray();
  ForEachLedgerPeak(s.ledger, [&w](std::string_view tier, std::string_view use, std::int64_t peak) {
    w.BeginObject().Field("tier", tier).Field("use", use).Field("peak_bytes", peak).EndObject();
  });
  w.EndArray().Key("store");
  if (s.store.has_value()) {
    const memascend::TensorStoreStats& t = *s.store;
    w.BeginObject()
        .Field("prefetch_hits", t.prefetch_hits)
        .Field("prefetch_misses", t.prefetch_misses)
        .Field("prefetch_dropped", t.prefetch_dropped)
        .Field("prefetch_deferred", t.prefetch_deferred)
        .Field("stall_seconds", t.stall_seconds)
        .Field("read_seconds", t.read_seconds)
        .Field("write_seconds", t.write_seconds)
        .Field("evictions", t.evictions)
        .Field("write_backs", t.write_backs)
        .EndObject();
  } else {
    w.Null();
  }
  w.Field("model", ArchName(o.model)).Field("matmul", cl.matmul);
  w.Field("checkpoint_activations", o.checkpoint_activations);
  if (s.eval_loss.has_value()) {
    w.Field("eval_loss", *s.eval_loss).Field("eval_tokens", s.eval_tokens);
  }
  if (!o.export_dir.empty())
    w.Field("export_dir", o.export_dir).Field("export_bytes", s.export_bytes);
  w.Field("sample", s.sample).EndObject();
  fmt::print("{}\n", w.str());
}

void PrintReport(const CommandLine& cl, const TrainSummary& s) {
  const TrainOptions& o = cl.train;
  if (s.losses.empty()) {
    fmt::print("\ndone: no training steps\n");
  } else {
    fmt::print(
        "\ndone: steps {}..{} in {:.1f} s, final loss {:.4f} (ln vocab = {:.2f}), {} skipped\n",
        s.first_step, s.last_step, s.seconds, s.final_loss,
        std::log(static_cast<double>(o.model.vocab)), s.skipped_steps);
  }
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& f = s.ranks[r];
    fmt::print(
        "  rank {}: {:.2f} M elements of state, peak RSS {}, pinned peak {}, {:.2f} s/step, sent "
        "{}/step, volume I/O {}/step\n",
        r, static_cast<double>(f.state_elements) / 1e6, Gib(static_cast<double>(f.peak_rss_bytes)),
        Gib(static_cast<double>(f.peak_pinned_bytes)), f.mean_step_seconds,
        Gib(f.comm_bytes_per_step), Gib(f.io_bytes_per_step));
  }
  fmt::print("  training state {}, pinned host peak {} (budget {}), peak RSS {}\n",
             Gib(static_cast<double>(s.model_state_bytes)),
             Gib(static_cast<double>(s.peak_pinned_bytes)), Gib(static_cast<double>(s.host_budget)),
             Gib(static_cast<double>(s.peak_rss_bytes)));
  fmt::print("  volume I/O: {} read, {} written; activations {} (ordinary memory)\n",
             Gib(static_cast<double>(s.io_read_bytes)), Gib(static_cast<double>(s.io_write_bytes)),
             Gib(static_cast<double>(s.activation_bytes)));
  if (s.store.has_value()) {
    const memascend::TensorStoreStats& t = *s.store;
    const std::uint64_t uses = t.prefetch_hits + t.prefetch_misses;
    fmt::print(
        "  tensor store: {} of {} uses found their tensor read ahead ({} prefetches waited for "
        "room); waited {:.2f} s for tensors\n",
        t.prefetch_hits, uses, t.prefetch_deferred + t.prefetch_dropped, t.stall_seconds);
  }
  fmt::print("  ledger peaks by tier and use:\n");
  ForEachLedgerPeak(s.ledger, [](std::string_view tier, std::string_view use, std::int64_t peak) {
    fmt::print("    {:<12} {:<16} {}\n", tier, use, Gib(static_cast<double>(peak)));
  });
  if (s.eval_loss.has_value()) {
    fmt::print("  eval: mean next-token loss {:.4f} over {} positions\n", *s.eval_loss,
               s.eval_tokens);
  }
  if (!o.export_dir.empty()) {
    fmt::print("  exported to {} ({}, {})\n", o.export_dir,
               Gib(static_cast<double>(s.export_bytes)), o.export_options.dtype);
  }
  if (!s.sample.empty()) fmt::print("\nsample:\n{}\n", s.sample);
}

}  // namespace offload_train
