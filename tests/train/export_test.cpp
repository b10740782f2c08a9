// The Hugging Face export is atomic (Note [atomic export] in checkpoint_io.h): a failure
// half-way leaves the directory as it was; a new export with another shard count leaves no
// shard of the old one behind; what else the directory holds (a tokenizer, a folder) stays;
// the staging an interrupted export left is cleared, or refused when it holds what may be
// the user's.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint_io.h"
#include "hf_config.h"
#include "model.h"
#include "testing/status_matchers.h"

namespace offload_train {
namespace {

namespace fs = std::filesystem;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
  "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "tie_word_embeddings": false, "torch_dtype": "float32", "max_position_embeddings": 64})";

// GPT-2's layout: its Conv1D weights are kept transposed in the file.
constexpr const char* kTinyGpt2 = R"({
  "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4,
  "n_layer": 2, "n_positions": 64, "vocab_size": 256, "layer_norm_epsilon": 1e-05,
  "activation_function": "gelu_new"})";

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("export_test_" +
             std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    Use(kTinyLlama);
  }
  // The model of `config`, each group's elements distinct (a misplaced one shows).
  void Use(const char* config) {
    ASSERT_OK_AND_ASSIGN(HfConfig hf, ParseHfConfig(config, "config.json"));
    model_ = ForHf(hf, 1, 8);
    groups_.clear();
    for (std::size_t g = 0; g < GroupCount(model_); ++g) {
      groups_.emplace_back(GroupParams(model_, g));
      for (std::size_t i = 0; i < groups_[g].size(); ++i)
        groups_[g][i] = static_cast<float>(g + 1) + static_cast<float>(i) * 1e-4f;
    }
  }
  void TearDown() override { fs::remove_all(root_); }

  // An export whose group `fail_at` cannot be read (SIZE_MAX: none fails).
  absl::Status Export(const fs::path& dir, std::uint64_t shard_bytes, bool overwrite,
                      std::size_t fail_at = SIZE_MAX, float offset = 0) {
    HfExportOptions o;
    o.shard_bytes = shard_bytes;
    o.overwrite = overwrite;
    for (std::vector<float>& group : groups_)
      for (float& x : group) x += offset;
    return ExportHfModel(model_, dir.string(), o,
                         [&](std::size_t g, std::size_t first, std::size_t count, float* out) {
                           if (g == fail_at)
                             return absl::DataLossError("injected: group unreadable");
                           std::copy_n(groups_[g].data() + first, count, out);
                           return absl::OkStatus();
                         });
  }
  static std::set<std::string> Names(const fs::path& dir) {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
    return out;
  }
  static std::string Read(const fs::path& p) {
    std::string out;
    std::FILE* f = std::fopen(p.c_str(), "rb");
    if (f == nullptr) return out;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
    std::fclose(f);
    return out;
  }
  static void Write(const fs::path& p, const std::string& s) { std::ofstream(p) << s; }
  // Every file's bytes, by name.
  static std::vector<std::pair<std::string, std::string>> Snapshot(const fs::path& dir) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const std::string& n : Names(dir)) {
      if (fs::is_regular_file(dir / n)) out.emplace_back(n, Read(dir / n));
    }
    return out;
  }
  // What is left beside the target (staging directories): nothing but the target.
  std::set<std::string> Beside() const { return Names(root_); }

  fs::path root_;
  ModelConfig model_;
  std::vector<std::vector<float>> groups_;
};

TEST_F(ExportTest, TensorsReadAPieceAtATimeWriteTheSameFiles) {
  // The reader is asked for each tensor's elements in order, each once, in pieces of at
  // most piece_elements (GPT-2's transposed Conv1D weights whole); the files are those of
  // an export read a tensor at a time, and import back (checkpoint_io's own reader) to
  // every group's elements.
  for (const char* config : {kTinyLlama, kTinyGpt2}) {
    Use(config);
    const std::string arch = model_.hf->arch == Arch::kGpt2 ? "gpt2" : "llama";
    const fs::path whole = root_ / ("whole-" + arch), pieces = root_ / ("pieces-" + arch);
    ASSERT_OK(Export(whole, 20000, false));
    HfExportOptions o;
    o.shard_bytes = 20000;
    o.piece_elements = 7;
    std::vector<std::size_t> next(groups_.size(), 0);  // each group's next element
    std::size_t asked = 0, last_group = 0, transposed = 0;
    ASSERT_OK(ExportHfModel(model_, pieces.string(), o,
                            [&](std::size_t g, std::size_t first, std::size_t count, float* out) {
                              EXPECT_GE(g, last_group);  // the groups in order
                              EXPECT_EQ(first, next[g]);
                              transposed += count > 7;
                              last_group = g;
                              next[g] = first + count;
                              ++asked;
                              std::copy_n(groups_[g].data() + first, count, out);
                              return absl::OkStatus();
                            }));
    for (std::size_t g = 0; g < groups_.size(); ++g) EXPECT_EQ(next[g], groups_[g].size()) << g;
    EXPECT_GT(asked, groups_.size() * 7);
    EXPECT_EQ(transposed > 0, arch == "gpt2") << "only GPT-2's Conv1D weights are read whole";
    EXPECT_EQ(Snapshot(pieces), Snapshot(whole)) << arch;
    ASSERT_OK_AND_ASSIGN(auto ckpt, memascend::SafetensorsCheckpoint::Open(pieces.string()));
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      std::vector<float> back(groups_[g].size());
      ASSERT_OK(
          ImportHfGroup(*ckpt, model_, g, {back.data(), back.size(), memascend::DType::kF32}));
      EXPECT_EQ(back, groups_[g]) << arch << " group " << g;
    }
  }
  HfExportOptions o;
  o.piece_elements = 0;
  EXPECT_THAT(
      ExportHfModel(model_, (root_ / "none").string(), o,
                    [](std::size_t, std::size_t, std::size_t, float*) { return absl::OkStatus(); }),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("piece")));
}

