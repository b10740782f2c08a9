// The training loop: offloaded and in-memory runs agree bit for bit; a run killed with
// SIGKILL resumes to the same losses; budgets below one layer's need are refused.
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <signal.h>
#include <string>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <tuple>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memascend/safetensors.h>
#include <memascend/volume.h>

#include "blas.h"
#include "data.h"
#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"
#include "train/thread_comm.h"
#include "trainer.h"
#include "zero_infinity.h"

namespace offload_train {
namespace {

using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

// A text with structure to learn, made here (tests read nothing outside the tree).
std::string Corpus() {
  std::string text;
  std::mt19937 rng(11);
  const char* words[] = {"the",    "licence", "software", "copy", "free",
                         "source", "code",    "program",  "work", "you",
                         "may",    "must",    "terms",    "of",   "and"};
  for (int line = 0; line < 400; ++line) {
    for (int w = 0; w < 9; ++w) {
      text += words[rng() % 15];
      text += (w == 8) ? ".\n" : " ";
    }
  }
  return text;
}

TrainOptions Tiny(const std::string& volume) {
  TrainOptions o;
  o.model.vocab = 256;
  o.model.seq = 16;
  o.model.channels = 32;
  o.model.layers = 2;
  o.model.heads = 2;
  o.model.batch = 4;
  o.steps = 24;
  o.threads = 2;
  o.warmup = 5;
  o.volume_path = volume;
  // The default's floor: twice what the optimizer step leases at once. Tensors are
  // evicted and written back all the time.
  o.host_budget = MinimumHostBudget(o.model, o.dtype);
  return o;
}

// A Llama of Tiny()'s sizes, its embeddings tied to its head.
HfConfig TinyTiedLlama() {
  HfConfig hf;
  hf.arch = Arch::kLlama;
  hf.vocab = 256;
  hf.hidden = 32;
  hf.layers = 2;
  hf.heads = 4;
  hf.kv_heads = 2;
  hf.head_dim = 8;
  hf.intermediate = 64;
  hf.max_positions = 64;
  hf.tie_embeddings = true;
  return hf;
}

struct Data {
  Tokenizer tok;
  std::vector<std::int32_t> tokens;
};
Data MakeData(std::size_t vocab) {
  const std::string text = Corpus();
  auto tok = Tokenizer::Build(text, vocab);
  EXPECT_TRUE(tok.ok());
  Data d{*tok, {}};
  d.tokens = d.tok.Encode(text);
  return d;
}

// A Hugging Face Llama (tied head, grouped-query attention) through the same loop, from
// token ids: offloaded with checkpointed activations through the store, under the
// tightest budget, through the BLAS where built; the in-memory run keeping every
// activation gives the same losses bit for bit, and the model learns.
TEST(Train, LlamaCheckpointedAndOffloadedMatchesTheInMemoryRun) {
  const Data d = MakeData(256);
  const HfConfig hf = TinyTiedLlama();
  ScratchPath path("train_llama");
  TrainOptions o = Tiny(path.path());
  o.model = ForHf(hf, 4, 16);
  o.host_budget = MinimumHostBudget(o.model, o.dtype);
  o.checkpoint_activations = true;
  o.blas = blas::Available();
  ASSERT_OK_AND_ASSIGN(TrainSummary off, Train(o, d.tokens));
  o.mode = Mode::kReference;
  o.checkpoint_activations = false;
  ASSERT_OK_AND_ASSIGN(TrainSummary ref, Train(o, d.tokens));
  ASSERT_EQ(off.losses.size(), o.steps);
  EXPECT_EQ(off.losses, ref.losses);
  EXPECT_LT(off.activation_bytes, ref.activation_bytes);
  EXPECT_LT(off.losses.back(), off.losses.front() - 1.0);
  EXPECT_LE(off.peak_pinned_bytes, o.host_budget);
}

// Note [tied head]: the tied embeddings, kept in 16 bits, widened 3 rows at a time (86
// chunks of the vocabulary, the 16-bit offsets of every one) train, evaluate and sample as
// when widened in one chunk: the same bits on the exact path. The evaluation's master
// weights replace the 16 bits, which sampling then makes again.
TEST(Train, TiedEmbeddingsWidenedAFewRowsAtATimeTrainAsInOneChunk) {
  const Data d = MakeData(256);
  const HfConfig hf = TinyTiedLlama();
  std::vector<TrainSummary> runs;
  for (const std::size_t chunk_bytes : {kTiedChunkBytes, std::size_t{3 * 32 * 4}}) {
    ScratchPath path("train_tied_chunks");
    TrainOptions o = Tiny(path.path());
    o.model = ForHf(hf, 4, 16);
    o.host_budget = MinimumHostBudget(o.model, o.dtype);
    o.steps = 8;
    o.tied_chunk_bytes = chunk_bytes;
    o.blas = false;  // the exact path: the bits of whole products
    o.eval_tokens = std::make_shared<const std::vector<std::int32_t>>(
        d.tokens.begin(), d.tokens.begin() + 4 * 17 * 3);
    o.sample_tokens = 12;
    ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
    ASSERT_EQ(s.losses.size(), 8u);
    ASSERT_TRUE(s.eval_loss.has_value());
    runs.push_back(std::move(s));
  }
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_EQ(*runs[0].eval_loss, *runs[1].eval_loss);
  EXPECT_EQ(runs[0].sample, runs[1].sample);
  EXPECT_FALSE(runs[0].sample.empty());
  EXPECT_LT(runs[0].losses.back(), runs[0].losses.front());
}

TEST(Train, OffloadedAndReferenceLossesAreEqualAtEveryStep) {
  for (memascend::DType dtype : {memascend::DType::kF16, memascend::DType::kBF16}) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.dtype = dtype;
    o.initial_loss_scale = dtype == memascend::DType::kF16 ? 65536.0f : 1.0f;
    const Data d = MakeData(256);
    ASSERT_OK_AND_ASSIGN(TrainSummary off, Train(o, d.tokens, d.tok));
    o.mode = Mode::kReference;
    ASSERT_OK_AND_ASSIGN(TrainSummary ref, Train(o, d.tokens, d.tok));
    ASSERT_EQ(off.losses.size(), 24u);
    ASSERT_EQ(ref.losses.size(), 24u);
    for (std::size_t i = 0; i < 24; ++i)
      EXPECT_EQ(off.losses[i], ref.losses[i]) << memascend::ToString(dtype) << " step " << i + 1;
    // It learns, and the offloaded run stayed within its budget while doing I/O.
    EXPECT_LT(off.final_loss, off.losses.front() - 1.0);
    EXPECT_LE(off.peak_pinned_bytes, o.host_budget);
    EXPECT_GT(off.io_read_bytes, 24 * off.params * 2);
    EXPECT_GT(off.model_state_bytes, o.host_budget);
    // The store's counters come with the summary: every use of a tensor the trainer
    // read ahead is a hit or a miss (each applied update acquires the three states of
    // every group's parts), and some were read ahead.
    ASSERT_TRUE(off.store.has_value());
    EXPECT_GT(off.store->prefetch_hits, 0u);
    const auto applied = static_cast<std::uint64_t>(24 - off.skipped_steps);
    EXPECT_GE(off.store->prefetch_hits + off.store->prefetch_misses,
              3 * GroupCount(o.model) * applied);
    EXPECT_FALSE(ref.store.has_value());
  }
}

// Note [optimizer overlap]: a step's update interleaved with the next step's forward
// pass computes what the sequential loop computes, and every step is reported once, in
// order, when committed.
TEST(Train, TheOverlappedUpdateTrainsAsTheSequentialOne) {
  const Data d = MakeData(256);
  std::vector<TrainSummary> runs;
  for (bool overlap : {true, false}) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.overlap_optimizer = overlap;
    o.initial_loss_scale = 1u << 22;  // the first steps overflow: skipped steps too
    std::vector<std::size_t> reported;
    std::size_t skipped = 0;
    o.on_step = [&](const StepReport& r) {
      reported.push_back(r.step);
      skipped += r.skipped ? 1 : 0;
      EXPECT_GT(r.seconds, 0.0);
    };
    ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
    ASSERT_EQ(reported.size(), 24u);
    for (std::size_t i = 0; i < reported.size(); ++i) EXPECT_EQ(reported[i], i + 1);
    ASSERT_EQ(s.step_skipped.size(), 24u);
    EXPECT_EQ(static_cast<std::int64_t>(skipped), s.skipped_steps);
    EXPECT_GT(s.skipped_steps, 0);
    EXPECT_LT(s.skipped_steps, 24);
    EXPECT_LE(s.peak_pinned_bytes, o.host_budget);
    runs.push_back(std::move(s));
  }
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_EQ(runs[0].step_skipped, runs[1].step_skipped);
}

