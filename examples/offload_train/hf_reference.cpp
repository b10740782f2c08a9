// hf-reference: one forward and backward pass of the trainer's model (Llama or GPT-2) over
// a Hugging Face checkpoint, for the PyTorch comparisons (tests/python/
// test_llama_reference.py, test_gpt2_reference.py).
//
//   hf-reference MODEL_DIR TOKENS BATCH SEQ OUT.safetensors
//
// MODEL_DIR holds config.json and model.safetensors (or shards with their index); TOKENS
// is BATCH x (SEQ + 1) little-endian uint32 ids, each row predicting its tokens 1..SEQ
// from 0..SEQ-1. OUT gets "loss" (the mean cross-entropy, one F32), "grad.<name>" for
// every parameter tensor and "param.<name>" after one step of the SDK's OffloadedAdam
// (AdamW, lr 1e-2, weight decay 0.1, betas 0.9/0.999, eps 1e-8, no clipping or loss
// scaling) over those gradients (F32, Hugging Face's names and layouts: GPT-2's Conv1D
// weights and their gradients [in, out]). Computed in fp32, on the exact matrix loops.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <memascend/offloaded_optimizer.h>
#include <memascend/safetensors.h>
#include <memascend/status.h>
#include <memascend/training_state.h>

#include "checkpoint_io.h"
#include "hf_config.h"
#include "network.h"

namespace offload_train {
namespace {

absl::Status Run(const std::string& dir, const std::string& tokens_path, std::size_t batch,
                 std::size_t seq, const std::string& out_path) {
  MEMASCEND_ASSIGN_OR_RETURN(HfConfig hf, ReadHfConfig(dir + "/config.json"));
  const ModelConfig c = ForHf(hf, batch, seq);
  MEMASCEND_RETURN_IF_ERROR(Validate(c));
  MEMASCEND_ASSIGN_OR_RETURN(auto ckpt, memascend::SafetensorsCheckpoint::Open(dir));
  const std::size_t groups = GroupCount(c);
  std::vector<std::vector<float>> params(groups), grads(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    params[g].resize(GroupParams(c, g));
    grads[g].assign(params[g].size(), 0.0f);
    MEMASCEND_RETURN_IF_ERROR(
        ImportHfGroup(*ckpt, c, g, {params[g].data(), params[g].size(), memascend::DType::kF32}));
  }
  std::vector<std::uint32_t> ids(batch * (seq + 1));
  std::FILE* f = std::fopen(tokens_path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(tokens_path);
  const std::size_t got = std::fread(ids.data(), 4, ids.size(), f);
  std::fclose(f);
  if (got != ids.size())
    return absl::InvalidArgumentError(
        fmt::format("{}: {} ids, not {}", tokens_path, got, ids.size()));
  std::vector<std::int32_t> inputs(batch * seq), targets(batch * seq);
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::size_t t = 0; t < seq; ++t) {
      const std::uint32_t in = ids[b * (seq + 1) + t], next = ids[b * (seq + 1) + t + 1];
      if (in >= c.vocab || next >= c.vocab)
        return absl::InvalidArgumentError(
            fmt::format("{}: a token id beyond the vocabulary", tokens_path));
      inputs[b * seq + t] = static_cast<std::int32_t>(in);
      targets[b * seq + t] = static_cast<std::int32_t>(next);
    }
  }
  memascend::KernelThreads threads(2);
  const std::unique_ptr<Network> model = MakeNetwork(c, {}, &threads);
  model->Embed(params[0].data(), inputs.data());
  for (std::size_t l = 0; l < c.layers; ++l) model->Block(l, params[l + 1].data());
  const double loss =
      model->Head(params[groups - 1].data(), params[0].data(), targets.data(), 1.0f, true);
  model->HeadGradient(grads[groups - 1].data(), 0, grads[groups - 1].size());
  for (std::size_t l = c.layers; l-- > 0;)
    model->BlockBackward(l, params[l + 1].data(), grads[l + 1].data());
  model->EmbedGradient(grads[0].data(), 0, grads[0].size());

  // One AdamW step of the SDK's optimizer over the gradients, every group in memory.
  memascend::StateLayout layout;
  for (std::size_t g = 0; g < groups; ++g)
    layout.groups.push_back({fmt::format("g{}", g), params[g].size(), true});
  layout.param_dtype = layout.grad_dtype = memascend::DType::kF32;
  MEMASCEND_ASSIGN_OR_RETURN(auto state, memascend::InMemoryTrainingState::Create(layout));
  memascend::OffloadedAdamOptions o;
  o.lr = 1e-2f;
  o.weight_decay = 0.1f;
  o.scaler.initial_scale = 1.0f;
  MEMASCEND_ASSIGN_OR_RETURN(auto adam, memascend::OffloadedAdam::Create(state.get(), o, &threads));
  for (std::size_t g = 0; g < groups; ++g)
    MEMASCEND_RETURN_IF_ERROR(adam->Initialize(g, params[g]));
  MEMASCEND_RETURN_IF_ERROR(adam->Commit(0));
  adam->BeginBackward();
  for (std::size_t g = 0; g < groups; ++g) {
    MEMASCEND_RETURN_IF_ERROR(
        adam->SetGradient(g, 0, {grads[g].data(), grads[g].size(), memascend::DType::kF32}));
  }
  MEMASCEND_ASSIGN_OR_RETURN(memascend::StepPlan step, adam->EndBackward());
  if (step.skipped) return absl::InternalError("the step was skipped (inf or NaN gradients)");
  std::vector<std::vector<float>> updated(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    updated[g].resize(params[g].size());
    MEMASCEND_RETURN_IF_ERROR(
        adam->UpdateGroup(g, {updated[g].data(), updated[g].size(), memascend::DType::kF32}));
  }

  std::vector<memascend::SafetensorsTensor> plan = {{"loss", "F32", {1}}};
  for (const char* prefix : {"grad.", "param."}) {
    for (memascend::SafetensorsTensor t : HfTensors(c, "F32")) {
      t.name = prefix + t.name;
      plan.push_back(std::move(t));
    }
  }
  MEMASCEND_ASSIGN_OR_RETURN(auto w,
                             memascend::SafetensorsWriter::Create(out_path, plan, {}, true));
  const float l32 = static_cast<float>(loss);
  MEMASCEND_RETURN_IF_ERROR(w->Append({&l32, 1, memascend::DType::kF32}));
  for (const auto* all : {&grads, &updated}) {
    for (std::size_t g = 0; g < groups; ++g) {
      MEMASCEND_RETURN_IF_ERROR(
          ForEachHfTensor(c, g, (*all)[g].data(), [&w](const HfTensorSlice& t, const float* data) {
            return w->Append({data, t.slice.count, memascend::DType::kF32});
          }));
    }
  }
  return w->Finish();
}

}  // namespace
}  // namespace offload_train

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: hf-reference MODEL_DIR TOKENS BATCH SEQ OUT.safetensors\n");
    return 2;
  }
  const absl::Status s = offload_train::Run(argv[1], argv[2], std::strtoul(argv[3], nullptr, 10),
                                            std::strtoul(argv[4], nullptr, 10), argv[5]);
  if (!s.ok()) {
    std::fprintf(stderr, "hf-reference: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
