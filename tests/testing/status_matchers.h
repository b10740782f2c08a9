// tests/testing/status_matchers.h: gtest helpers for absl::Status and StatusOr.
//
//   EXPECT_OK(volume.Flush());
//   ASSERT_OK_AND_ASSIGN(auto block, pool.Allocate(4096));
//   EXPECT_THAT(pool.Allocate(1ull << 50), StatusIs(absl::StatusCode::kResourceExhausted));
//   EXPECT_THAT(Open(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
#ifndef MEMASCEND_TESTS_TESTING_STATUS_MATCHERS_H_
#define MEMASCEND_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>
#include <utility>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/status.h>

namespace memascend::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Matches a Status or StatusOr whose code is `code` and whose message matches
// `message_matcher` (anything by default).
MATCHER_P2(StatusIsImpl, code, message_matcher,
           std::string("has status code ") + absl::StatusCodeToString(code)) {
  const absl::Status& status = ::memascend::testing::GetStatus(arg);
  if (status.code() != code) {
    *result_listener << "whose status is " << status;
    return false;
  }
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

inline auto StatusIs(absl::StatusCode code) { return StatusIsImpl(code, ::testing::_); }
template <typename M>
auto StatusIs(absl::StatusCode code, M message_matcher) {
  return StatusIsImpl(code, ::testing::MatcherCast<std::string>(message_matcher));
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = ::memascend::testing::GetStatus(arg);
  if (!status.ok()) *result_listener << "whose status is " << status;
  return status.ok();
}

}  // namespace memascend::testing

#define EXPECT_OK(expr) EXPECT_THAT((expr), ::memascend::testing::IsOk())
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::memascend::testing::IsOk())

#define ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                                        \
  ASSERT_OK_AND_ASSIGN_IMPL_(MEMASCEND_STATUS_CONCAT_(memascend_test_statusor_, __LINE__), lhs, \
                             rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr)         \
  auto statusor = (rexpr);                                       \
  ASSERT_TRUE(statusor.ok()) << "status: " << statusor.status(); \
  lhs = std::move(statusor).value()

#endif  // MEMASCEND_TESTS_TESTING_STATUS_MATCHERS_H_