// The ablation's replacements (bench/ablation.py) change memory and time, never the
// training: the pool in powers of two, and the overflow check with PyTorch's temporaries
// (which must skip the same overflowing steps as the fused kernel).
TEST(Train, TheAblationsReplacementsTrainTheSame) {
  const Data d = MakeData(256);
  const auto run = [&](const std::function<void(TrainOptions*)>& change) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.initial_loss_scale = 1u << 22;  // the first steps overflow: skipped steps too
    o.host_budget *= 2;  // room for the pow2 pool's rounding (its blocks fragment the arena)
    change(&o);
    return Train(o, d.tokens, d.tok);
  };
  ASSERT_OK_AND_ASSIGN(TrainSummary base, run([](TrainOptions*) {}));
  ASSERT_GT(base.skipped_steps, 0);
  ASSERT_OK_AND_ASSIGN(TrainSummary pow2, run([](TrainOptions* o) { o->pow2_pool = true; }));
  ASSERT_OK_AND_ASSIGN(TrainSummary unfused,
                       run([](TrainOptions* o) { o->unfused_overflow_check = true; }));
  ASSERT_OK_AND_ASSIGN(TrainSummary files, run([](TrainOptions* o) { o->file_per_tensor = true; }));
  for (const TrainSummary* s : {&pow2, &unfused, &files}) {
    EXPECT_EQ(s->losses, base.losses);
    EXPECT_EQ(s->step_skipped, base.step_skipped);
  }
}

// Note [derived parameters]: the embedding's and the head's 16-bit parameters are never
// stored on a MemAscend volume; the steps after skipped ones and sampling make them from
// the master weights, to the same bits as the reference's stored ones.
TEST(Train, TheEmbeddingAndHeadParametersAreDerivedNotStored) {
  const Data d = MakeData(256);
  std::vector<TrainSummary> runs;
  for (Mode mode : {Mode::kOffload, Mode::kReference}) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.mode = mode;
    o.steps = 8;
    o.initial_loss_scale = 1u << 22;  // skipped steps: forward passes with no update
    o.sample_tokens = 12;
    ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
    ASSERT_GT(s.skipped_steps, 0);
    if (mode == Mode::kOffload) {
      ASSERT_OK_AND_ASSIGN(auto volume, memascend::Volume::Open(path.path(), {}));
      const std::size_t head = GroupCount(o.model) - 1;
      // The state (in place: memascend Note [state in place]) holds the blocks' parameters,
      // not the embedding's nor the head's.
      EXPECT_OK(volume->Stat("block.0.master.p0"));
      EXPECT_OK(volume->Stat("block.0.param.p0"));
      for (std::size_t g : {std::size_t{0}, head}) {
        const std::string name = fmt::format("{}.param.p0", GroupName(o.model, g));
        EXPECT_THAT(volume->Stat(name).status(), StatusIs(absl::StatusCode::kNotFound)) << name;
        EXPECT_OK(volume->Stat(fmt::format("{}.master.p0", GroupName(o.model, g))));
      }
    }
    runs.push_back(std::move(s));
  }
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_FALSE(runs[0].sample.empty());
  EXPECT_EQ(runs[0].sample, runs[1].sample);

  // The layout does not depend on the overlap: an overlapped run resumed without it (its
  // forward passes then derive those parameters every step) reaches the reference's losses.
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.steps = 4;
  ASSERT_OK(Train(o, d.tokens, d.tok).status());
  o.resume = true;
  o.overlap_optimizer = false;
  o.steps = 8;
  ASSERT_OK_AND_ASSIGN(TrainSummary resumed, Train(o, d.tokens, d.tok));
  o.resume = false;
  o.mode = Mode::kReference;
  ASSERT_OK_AND_ASSIGN(TrainSummary whole, Train(o, d.tokens, d.tok));
  ASSERT_EQ(resumed.first_step, 5u);
  ASSERT_EQ(resumed.losses.size(), 4u);
  EXPECT_EQ(resumed.losses, std::vector<double>(whole.losses.begin() + 4, whole.losses.end()));
}

// Note [kept state]: optimizer state kept resident across steps changes what is read,
// not what is computed.
TEST(Train, KeptOptimizerStateReadsLessAndTrainsTheSame) {
  const Data d = MakeData(256);
  std::vector<TrainSummary> runs;
  for (bool kept : {false, true}) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.steps = 12;
    o.model.layers = 6;  // the state is larger than the budget
    const std::size_t held = MinimumHostBudget(o.model, o.dtype) / 2;  // by the update at once
    o.host_budget = held * 5;
    // The same read-ahead in both runs and, in the second, the rest of the budget kept.
    // (Handing the kept bytes to the read-ahead instead is no control: what a larger
    // read-ahead saves depends on timing, and the two came out within noise of each other.)
    o.read_ahead_bytes = held;
    o.keep_bytes = kept ? 3 * held : 0;
    // Nothing in flight beside the step: what a background write-back or an overlapped
    // update evicts depends on timing, and so would the count of bytes read.
    o.overlap_optimizer = false;
    o.write_behind = false;
    ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
    EXPECT_LE(s.peak_pinned_bytes, o.host_budget);
    runs.push_back(std::move(s));
  }
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_LT(runs[1].io_read_bytes, runs[0].io_read_bytes);
  // More kept state than the budget leaves beyond the minimum is refused up front.
  {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    o.model.layers = 6;
    o.host_budget = MinimumHostBudget(o.model, o.dtype) * 3 / 2;
    o.keep_bytes = MinimumHostBudget(o.model, o.dtype) + 1;
    EXPECT_THAT(Train(o, d.tokens, d.tok),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--keep")));
  }
  std::printf("bytes read: %llu without kept state, %llu with\n",
              static_cast<unsigned long long>(runs[0].io_read_bytes),
              static_cast<unsigned long long>(runs[1].io_read_bytes));
}

