#include <memory>
#include <string>

#include <memascend/status.h>

#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

int g_calls = 0;

absl::Status Fail(absl::StatusCode code) {
  ++g_calls;
  return absl::Status(code, "boom");
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool ok) {
  ++g_calls;
  if (!ok) return absl::ResourceExhaustedError("pool full");
  return std::make_unique<int>(7);
}

absl::Status Chain(bool first_ok, bool second_ok, int* out) {
  MEMASCEND_RETURN_IF_ERROR(first_ok ? absl::OkStatus() : Fail(absl::StatusCode::kDataLoss));
  MEMASCEND_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeInt(second_ok));
  *out = *p;
  return absl::OkStatus();
}

absl::StatusOr<int> ChainOr(bool ok) {
  // RETURN_IF_ERROR on a StatusOr expression, from a function returning StatusOr.
  MEMASCEND_RETURN_IF_ERROR(MakeInt(ok));
  MEMASCEND_ASSIGN_OR_RETURN(auto p, MakeInt(ok));
  int value = 0;
  MEMASCEND_ASSIGN_OR_RETURN(value, absl::StatusOr<int>(*p + 1));  // existing variable
  return value;
}

TEST(StatusMacros, PropagatesFirstErrorAndEvaluatesOnce) {
  g_calls = 0;
  int out = 0;
  EXPECT_THAT(Chain(false, true, &out), StatusIs(absl::StatusCode::kDataLoss, "boom"));
  EXPECT_EQ(g_calls, 1);
  EXPECT_EQ(out, 0);

  g_calls = 0;
  EXPECT_THAT(Chain(true, false, &out),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("full")));
  EXPECT_EQ(g_calls, 1);
  EXPECT_EQ(out, 0);

  EXPECT_OK(Chain(true, true, &out));
  EXPECT_EQ(out, 7);
}

TEST(StatusMacros, WorkInsideStatusOrFunctions) {
  EXPECT_THAT(ChainOr(false), StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(int v, ChainOr(true));
  EXPECT_EQ(v, 8);
}

TEST(StatusMatchers, DescribeMismatch) {
  const absl::Status s = absl::InvalidArgumentError("size 3 is not aligned");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
  EXPECT_THAT(s, ::testing::Not(StatusIs(absl::StatusCode::kDataLoss)));
  EXPECT_THAT(s, ::testing::Not(StatusIs(absl::StatusCode::kInvalidArgument, "other")));
  EXPECT_THAT(s, ::testing::Not(::memascend::testing::IsOk()));
}

}  // namespace
}  // namespace memascend
