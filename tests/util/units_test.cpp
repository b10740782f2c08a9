#include "util/units.h"

#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace memascend::util {
namespace {

using ::memascend::testing::StatusIs;

TEST(ParseByteSize, AcceptsBinarySuffixes) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("4K"), 4096u);
  EXPECT_EQ(*ParseByteSize("4k"), 4096u);
  EXPECT_EQ(*ParseByteSize("4KiB"), 4096u);
  EXPECT_EQ(*ParseByteSize("64MiB"), 64ull << 20);
  EXPECT_EQ(*ParseByteSize("1G"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("2TB"), 2ull << 40);
  EXPECT_EQ(*ParseByteSize("12B"), 12u);
  EXPECT_EQ(*ParseByteSize(" 8M "), 8ull << 20);
}

TEST(ParseByteSize, RejectsGarbageAndOverflow) {
  for (const char* bad : {"", "K", "-1", "1.5G", "4X", "4KX", "4 GiBs", "0x10"}) {
    EXPECT_THAT(ParseByteSize(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  EXPECT_THAT(ParseByteSize("99999999999999999999"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseByteSize("16777216T"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(FormatBytes, PicksBinaryUnits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(4096), "4.00 KiB");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.50 GiB");
}

}  // namespace
}  // namespace memascend::util