// The ZeRO-Infinity policy with every tensor swapped through its file, in several
// sub-groups.
void SwapEverything(TrainOptions* o) {
  o->policy = Policy::kZeroInfinity;
  o->zero.min_swap_bytes = 0;
  o->zero.aio_block_bytes = 4096;    // the threshold is max(min_swap_bytes, aio block)
  o->zero.param_buffer_size = 1000;  // raised to the largest parameter by the rule
  o->zero.sub_group_size = 30'000;
}

// The ZeRO-Infinity baseline computes the same losses as the SDK (the headline compares
// memory and time of runs that train identically), with its own rules for buffers.
TEST(Train, ZeroInfinityPolicyTrainsIdenticallyUnderItsOwnRules) {
  ScratchPath path("train");
  const Data d = MakeData(256);
  TrainOptions o = Tiny(path.path());
  o.steps = 12;
  ASSERT_OK_AND_ASSIGN(TrainSummary ours, Train(o, d.tokens, d.tok));
  SwapEverything(&o);
  ASSERT_OK_AND_ASSIGN(TrainSummary zero, Train(o, d.tokens, d.tok));
  ASSERT_EQ(zero.losses.size(), ours.losses.size());
  for (std::size_t i = 0; i < ours.losses.size(); ++i)
    EXPECT_EQ(zero.losses[i], ours.losses[i]) << "step " << i + 1;
  EXPECT_EQ(zero.step_skipped, ours.step_skipped);        // its overflow check finds the same
  EXPECT_EQ(zero.peak_pinned_bytes, ZeroPinnedBytes(o));  // every buffer pinned up front
  EXPECT_GT(zero.io_read_bytes, 0u);
  EXPECT_FALSE(zero.store.has_value());  // its own buffers and files, no tensor store
  // Note [zero rules]: under max_in_cpu (1e9 elements) the 16-bit parameters stay in a
  // pinned flat buffer, never on disk; the gradients go out in fp32 and come back for the
  // step: per step, master weights, both moments and the gradient are read (4 bytes each).
  const std::string swap = path.path() + ".zero/zero_stage_3";
  namespace fs = std::filesystem;
  EXPECT_TRUE(fs::is_empty(swap + "/params/rank0"));
  EXPECT_TRUE(fs::exists(swap + "/optimizer/rank0/1_gradient.tensor.swp"));
  const std::uint64_t params = TotalParams(o.model);
  EXPECT_GE(zero.io_read_bytes, 16 * params * o.steps);
  EXPECT_LT(zero.io_read_bytes, 16 * params * o.steps + 4 * 4096 * GroupCount(o.model) * o.steps);
  // Above max_in_cpu, every sub-group's parameters on NVMe (a buffer of the largest
  // sub-group carries them out); the flat gradient buffer pinned as offload_optimizer's
  // pin_memory says; buckets of any size: the same losses, each buffer pinned up front.
  for (const auto& [max_in_cpu, pin, bucket] :
       {std::tuple<std::uint64_t, bool, std::uint64_t>{0, false, 500'000'000},
        {0, true, 5000},
        {1'000'000'000, true, 1}}) {
    ScratchPath other("train");
    TrainOptions z = o;
    z.volume_path = other.path();
    z.zero.max_in_cpu = max_in_cpu;
    z.zero.optimizer_pin_memory = pin;
    z.zero.reduce_bucket_size = bucket;
    ASSERT_OK_AND_ASSIGN(TrainSummary run, Train(z, d.tokens, d.tok));
    EXPECT_EQ(run.losses, ours.losses) << max_in_cpu << " " << pin << " " << bucket;
    EXPECT_EQ(run.peak_pinned_bytes, ZeroPinnedBytes(z));
    EXPECT_EQ(fs::exists(other.path() + ".zero/zero_stage_3/params/rank0/1_param.tensor.swp"),
              max_in_cpu == 0);
    TrainOptions unpinned = z;
    unpinned.zero.optimizer_pin_memory = false;
    if (pin) {
      EXPECT_EQ(ZeroPinnedBytes(z) - ZeroPinnedBytes(unpinned),
                std::bit_ceil(TotalParams(o.model) * 2));
    }
  }
  // With DeepSpeed's minimum of tensors to swap, this tiny model stays in memory.
  o.zero.min_swap_bytes = 1u << 20;
  ASSERT_OK_AND_ASSIGN(TrainSummary in_memory, Train(o, d.tokens, d.tok));
  EXPECT_EQ(in_memory.io_read_bytes, 0u);
  EXPECT_EQ(in_memory.losses, ours.losses);
  // Its rules refuse what cannot work.
  o.zero.optimizer_buffer_count = 3;
  EXPECT_THAT(Train(o, d.tokens, d.tok),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("4 optimizer buffers")));
  o.zero.optimizer_buffer_count = 4;
  o.resume = true;
  EXPECT_THAT(Train(o, d.tokens, d.tok), StatusIs(absl::StatusCode::kInvalidArgument));
}

// pipeline_read / pipeline_write overlap a sub-group's reads and writes with its
// neighbours' steps: the same losses, with the buffers each flag needs, refused without.
TEST(Train, ZeroInfinityPipelinedSwapperTrainsIdentically) {
  ScratchPath path("train");
  const Data d = MakeData(256);
  TrainOptions o = Tiny(path.path());
  o.steps = 6;
  ASSERT_OK_AND_ASSIGN(TrainSummary ours, Train(o, d.tokens, d.tok));
  SwapEverything(&o);
  ASSERT_GT(GroupCount(o.model), 3u);
  for (const auto& [read, write, max_in_cpu] :
       {std::tuple<bool, bool, std::uint64_t>{true, false, 1'000'000'000},
        {false, true, 0},
        {true, true, 0},
        {true, true, 1'000'000'000}}) {
    ScratchPath other("train");
    TrainOptions z = o;
    z.volume_path = other.path();
    z.zero.pipeline_read = read;
    z.zero.pipeline_write = write;
    z.zero.max_in_cpu = max_in_cpu;  // 0: the new 16-bit parameters written behind too
    z.zero.optimizer_buffer_count = 4 * (1 + read + write);
    ASSERT_OK_AND_ASSIGN(TrainSummary run, Train(z, d.tokens, d.tok));
    EXPECT_EQ(run.losses, ours.losses) << read << " " << write << " " << max_in_cpu;
    EXPECT_EQ(run.peak_pinned_bytes, ZeroPinnedBytes(z));
    TrainOptions plain = z;
    plain.zero.pipeline_read = plain.zero.pipeline_write = false;
    ScratchPath third("train");
    plain.volume_path = third.path();
    ASSERT_OK_AND_ASSIGN(TrainSummary unpipelined, Train(plain, d.tokens, d.tok));
    // The same requests, overlapped: as many bytes each way.
    EXPECT_EQ(run.io_read_bytes, unpipelined.io_read_bytes);
    EXPECT_EQ(run.io_write_bytes, unpipelined.io_write_bytes);
    // One set of four buffers fewer than the flags need is refused.
    z.zero.optimizer_buffer_count -= 1;
    EXPECT_THAT(
        Train(z, d.tokens, d.tok),
        StatusIs(absl::StatusCode::kResourceExhausted,
                 HasSubstr(fmt::format("{} optimizer buffers needed, {} given",
                                       4 * (1 + read + write), z.zero.optimizer_buffer_count))));
  }
}

// What DeepSpeed does not pay (Note [zero rules]): a bucket's fp32 gradient copies are
// made on the GPU, so the host holds none; bf16 runs no overflow check (no temporaries);
// a tensor under the aio block stays in memory. And 0.19.5's rules: the swap buffers
// page-locked at their exact size with no pageable copy at start-up, both pin_memory
// flags on. The same losses under each.
TEST(Train, ZeroInfinityPaysOnlyWhatDeepSpeedPays) {
  ScratchPath path("train");
  const Data d = MakeData(256);
  TrainOptions o = Tiny(path.path());
  o.steps = 4;
  o.dtype = memascend::DType::kBF16;
  o.initial_loss_scale = 1.0f;
  ASSERT_OK_AND_ASSIGN(TrainSummary ours, Train(o, d.tokens, d.tok));
  SwapEverything(&o);
  o.zero.sub_group_size = 1;  // a sub-group per tensor: start-up's buffers well below the model
  const std::int64_t params = static_cast<std::int64_t>(TotalParams(o.model));
  const auto staging = [](const TrainSummary& s) {
    return s.ledger.use(memascend::Tier::kPageableHost, memascend::Use::kStaging).live_peak;
  };
  // One bucket for the whole backward pass (reduce_bucket_size 5e8): its fp32 copies were
  // 4 bytes a parameter of host memory; they are the GPU's. No check in bf16.
  ASSERT_OK_AND_ASSIGN(TrainSummary z16, Train(o, d.tokens, d.tok));
  EXPECT_EQ(z16.losses, ours.losses);
  EXPECT_EQ(z16.peak_pinned_bytes, ZeroPinnedBytes(o));
  EXPECT_GT(staging(z16), 0);  // the start-up's pageable buffers
  EXPECT_LT(staging(z16), 4 * params);
  // fp16 runs the check: a 1-byte temporary per element, twice in turn.
  {
    ScratchPath half("train");
    TrainOptions f = o;
    f.volume_path = half.path();
    f.dtype = memascend::DType::kF16;
    ASSERT_OK_AND_ASSIGN(TrainSummary z16f, Train(f, d.tokens, d.tok));
    EXPECT_GE(staging(z16f), params);
  }

  // 0.19.5's rules: the same losses; the swap buffers at their size, no pageable copy.
  TrainOptions z = o;
  z.zero = ZeroDefaults(ZeroRelease::k0_19_5);
  ASSERT_TRUE(z.zero.optimizer_pin_memory && z.zero.param_pin_memory);
  z.zero.min_swap_bytes = 0;
  z.zero.aio_block_bytes = 4096;
  z.zero.param_buffer_size = 1000;
  z.zero.sub_group_size = 1;
  ScratchPath other("train");
  z.volume_path = other.path();
  ASSERT_OK_AND_ASSIGN(TrainSummary z19, Train(z, d.tokens, d.tok));
  EXPECT_EQ(z19.losses, ours.losses);
  EXPECT_EQ(z19.peak_pinned_bytes, ZeroPinnedBytes(z));
  EXPECT_LT(staging(z19), staging(z16));  // the largest sub-group's fp32 buffer alone
  TrainOptions rounded = z;               // the same flags under 0.16.5's pow2 swap buffers
  rounded.zero.release = ZeroRelease::k0_16_5;
  EXPECT_LT(ZeroPinnedBytes(z), ZeroPinnedBytes(rounded));
  // The small parameters pinned with offload_param.pin_memory: at the threshold of 1 MiB
  // every tensor of this model stays in memory, each pinned through the pow2 pool.
  ScratchPath third("train");
  z.volume_path = third.path();
  z.zero.min_swap_bytes = 1u << 20;
  z.zero.max_in_cpu = 0;
  TrainOptions unpinned = z;
  unpinned.zero.param_pin_memory = false;
  EXPECT_GT(ZeroPinnedBytes(z), ZeroPinnedBytes(unpinned));
  ASSERT_OK_AND_ASSIGN(TrainSummary small, Train(z, d.tokens, d.tok));
  EXPECT_EQ(small.losses, ours.losses);
  EXPECT_EQ(small.peak_pinned_bytes, ZeroPinnedBytes(z));
  EXPECT_EQ(small.io_read_bytes, 0u);

  // The swap threshold is max(1 MiB, aio block), as swappable_tensor says.
  ZeroOptions t;
  t.aio_block_bytes = 8u << 20;
  EXPECT_EQ(t.SwapThresholdBytes(), 8u << 20);
  t.aio_block_bytes = 4096;
  EXPECT_EQ(t.SwapThresholdBytes(), 1u << 20);
}

TEST(Train, AWordVocabularyMakesTheEmbeddingTheLargestTensor) {
  const Data d = MakeData(1024);
  EXPECT_EQ(d.tok.size(), 1024u);  // 15 words in this text: the rest are unused ids
  std::string round;
  for (std::int32_t t : d.tokens) round += d.tok.Decode(t);
  EXPECT_EQ(round, Corpus());  // lossless with the byte fallback
  EXPECT_LT(d.tokens.size(), Corpus().size() / 2);
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.model.vocab = 1024;
  o.steps = 3;
  o.host_budget = 0;  // the default
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
  EXPECT_EQ(s.losses.size(), 3u);
  EXPECT_GT(GroupParams(o.model, 0), GroupParams(o.model, 1));
  EXPECT_THAT(Tokenizer::Build("abc", 100), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Note [parts]: every kind of state in parts of the optimizer chunk, so the update holds
// one part of a group at a time: a budget below one group's gradient and new parameters
// (what the update held before) trains, to the reference's losses and ZeRO-Infinity's.
TEST(Train, GroupsInManyPartsTrainUnderABudgetBelowOneGroup) {
  const Data d = MakeData(16384);
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.model.vocab = 16384;
  o.model.channels = 64;
  o.model.layers = 1;
  o.model.batch = 2;
  o.steps = 6;
  o.optimizer_chunk = kOptimizerChunkQuantum;
  const std::size_t embedding = GroupParams(o.model, 0);
  ASSERT_GE(OptimizerParts(o.model, 0, o.optimizer_chunk), 4u);
  const std::size_t half = memascend::SizeOf(o.dtype);
  // The least budget: far below the embedding's state (16 bytes a parameter).
  o.host_budget = MinimumHostBudget(o.model, o.dtype, o.optimizer_chunk);
  ASSERT_LT(o.host_budget, embedding * (2 * half + 12) / 2);
  ASSERT_OK_AND_ASSIGN(TrainSummary off, Train(o, d.tokens, d.tok));
  EXPECT_LE(off.peak_pinned_bytes, o.host_budget);
  EXPECT_GT(off.io_read_bytes, 6 * off.params * 2);
  o.mode = Mode::kReference;
  ASSERT_OK_AND_ASSIGN(TrainSummary ref, Train(o, d.tokens, d.tok));
  o.mode = Mode::kOffload;
  o.policy = Policy::kZeroInfinity;
  o.zero.min_swap_bytes = 0;
  o.zero.aio_block_bytes = 4096;
  o.zero.param_buffer_size = 1000;  // raised to the largest parameter (not 1e8 elements pinned)
  o.zero.sub_group_size = 300'000;
  ASSERT_OK_AND_ASSIGN(TrainSummary zero, Train(o, d.tokens, d.tok));
  ASSERT_EQ(off.losses.size(), 6u);
  EXPECT_EQ(off.losses, ref.losses);
  EXPECT_EQ(off.losses, zero.losses);
  EXPECT_LT(off.final_loss, off.losses.front());
}

TEST(Train, ABudgetBelowOneLayerIsRefusedUpFront) {
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.host_budget = MinimumHostBudget(o.model, o.dtype) - 4096;
  const Data d = MakeData(256);
  EXPECT_THAT(Train(o, d.tokens, d.tok),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--host-budget")));
  o.resume = true;
  o.host_budget = 0;
  EXPECT_THAT(Train(o, d.tokens, d.tok), StatusIs(absl::StatusCode::kNotFound));  // no volume
}

TEST(Train, ResumeRefusesAnotherRunsVolume) {
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.steps = 2;
  const Data d = MakeData(256);
  ASSERT_OK(Train(o, d.tokens, d.tok).status());
  o.resume = true;
  o.steps = 3;
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(o, d.tokens, d.tok));
  EXPECT_EQ(s.first_step, 3u);
  o.seed = 99;
  EXPECT_THAT(Train(o, d.tokens, d.tok),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("seed: 1 on the volume, 99 in this run")));
}

// Never reformat what the user did not ask to: a second run on a volume without --resume
// is refused with the way forward; --force starts over.
TEST(Train, AnExistingVolumeIsNeverReformattedWithoutForce) {
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.steps = 2;
  const Data d = MakeData(256);
  ASSERT_OK(Train(o, d.tokens, d.tok).status());
  EXPECT_THAT(Train(o, d.tokens, d.tok), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                  AllOf(HasSubstr("--resume"), HasSubstr("--force"),
                                                        HasSubstr("training checkpoint"))));
  o.resume = true;  // the refused run lost nothing: the first one's state resumes
  o.steps = 3;
  ASSERT_OK_AND_ASSIGN(TrainSummary resumed, Train(o, d.tokens, d.tok));
  EXPECT_EQ(resumed.first_step, 3u);
  o.resume = false;
  o.force = true;
  ASSERT_OK_AND_ASSIGN(TrainSummary fresh, Train(o, d.tokens, d.tok));
  EXPECT_EQ(fresh.first_step, 1u);
}

// The state in a file per tensor (--storage files) keeps the volume's promises: an earlier
// run's objects are refused without --resume or --force, a resumed run continues at the
// reference's losses, and a volume file is not taken for a store directory.
TEST(Train, AFilePerTensorStateResumesAndIsNeverOverwrittenWithoutForce) {
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.file_per_tensor = true;
  o.steps = 3;
  const Data d = MakeData(256);
  ASSERT_OK(Train(o, d.tokens, d.tok).status());
  EXPECT_THAT(Train(o, d.tokens, d.tok), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                  AllOf(HasSubstr("--resume"), HasSubstr("--force"),
                                                        HasSubstr("training checkpoint"))));
  o.resume = true;
  o.steps = 6;
  ASSERT_OK_AND_ASSIGN(TrainSummary resumed, Train(o, d.tokens, d.tok));
  EXPECT_EQ(resumed.first_step, 4u);
  o.resume = false;
  o.mode = Mode::kReference;
  ASSERT_OK_AND_ASSIGN(TrainSummary whole, Train(o, d.tokens, d.tok));
  EXPECT_EQ(resumed.losses, std::vector<double>(whole.losses.begin() + 3, whole.losses.end()));
  o.mode = Mode::kOffload;
  o.force = true;
  ASSERT_OK_AND_ASSIGN(TrainSummary fresh, Train(o, d.tokens, d.tok));
  EXPECT_EQ(fresh.first_step, 1u);

  ScratchPath volume("train");
  TrainOptions v = Tiny(volume.path());
  v.steps = 1;
  ASSERT_OK(Train(v, d.tokens, d.tok).status());
  v.file_per_tensor = true;
  v.force = true;  // not even --force makes a volume file a store directory
  EXPECT_THAT(Train(v, d.tokens, d.tok),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a directory")));
}

// A loss that is not finite, with no loss scaler to skip the step (bf16 at scale 1),
// stops the run with a clear error; the last committed step stays resumable.
TEST(Train, ADivergedRunStopsWithItsLastCommittedStepIntact) {
  ScratchPath path("train");
  TrainOptions o = Tiny(path.path());
  o.dtype = memascend::DType::kBF16;
  o.initial_loss_scale = 1.0f;
  o.lr = 1e30f;
  o.warmup = 0;
  o.clip = 0;
  o.steps = 20;
  const Data d = MakeData(256);
  auto run = Train(o, d.tokens, d.tok);
  ASSERT_THAT(run, StatusIs(absl::StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("diverged"), HasSubstr("step 1 is the last committed"),
                                  HasSubstr("--resume"))));
  // Step 1 (finite loss; its update made the weights huge) is on the volume, resumable.
  o.resume = true;
  o.steps = 1;
  ASSERT_OK_AND_ASSIGN(TrainSummary resumed, Train(o, d.tokens, d.tok));
  EXPECT_EQ(resumed.first_step, 2u);
}

// Bad numbers are refused up front, whoever calls Train (the CLI parses strictly too).
TEST(Train, NonFiniteOrOutOfRangeSettingsAreRefused) {
  ScratchPath path("train");
  const Data d = MakeData(256);
  for (auto bad : std::vector<std::function<void(TrainOptions&)>>{
           [](TrainOptions& o) { o.lr = INFINITY; }, [](TrainOptions& o) { o.clip = NAN; },
           [](TrainOptions& o) { o.weight_decay = -1; },
           [](TrainOptions& o) { o.initial_loss_scale = 0.5f; },
           [](TrainOptions& o) { o.threads = 100000; }, [](TrainOptions& o) { o.io_threads = 0; },
           [](TrainOptions& o) { o.model.seq = std::size_t{1} << 30; }}) {
    TrainOptions o = Tiny(path.path());
    bad(o);
    EXPECT_FALSE(Train(o, d.tokens, d.tok).ok());
  }
  struct stat st {};
  EXPECT_NE(::stat(path.path().c_str(), &st), 0) << "a refused run wrote its volume";
}

// A budget the process may not page-lock is refused up front, naming RLIMIT_MEMLOCK (in a
// child without root, whose memlock limit is lowered).
TEST(Train, ABudgetBeyondTheMemlockLimitIsRefusedUpFront) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to drop to another user in a child";
  const Data d = MakeData(256);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit lim {
      64 * 1024, 64 * 1024
    };
    if (::setrlimit(RLIMIT_MEMLOCK, &lim) != 0 || ::setresgid(65534, 65534, 65534) != 0 ||
        ::setresuid(65534, 65534, 65534) != 0)
      _exit(3);
    TrainOptions o = Tiny("/tmp/memascend_memlock_refused.vol");
    o.threads = 1;
    auto run = Train(o, d.tokens, d.tok);
    const bool refused =
        run.status().code() == absl::StatusCode::kResourceExhausted &&
        std::string(run.status().message()).find("RLIMIT_MEMLOCK") != std::string::npos;
    _exit(refused ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "could not drop privileges here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the budget was not refused with RLIMIT_MEMLOCK named";
  ::unlink("/tmp/memascend_memlock_refused.vol");
}

// A disk that starts failing at a random request: every write EIO, every write ENOSPC,
// every read short (the engine completes short transfers), or every flush EIO (`after`
// then counts flushes). The run stops with the error (or, for short reads, trains on); the
// volume is fsck-clean; --resume without the fault reaches the uninterrupted run's losses.
class DyingDisk final : public memascend::FaultInjector {
 public:
  enum class Kind { kWriteEio, kWriteEnospc, kShortReads, kFlushEio };
  DyingDisk(Kind kind, std::uint64_t after) : kind_(kind), after_(after) {}
  std::int64_t Adjust(const memascend::IoRequest& a, std::int64_t result) override {
    if (kind_ == Kind::kFlushEio || seen_.fetch_add(1) < after_ || result <= 0) return result;
    switch (kind_) {
      case Kind::kWriteEio:
        return a.op == memascend::IoOp::kWrite ? -EIO : result;
      case Kind::kWriteEnospc:
        return a.op == memascend::IoOp::kWrite ? -ENOSPC : result;
      case Kind::kShortReads:
        return a.op == memascend::IoOp::kRead && result > 4096 ? 4096 : result;
      case Kind::kFlushEio:
        break;
    }
    return result;
  }
  int AdjustFlush(int, memascend::FlushKind, int result) override {
    if (kind_ != Kind::kFlushEio || seen_.fetch_add(1) < after_ || result != 0) return result;
    return -EIO;
  }

 private:
  Kind kind_;
  std::uint64_t after_;
  std::atomic<std::uint64_t> seen_{0};
};

// Reads fail with EIO once armed and `after` more reads have been served.
class FailingReads final : public memascend::FaultInjector {
 public:
  std::int64_t Adjust(const memascend::IoRequest& a, std::int64_t result) override {
    if (!armed || a.op != memascend::IoOp::kRead || result <= 0) return result;
    return reads.fetch_add(1) < after ? result : -EIO;
  }
  std::atomic<bool> armed{false};
  std::atomic<std::uint64_t> reads{0};
  std::uint64_t after = UINT64_MAX;
};

// Note [tied head]: a read of the master weights that fails while evaluating (the
// embedding's rows, a block's group, the head's rows, read a range at a time) is the
// run's error, never a loss computed over bytes not read.
TEST(Train, AFailedReadWhileEvaluatingIsTheRunsError) {
  const Data d = MakeData(256);
  const auto run = [&](std::uint64_t after, std::uint64_t* reads) -> absl::StatusOr<TrainSummary> {
    ScratchPath path("train_eval_fault");
    TrainOptions o = Tiny(path.path());
    HfConfig hf = TinyTiedLlama();  // larger: 6 blocks of 4 MiB of state, beyond the budget
    hf.hidden = 128;
    hf.head_dim = 32;
    hf.intermediate = 512;
    hf.layers = 6;
    o.model = ForHf(hf, 4, 16);
    o.host_budget = MinimumHostBudget(o.model, o.dtype);  // read from the volume
    o.steps = 2;
    o.overlap_optimizer = false;  // each update inside its step: after the last, only reads
    o.tied_chunk_bytes = 16 * 32 * 4;
    o.eval_tokens = std::make_shared<const std::vector<std::int32_t>>(
        d.tokens.begin(), d.tokens.begin() + 4 * 17 * 3);
    auto faults = std::make_shared<FailingReads>();
    faults->after = after;
    o.fault_injector = faults;
    o.on_step = [&](const StepReport& r) {
      if (r.step == o.steps) faults->armed = true;
    };
    absl::StatusOr<TrainSummary> r = Train(o, d.tokens, d.tok);
    *reads = faults->reads.load();
    return r;
  };
  std::uint64_t reads = 0;
  ASSERT_OK(run(UINT64_MAX, &reads).status());
  ASSERT_GT(reads, 3u) << "the evaluation read nothing from the volume";
  for (std::uint64_t after = 0; after < reads; after += std::max<std::uint64_t>(1, reads / 3)) {
    std::uint64_t seen = 0;
    const absl::StatusOr<TrainSummary> r = run(after, &seen);
    ASSERT_FALSE(r.ok()) << "a read failed after " << after << " of " << reads;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("Input/output error")) << after;
  }
}

TEST(Train, AFailingDiskStopsTheRunCleanlyAndResumeReachesTheSameLosses) {
  const Data d = MakeData(256);
  TrainOptions ref = Tiny("");
  ref.mode = Mode::kReference;
  ref.steps = 12;
  ASSERT_OK_AND_ASSIGN(TrainSummary whole, Train(ref, d.tokens, d.tok));
  std::mt19937 rng(3);
  int resumed_runs = 0;
  int resumed_after_a_flush = 0;
  for (auto kind : {DyingDisk::Kind::kWriteEio, DyingDisk::Kind::kWriteEnospc,
                    DyingDisk::Kind::kShortReads, DyingDisk::Kind::kFlushEio}) {
    for (int round = 0; round < 2; ++round) {
      ScratchPath path("train");
      TrainOptions o = Tiny(path.path());
      o.steps = 12;
      const std::uint64_t after =
          kind == DyingDisk::Kind::kFlushEio ? 2 + rng() % 24 : 50 + rng() % 400;
      o.fault_injector = std::make_shared<DyingDisk>(kind, after);
      auto run = Train(o, d.tokens, d.tok);
      if (kind != DyingDisk::Kind::kShortReads) {
        ASSERT_FALSE(run.ok()) << "a run on a disk failing every write succeeded";
        EXPECT_THAT(std::string(run.status().message()),
                    AnyOf(HasSubstr("Input/output error"), HasSubstr("No space left")));
      } else {
        ASSERT_OK(run.status());
      }
      {
        ASSERT_OK_AND_ASSIGN(auto volume, memascend::Volume::Open(path.path(), {}));
        ASSERT_OK_AND_ASSIGN(memascend::FsckReport r, volume->Fsck(true));
        EXPECT_TRUE(r.clean) << (r.errors.empty() ? "" : r.errors[0]);
      }
      o.fault_injector = nullptr;
      o.resume = true;
      auto resumed = Train(o, d.tokens, d.tok);
      if (!resumed.ok()) {
        // The disk failed before the initial state was committed: nothing to resume.
        ASSERT_THAT(resumed, StatusIs(absl::StatusCode::kNotFound));
        continue;
      }
      ++resumed_runs;
      if (kind == DyingDisk::Kind::kFlushEio) ++resumed_after_a_flush;
      for (std::size_t i = 0; i < resumed->losses.size(); ++i) {
        EXPECT_EQ(resumed->losses[i], whole.losses[resumed->first_step - 1 + i])
            << "kind " << static_cast<int>(kind) << " step " << resumed->first_step + i;
      }
    }
  }
  EXPECT_GE(resumed_runs, 5) << "too few runs had committed a step before the fault";
  EXPECT_GE(resumed_after_a_flush, 1) << "no failed flush came after a committed step";
}

// SIGKILL at random moments of a run (a forked child), then --resume: the resumed
// steps' losses equal those of a run never interrupted.
TEST(Train, ResumeAfterSigkillReachesTheSameLosses) {
  const Data d = MakeData(256);
  TrainOptions base = Tiny("");
  base.mode = Mode::kReference;
  ASSERT_OK_AND_ASSIGN(TrainSummary whole, Train(base, d.tokens, d.tok));
  std::mt19937 rng(5);
  int resumed_mid_run = 0;
  for (int round = 0; round < 4; ++round) {
    ScratchPath path("train");
    TrainOptions o = Tiny(path.path());
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const std::size_t kill_after = 3 + rng() % 12;  // steps seen before the kill
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      o.on_step = [fd = fds[1]](const StepReport& r) {
        const char c = static_cast<char>('0' + r.step % 10);
        (void)!::write(fd, &c, 1);
      };
      auto s = Train(o, d.tokens, d.tok);
      if (!s.ok()) std::fprintf(stderr, "child: %s\n", std::string(s.status().message()).c_str());
      ::_exit(s.ok() ? 0 : 3);
    }
    ::close(fds[1]);
    std::size_t seen = 0;
    char c;
    while (seen < kill_after && ::read(fds[0], &c, 1) == 1) ++seen;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 4000));  // mid-step
    bool killed = false;
    int code = 0;
    memascend::testing::KillAndCollect(pid, fds[0], std::chrono::milliseconds(0), &killed, &code);
    ASSERT_TRUE(killed) << "the child finished by itself (exit " << code << ")";

    o.resume = true;
    ASSERT_OK_AND_ASSIGN(TrainSummary rest, Train(o, d.tokens, d.tok));
    EXPECT_GE(rest.first_step, seen + 1);  // every step it reported was committed
    EXPECT_LE(rest.first_step, seen + 3);
    ASSERT_EQ(rest.last_step, 24u);
    for (std::size_t s = rest.first_step; s <= 24; ++s)
      EXPECT_EQ(rest.losses[s - rest.first_step], whole.losses[s - 1])
          << "round " << round << " step " << s;
    if (rest.first_step > 1) ++resumed_mid_run;
  }
  EXPECT_EQ(resumed_mid_run, 4);
}

