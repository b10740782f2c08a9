// A program outside MemAscend's tree, linked against the installed package: it keeps an
// AdamW optimizer's state (fp32 master weights and both moments) on a volume on NVMe,
// under a pinned host budget far below that state, and trains with it.
//
//   downstream [VOLUME]      (default: ./downstream.vol; run it twice: the second run
//                             resumes from the first one's last committed step)
//
// The "model" is a least-squares fit (loss = mean (w - target)^2 over two parameter
// groups), so the example is about the SDK, not the model: one object, OffloadedTraining,
// owns the volume, the store, the state and the optimizer (memascend/offloaded_training.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <memascend/memascend.h>

namespace {

constexpr int kSteps = 30;  // per run

absl::Status Run(const std::string& path) {
  memascend::OffloadedTrainingOptions o;
  o.volume_path = path;  // created on the first run, sized for the state
  o.groups = {{"embed", 1'500'000}, {"block.0", 700'000}};
  o.dtype = memascend::DType::kBF16;
  o.part_elements = std::size_t{1} << 18;  // the optimizer holds one part at a time
  o.group_options = {{/*lr=*/0.05f, /*weight_decay=*/0.0f}, {0.02f, 0.01f}};
  o.max_grad_norm = 10.0f;
  o.run_id = 0x5eed;  // of this "run": another one's state is refused
  MEMASCEND_ASSIGN_OR_RETURN(const memascend::StateLayout layout,
                             memascend::OffloadedTraining::LayoutOf(o));
  // A pinned budget of twice what the update holds at once, far below the state (0, the
  // default, would take what the machine leaves).
  o.host_budget_bytes = memascend::OffloadedAdam::MinimumHostBudget(layout);
  o.resume = true;  // continue the volume's state; a new one starts from zeros
  o.initial_weights = [](std::size_t, std::span<float> w) {
    std::fill(w.begin(), w.end(), 0.0f);
    return absl::OkStatus();
  };
  MEMASCEND_ASSIGN_OR_RETURN(auto run, memascend::OffloadedTraining::Open(o));
  if (run->resumed().has_value()) {
    std::printf("downstream: resumed %s at step %llu (%s)\n", path.c_str(),
                static_cast<unsigned long long>(run->step()), run->resumed()->user.c_str());
  }

  const auto target = [](std::size_t g, std::size_t i) {
    return 0.5f * std::sin(static_cast<float>(i % 1000) * 0.01f + static_cast<float>(g));
  };
  std::vector<float> w, grad;
  double first_loss = -1, loss = 0;
  const std::uint64_t first = run->step() + 1;
  for (std::uint64_t step = first; step < first + kSteps; ++step) {
    // Forward and backward, group by group: the parameters from the state, the plain
    // gradient into it (converted to bf16 part by part, checked, added to the norm).
    run->BeginStep();
    double sum = 0, count = 0;
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      const std::size_t n = layout.groups[g].elements;
      w.resize(n);
      grad.resize(n);
      MEMASCEND_RETURN_IF_ERROR(run->LoadParameters(g, {w.data(), n, memascend::DType::kF32}));
      for (std::size_t k = 0; k < n; ++k) {
        const float d = w[k] - target(g, k);
        sum += static_cast<double>(d) * d;
        grad[k] = 2.0f * d;
      }
      count += static_cast<double>(n);
      MEMASCEND_RETURN_IF_ERROR(run->SetGradient(g, {grad.data(), n, memascend::DType::kF32}));
    }
    loss = sum / count;
    if (first_loss < 0) first_loss = loss;
    // The update, part by part under the budget, then a commit durable when it returns.
    MEMASCEND_RETURN_IF_ERROR(run->Step().status());
    MEMASCEND_RETURN_IF_ERROR(run->Commit(step, "step " + std::to_string(step)));
  }
  const memascend::TensorStoreStats stats = run->store()->stats();
  std::printf(
      "downstream: steps %llu..%llu, loss %.5f -> %.5f; optimizer state %.1f MiB on %s under a "
      "pinned budget of %.1f MiB (%.0f MiB read, %.0f MiB written)\n",
      static_cast<unsigned long long>(first), static_cast<unsigned long long>(run->step()),
      first_loss, loss, static_cast<double>(layout.TotalElements()) * 12 / (1 << 20), path.c_str(),
      static_cast<double>(run->host_budget().bytes) / (1 << 20),
      static_cast<double>(stats.bytes_read) / (1 << 20),
      static_cast<double>(stats.bytes_written) / (1 << 20));
  if (!(loss < first_loss)) return absl::InternalError("the loss did not fall");
  return run->Close();
}

}  // namespace

int main(int argc, char** argv) {
  const absl::Status status = Run(argc > 1 ? argv[1] : "downstream.vol");
  if (!status.ok()) {
    std::fprintf(stderr, "downstream: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
