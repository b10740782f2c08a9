#include "util/json_writer.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace memascend::util {
namespace {

TEST(JsonWriter, NestedContainersAndCommas) {
  JsonWriter w;
  w.BeginObject();
  w.Field("a", 1);
  w.Key("b").BeginArray().Int(-2).Bool(true).Null().BeginObject().EndObject().EndArray();
  w.Field("c", "x");
  w.Key("d").BeginArray().EndArray();
  w.EndObject();
  EXPECT_EQ(w.str(), R"({"a":1,"b":[-2,true,null,{}],"c":"x","d":[]})");
}

TEST(JsonWriter, EscapesStrings) {
  EXPECT_EQ(JsonQuote("a\"b\\c\n\t\x01"), R"("a\"b\\c\n\t\u0001")");
  EXPECT_EQ(JsonQuote("gpt2-xl.tsv"), R"("gpt2-xl.tsv")");
}

TEST(JsonWriter, NumbersRoundTripAndNonFiniteIsNull) {
  JsonWriter w;
  w.BeginArray()
      .Uint(std::numeric_limits<std::uint64_t>::max())
      .Int(std::numeric_limits<std::int64_t>::min())
      .Double(0.1)
      .Double(1.5e300)
      .Double(std::nan(""))
      .Double(std::numeric_limits<double>::infinity())
      .EndArray();
  EXPECT_EQ(w.str(), "[18446744073709551615,-9223372036854775808,0.1,1.5e+300,null,null]");
}

}  // namespace
}  // namespace memascend::util