// ---- Note [data parallel]: ranks as threads (thread_comm.h), each with its own volume

using Result = absl::StatusOr<TrainSummary>;

// `world` ranks of `o` (its volume_path holding {rank}) on threads.
std::vector<Result> TrainRanks(int world, const TrainOptions& o, const Data& d,
                               const std::function<void(int, TrainOptions*)>& per_rank = {}) {
  return testing::RunRanks<Result>(
      world,
      [&](int rank, Communicator* comm) {
        TrainOptions mine = o;
        mine.comm = comm;
        if (per_rank) per_rank(rank, &mine);
        return Train(mine, d.tokens, d.tok);
      },
      [](const Result& r) { return r.ok(); });
}

TEST(DataParallel, RanksTrainAsOneProcessOfTheGlobalBatch) {
  const Data d = MakeData(256);
  ScratchPath one("train");
  TrainOptions o = Tiny(one.path());
  o.steps = 8;
  ASSERT_OK_AND_ASSIGN(TrainSummary alone, Train(o, d.tokens, d.tok));
  std::vector<double> two_ranks;
  for (int world : {2, 2, 4}) {
    ScratchPath dir("train_dp");
    ASSERT_EQ(::mkdir(dir.path().c_str(), 0755), 0);
    o.volume_path = dir.path() + "/rank{rank}.vol";
    const std::vector<Result> runs = TrainRanks(world, o, d);
    std::uint64_t elements = 0;
    for (int r = 0; r < world; ++r) {
      const Result& run = runs[static_cast<std::size_t>(r)];
      ASSERT_OK(run.status()) << "rank " << r;
      EXPECT_EQ(run->world, world);
      EXPECT_EQ(run->losses, runs[0]->losses) << "every rank reports the mean loss";
      EXPECT_LE(run->peak_pinned_bytes, run->host_budget);
      EXPECT_GT(run->step_comm_bytes.size(), 0u);
      struct stat st {};
      EXPECT_EQ(::stat(fmt::format("{}/rank{}.vol", dir.path(), r).c_str(), &st), 0)
          << "a volume per rank";
    }
    const TrainSummary& root = *runs[0];
    ASSERT_EQ(root.ranks.size(), static_cast<std::size_t>(world));
    for (const TrainSummary::Rank& r : root.ranks) {
      EXPECT_GT(r.state_elements, 0u);
      EXPECT_GT(r.comm_bytes_per_step, 0);
      elements += r.state_elements;
    }
    EXPECT_EQ(elements, root.params) << "the shards cover the state once";
    ASSERT_EQ(root.losses.size(), alone.losses.size());
    // The batch's rows are summed in another order: float rounding, no more.
    for (std::size_t i = 0; i < alone.losses.size(); ++i)
      EXPECT_NEAR(root.losses[i], alone.losses[i], 1e-5 * alone.losses[i]) << world << " " << i;
    if (world == 2 && two_ranks.empty()) {
      two_ranks = root.losses;
    } else if (world == 2) {
      EXPECT_EQ(root.losses, two_ranks) << "a rank count's losses repeat exactly";
    }
  }
  // The update not overlapped (each forward pass gathers loaded parameters), activations
  // checkpointed through each rank's store: the same bits.
  {
    ScratchPath dir("train_dp");
    ASSERT_EQ(::mkdir(dir.path().c_str(), 0755), 0);
    TrainOptions other = o;
    other.volume_path = dir.path() + "/rank{rank}.vol";
    other.overlap_optimizer = false;
    other.checkpoint_activations = true;
    const std::vector<Result> runs = TrainRanks(2, other, d);
    ASSERT_OK(runs[0].status());
    EXPECT_EQ(runs[0]->losses, two_ranks);
  }
  // In ordinary memory, the same operations: the offloaded ranks' bits.
  o.mode = Mode::kReference;
  const std::vector<Result> reference = TrainRanks(2, o, d);
  ASSERT_OK(reference[0].status());
  EXPECT_EQ(reference[0]->losses, two_ranks);
}