TEST_F(ExportTest, AFailureHalfWayLeavesTheOldExportWhole) {
  const fs::path out = root_ / "out";
  ASSERT_OK(Export(out, 1 << 30, false));
  Write(out / "tokenizer.json", "{}\n");
  const auto before = Snapshot(out);
  // Sharded this time, failing at the third group: the old export stays, bit for bit.
  EXPECT_THAT(Export(out, 20000, true, 2), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(Snapshot(out), before);
  EXPECT_EQ(Beside(), std::set<std::string>{"out"});
}

TEST_F(ExportTest, ANewExportReplacesTheOldWholeAndKeepsWhatElseTheDirectoryHolds) {
  const fs::path out = root_ / "out";
  ASSERT_OK(Export(out, 20000, false));  // sharded, with an index
  const std::set<std::string> sharded = Names(out);
  ASSERT_TRUE(sharded.count("model.safetensors.index.json"));
  Write(out / "tokenizer.json", "{\"v\": 1}\n");
  fs::create_directories(out / "runs");
  Write(out / "runs" / "log.txt", "kept\n");
  ASSERT_OK(Export(out, 1 << 30, true, SIZE_MAX, 1.0f));  // one file now
  EXPECT_EQ(Names(out),
            (std::set<std::string>{"config.json", "model.safetensors", "runs", "tokenizer.json"}));
  EXPECT_EQ(Read(out / "tokenizer.json"), "{\"v\": 1}\n");
  EXPECT_EQ(Read(out / "runs" / "log.txt"), "kept\n");
  EXPECT_EQ(Beside(), std::set<std::string>{"out"});
  // And back to shards: no single file of the one before is left.
  ASSERT_OK(Export(out, 20000, true));
  EXPECT_EQ(Names(out).count("model.safetensors"), 0u);
  EXPECT_EQ(Names(out).count("model.safetensors.index.json"), 1u);
}

TEST_F(ExportTest, WithoutOverwriteAnExistingModelIsRefusedUntouched) {
  const fs::path out = root_ / "out";
  ASSERT_OK(Export(out, 1 << 30, false));
  const auto before = Snapshot(out);
  EXPECT_THAT(Export(out, 1 << 30, false),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("--export-overwrite")));
  EXPECT_EQ(Snapshot(out), before);
}

TEST_F(ExportTest, AnInterruptedExportsStagingIsClearedOrRefusedWhenItMayHoldTheUsers) {
  const fs::path out = root_ / "out";
  ASSERT_OK(Export(out, 1 << 30, false));
  Write(out / "README.md", "mine\n");
  // Killed after carrying the README over (a link) and writing part of the model.
  const fs::path stage = root_ / ".out.memascend-export";
  fs::create_directories(stage);
  Write(stage / "model-00001-of-00002.safetensors", "torn");
  fs::create_hard_link(out / "README.md", stage / "README.md");
  ASSERT_OK(Export(out, 1 << 30, true));
  EXPECT_EQ(Beside(), std::set<std::string>{"out"});
  EXPECT_EQ(Read(out / "README.md"), "mine\n");
  // Killed after moving a folder of the target in: never removed, named.
  fs::create_directories(stage / "notes");
  EXPECT_THAT(Export(out, 1 << 30, true),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("notes")));
  EXPECT_TRUE(fs::exists(stage / "notes"));
}

TEST_F(ExportTest, ThroughALinkTheLinkedDirectoryIsReplaced) {
  const fs::path real = root_ / "real";
  ASSERT_OK(Export(real, 1 << 30, false));
  fs::create_directory_symlink(real, root_ / "link");
  ASSERT_OK(Export(root_ / "link", 20000, true));
  EXPECT_TRUE(fs::is_symlink(root_ / "link"));
  EXPECT_EQ(Names(real).count("model.safetensors.index.json"), 1u);
  EXPECT_EQ(Beside(), (std::set<std::string>{"link", "real"}));
}

TEST_F(ExportTest, AFileInThePlaceOfTheDirectoryIsRefused) {
  Write(root_ / "file", "data\n");
  EXPECT_THAT(Export(root_ / "file", 1 << 30, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a directory")));
  EXPECT_EQ(Read(root_ / "file"), "data\n");
}

}  // namespace
}  // namespace offload_train
