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
  // Any bytes give valid JSON: UTF-8 passes through, other bytes become escapes.
  EXPECT_EQ(JsonQuote("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  EXPECT_EQ(JsonQuote("a\xff\xc3"), R"("a\u00ff\u00c3")");  // stray and cut off
  EXPECT_EQ(JsonQuote("\xc0\xaf\xed\xa0\x80"),
            R"("\u00c0\u00af\u00ed\u00a0\u0080")");  // overlong, surrogate
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