// Note [tied head]: one process evaluates and exports reading the tied embeddings' master
// weights a range at a time from its state; data-parallel ranks gather each group whole.
// The two give the same evaluation and the same exported tensors, to the rounding of the
// ranks' summation order (their training differs by no more).
TEST(DataParallel, RanksEvaluateAndExportAsOneProcessReadingRanges) {
  const Data d = MakeData(256);
  ScratchPath path("train_dp_eval");
  ASSERT_EQ(::mkdir(path.path().c_str(), 0755), 0);
  TrainOptions o = Tiny(path.path() + "/alone.vol");
  o.model = ForHf(TinyTiedLlama(), 4, 16);
  o.host_budget = MinimumHostBudget(o.model, o.dtype);
  o.steps = 4;
  o.tied_chunk_bytes = 5 * 32 * 4;         // 52 chunks of 5 rows (the last of 1)
  o.export_options.piece_elements = 1000;  // the embeddings in 9 pieces
  o.eval_tokens = std::make_shared<const std::vector<std::int32_t>>(d.tokens.begin(),
                                                                    d.tokens.begin() + 4 * 17 * 3);
  o.export_dir = path.path() + "/alone";
  ASSERT_OK_AND_ASSIGN(TrainSummary alone, Train(o, d.tokens, d.tok));
  o.volume_path = path.path() + "/rank{rank}.vol";
  o.export_dir = path.path() + "/ranks";
  const std::vector<Result> runs = TrainRanks(2, o, d);
  for (const Result& r : runs) ASSERT_OK(r.status());
  ASSERT_TRUE(alone.eval_loss.has_value() && runs[0]->eval_loss.has_value());
  EXPECT_NEAR(*runs[0]->eval_loss, *alone.eval_loss, 1e-5 * *alone.eval_loss);
  EXPECT_EQ(runs[0]->export_bytes, alone.export_bytes);
  ASSERT_OK_AND_ASSIGN(auto a, memascend::SafetensorsCheckpoint::Open(path.path() + "/alone"));
  ASSERT_OK_AND_ASSIGN(auto b, memascend::SafetensorsCheckpoint::Open(path.path() + "/ranks"));
  ASSERT_EQ(a->names(), b->names());
  for (const std::string& name : a->names()) {
    ASSERT_OK_AND_ASSIGN(auto x, a->Find(name));
    ASSERT_OK_AND_ASSIGN(auto y, b->Find(name));
    const std::size_t n = x.tensor->elements();
    ASSERT_EQ(n, y.tensor->elements()) << name;
    std::vector<float> u(n), v(n);
    ASSERT_OK(x.file->Read(*x.tensor, 0, {u.data(), n, memascend::DType::kF32}));
    ASSERT_OK(y.file->Read(*y.tensor, 0, {v.data(), n, memascend::DType::kF32}));
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_NEAR(u[i], v[i], 1e-5f + 1e-4f * std::abs(u[i])) << name << " " << i;
  }
}

