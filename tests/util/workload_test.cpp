#include <gtest/gtest.h>

#include <memascend/workload.h>

#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

constexpr const char* kTiny =
    "# tiny-model: 5 parameter tensors\n"
    "# name\tshape\n"
    "model.embed.weight\t100,8\n"
    "model.layers.0.w\t8,8\r\n"
    "\n"
    "model.layers.0.norm\t8\n"
    "model.layers.1.w\t8,8\n"
    "lm_head.weight\t100,8\n";

TEST(Workload, ParsesNamesShapesAndLayers) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "fallback"));
  EXPECT_EQ(w.name, "tiny-model");
  ASSERT_EQ(w.tensors.size(), 5u);
  EXPECT_EQ(w.tensors[0].name, "model.embed.weight");
  EXPECT_EQ(w.tensors[0].shape, (std::vector<std::uint64_t>{100, 8}));
  EXPECT_EQ(w.tensors[0].numel, 800u);
  EXPECT_EQ(w.tensors[0].layer, -1);
  EXPECT_EQ(w.tensors[1].layer, 0);
  EXPECT_EQ(w.tensors[3].layer, 1);
  EXPECT_EQ(w.total_parameters, 800u + 64 + 8 + 64 + 800);
  EXPECT_EQ(w.largest_numel, 800u);
}

TEST(Workload, GroupsConsecutiveTensorsByLayer) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload(kTiny, "x"));
  const std::vector<TensorGroup> g = GroupByLayer(w);
  ASSERT_EQ(g.size(), 4u);
  EXPECT_EQ(g[0].layer, -1);
  EXPECT_EQ(g[1].tensors, (std::vector<std::size_t>{1, 2}));
  EXPECT_EQ(g[1].numel, 72u);
  EXPECT_EQ(g[2].layer, 1);
  EXPECT_EQ(g[3].tensors, (std::vector<std::size_t>{4}));
}

TEST(Workload, UsesTheFallbackNameWithoutAHeader) {
  ASSERT_OK_AND_ASSIGN(Workload w, ParseWorkload("a\t4\n", "mine"));
  EXPECT_EQ(w.name, "mine");
}

TEST(Workload, RejectsMalformedLines) {
  EXPECT_THAT(ParseWorkload("a 4\n", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1")));
  EXPECT_THAT(ParseWorkload("a\t4,x\n", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad dimension 'x'")));
  EXPECT_THAT(ParseWorkload("a\t4,0\n", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseWorkload("a\t4,,4\n", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseWorkload("\t4\n", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseWorkload("a\t4294967296,4294967296\n", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  EXPECT_THAT(ParseWorkload("# only comments\n", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tensors")));
}

TEST(Workload, LoadsTheShippedFiles) {
  ASSERT_OK_AND_ASSIGN(
      Workload w, LoadWorkload(std::string(MEMASCEND_TEST_DATA_DIR) + "/workloads/llama-2-7b.tsv"));
  EXPECT_EQ(w.name, "llama-2-7b");
  EXPECT_EQ(w.tensors.size(), 291u);
  EXPECT_EQ(w.total_parameters, 6738415616u);  // the published count
  EXPECT_EQ(GroupByLayer(w).size(), 34u);      // embedding, 32 layers, norm + head
  EXPECT_THAT(LoadWorkload("/nonexistent/model.tsv"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/model.tsv")));
}

}  // namespace
}  // namespace memascend
