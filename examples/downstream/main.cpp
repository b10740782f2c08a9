// A program outside MemAscend's tree, linked against the installed package: it keeps an
// optimizer's state (fp32 master weights and both Adam moments) on a volume on NVMe,
// under a pinned host budget far below that state, and trains with it.
//
//   downstream [VOLUME]      (default: ./downstream.vol; run it twice: the second run
//                             resumes from the first one's last committed step)
//
// The "model" is a least-squares fit (loss = mean (w - target)^2 over two parameter
// groups), so the example is about the SDK, not the model: everything a trainer does to
// put its optimizer on NVMe is here.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <memascend/memascend.h>

namespace {

constexpr int kSteps = 30;  // per run

absl::Status Run(const std::string& path) {
  // The training state's layout: two groups of bf16 parameters, kept in parts of 2^18
  // elements so that the optimizer holds one part at a time.
  memascend::StateLayout layout;
  layout.groups = {{"embed", 1'500'000}, {"block.0", 700'000}};
  layout.param_dtype = layout.grad_dtype = memascend::DType::kBF16;
  layout.part_elements = std::size_t{1} << 18;

  // A volume: created on the first run (a new file), opened on the next ones.
  memascend::VolumeFormatOptions format;
  format.size = 2 * memascend::VersionedTrainingState::StoredBytes(layout) + (64u << 20);
  MEMASCEND_ASSIGN_OR_RETURN(auto volume, memascend::Volume::OpenOrCreate(path, format));

  // The pinned host budget: twice what the update holds at once, far below the state.
  memascend::TensorStoreOptions store_options;
  store_options.host_budget_bytes = 2 * memascend::OffloadedAdam::MinimumHostBudget(layout);
  MEMASCEND_ASSIGN_OR_RETURN(auto store, memascend::TensorStore::Open(volume.get(), store_options));
  MEMASCEND_ASSIGN_OR_RETURN(
      auto state, memascend::VersionedTrainingState::Open(store.get(), volume.get(), layout));

  memascend::KernelThreads threads(2);
  memascend::OffloadedAdamOptions adam_options;
  adam_options.groups = {{/*lr=*/0.05f, /*weight_decay=*/0.0f}, {0.02f, 0.01f}};
  adam_options.max_grad_norm = 10.0f;
  adam_options.scaler.initial_scale = 1.0f;  // bf16 gradients need no loss scaling
  adam_options.fingerprint = 0x5eed;         // of this "run": another one's state is refused
  MEMASCEND_ASSIGN_OR_RETURN(auto adam,
                             memascend::OffloadedAdam::Create(state.get(), adam_options, &threads));

  std::uint64_t step = 0;
  MEMASCEND_ASSIGN_OR_RETURN(auto last, adam->Resume());
  if (last.has_value()) {
    step = last->step;
    std::printf("downstream: resumed %s at step %llu (%s)\n", path.c_str(),
                static_cast<unsigned long long>(step), last->user.c_str());
  } else {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      std::vector<float> w(layout.groups[g].elements, 0.0f);
      MEMASCEND_RETURN_IF_ERROR(adam->Initialize(g, w));
    }
    MEMASCEND_RETURN_IF_ERROR(adam->Commit(0, "initial"));
  }

  const auto target = [](std::size_t g, std::size_t i) {
    return 0.5f * std::sin(static_cast<float>(i % 1000) * 0.01f + static_cast<float>(g));
  };
  std::vector<float> w, grad;
  double first_loss = -1, loss = 0;
  for (int i = 0; i < kSteps; ++i, ++step) {
    // Forward and backward, group by group: the parameters from the state, the gradient
    // into it part by part (converted to bf16, checked for overflow, added to the norm).
    adam->BeginBackward();
    double sum = 0, count = 0;
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      const std::size_t n = layout.groups[g].elements;
      w.resize(n);
      grad.resize(n);
      MEMASCEND_RETURN_IF_ERROR(adam->LoadParameters(g, {w.data(), n, memascend::DType::kF32}));
      for (std::size_t k = 0; k < n; ++k) {
        const float d = w[k] - target(g, k);
        sum += static_cast<double>(d) * d;
        grad[k] = 2.0f * d * adam->loss_scale();
      }
      count += static_cast<double>(n);
      for (std::size_t p = 0; p < layout.Parts(g); ++p) {
        const auto [begin, end] = layout.PartRange(g, p);
        MEMASCEND_RETURN_IF_ERROR(
            adam->SetGradient(g, p, {grad.data() + begin, end - begin, memascend::DType::kF32}));
      }
    }
    loss = sum / count;
    if (first_loss < 0) first_loss = loss;
    // The update, part by part under the budget, then a crash-safe commit.
    MEMASCEND_ASSIGN_OR_RETURN(memascend::StepPlan plan, adam->EndBackward());
    if (!plan.skipped) MEMASCEND_RETURN_IF_ERROR(adam->UpdateAll());
    MEMASCEND_RETURN_IF_ERROR(adam->Commit(step + 1, "step " + std::to_string(step + 1)));
  }
  MEMASCEND_RETURN_IF_ERROR(adam->Settle());
  const memascend::TensorStoreStats stats = store->stats();
  std::printf(
      "downstream: steps %llu..%llu, loss %.5f -> %.5f; optimizer state %.1f MiB on %s under a "
      "pinned budget of %.1f MiB (%.0f MiB read, %.0f MiB written)\n",
      static_cast<unsigned long long>(step - kSteps + 1), static_cast<unsigned long long>(step),
      first_loss, loss, static_cast<double>(layout.TotalElements()) * 12 / (1 << 20), path.c_str(),
      static_cast<double>(store_options.host_budget_bytes) / (1 << 20),
      static_cast<double>(stats.bytes_read) / (1 << 20),
      static_cast<double>(stats.bytes_written) / (1 << 20));
  if (!(loss < first_loss)) return absl::InternalError("the loss did not fall");
  state.reset();  // settles; then the store writes back and closes before the volume goes
  return store->Close();
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