// A failing disk under one rank stops every rank (the others with "another rank
// stopped"); --resume on every rank continues from the newest step all of them hold, to
// the uninterrupted run's losses.
TEST(DataParallel, AFailingRankStopsEveryRankAndResumeContinuesFromTheStepAllHold) {
  const Data d = MakeData(256);
  TrainOptions o = Tiny("");
  o.steps = 10;
  std::vector<double> whole;
  {
    ScratchPath dir("train_dp");
    ASSERT_EQ(::mkdir(dir.path().c_str(), 0755), 0);
    o.volume_path = dir.path() + "/rank{rank}.vol";
    const std::vector<Result> runs = TrainRanks(2, o, d);
    ASSERT_OK(runs[0].status());
    whole = runs[0]->losses;
  }
  std::mt19937 rng(5);
  int resumed_runs = 0, faulted = 0;
  for (int round = 0; round < 8; ++round) {
    ScratchPath dir("train_dp");
    ASSERT_EQ(::mkdir(dir.path().c_str(), 0755), 0);
    o.volume_path = dir.path() + "/rank{rank}.vol";
    const int failing = round % 2;
    const std::uint64_t after = 20 + rng() % 200;
    const std::vector<Result> runs = TrainRanks(2, o, d, [&](int rank, TrainOptions* mine) {
      if (rank == failing)
        mine->fault_injector = std::make_shared<DyingDisk>(DyingDisk::Kind::kWriteEio, after);
    });
    if (runs[static_cast<std::size_t>(failing)].ok()) continue;  // its disk outlived the run
    ++faulted;
    EXPECT_THAT(std::string(runs[static_cast<std::size_t>(failing)].status().message()),
                HasSubstr("Input/output error"));
    EXPECT_THAT(runs[static_cast<std::size_t>(1 - failing)],
                StatusIs(absl::StatusCode::kAborted, HasSubstr("another rank stopped")));
    TrainOptions again = o;
    again.resume = true;
    const std::vector<Result> resumed = TrainRanks(2, again, d);
    if (!resumed[0].ok()) {
      // A rank failed before its initial state was committed: nothing to resume.
      EXPECT_THAT(resumed[static_cast<std::size_t>(failing)],
                  StatusIs(absl::StatusCode::kNotFound));
      continue;
    }
    ++resumed_runs;
    ASSERT_OK(resumed[1].status());
    EXPECT_EQ(resumed[0]->first_step, resumed[1]->first_step);
    for (std::size_t i = 0; i < resumed[0]->losses.size(); ++i) {
      EXPECT_EQ(resumed[0]->losses[i], whole[resumed[0]->first_step - 1 + i])
          << "round " << round << " step " << resumed[0]->first_step + i;
    }
  }
  EXPECT_GE(faulted, 6) << "too few disks failed within the run";
  EXPECT_GE(resumed_runs, 5) << "too few runs had committed a step before the fault";
}

TEST(DataParallel, WhatCannotBeSharedIsRefusedOnEveryRank) {
  const Data d = MakeData(256);
  ScratchPath dir("train_dp");
  ASSERT_EQ(::mkdir(dir.path().c_str(), 0755), 0);
  TrainOptions o = Tiny(dir.path() + "/rank{rank}.vol");
  o.steps = 2;
  const auto refused = [&](const TrainOptions& opts, int world, absl::StatusCode code,
                           const std::string& why) {
    for (const Result& r : TrainRanks(world, opts, d))
      EXPECT_THAT(r, StatusIs(code, HasSubstr(why)));
  };
  TrainOptions odd = o;
  odd.model.batch = 3;
  refused(odd, 2, absl::StatusCode::kInvalidArgument, "does not divide among 2 ranks");
  TrainOptions shared = o;
  shared.volume_path = dir.path() + "/one.vol";
  refused(shared, 2, absl::StatusCode::kInvalidArgument, "put {rank} in the path");
  TrainOptions zero = o;
  zero.policy = Policy::kZeroInfinity;
  refused(zero, 2, absl::StatusCode::kUnimplemented, "not data-parallel");
  // Tiny's 4 groups are a part each: 5 ranks would leave one without.
  TrainOptions many = o;
  many.model.batch = 5;
  refused(many, 5, absl::StatusCode::kInvalidArgument, "lower --optimizer-chunk");
  // A rank's volume belongs to its rank of a run of as many ranks: a run of 4 is not
  // resumed by 2, and is left alone.
  {
    TrainOptions four = o;
    four.model.batch = 4;
    for (const Result& r : TrainRanks(4, four, d)) ASSERT_OK(r.status());
    TrainOptions again = four;
    again.resume = true;
    for (const Result& r : TrainRanks(2, again, d))
      EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                              HasSubstr("ranks: 4 on the volume, 2 in this run")));
    again.steps = 3;
    for (const Result& r : TrainRanks(4, again, d)) {
      ASSERT_OK(r.status());
      EXPECT_EQ(r->first_step, 3u);
    }
  }
}

}  // namespace
}  // namespace offload_train
