// The strict JSON parser: what Hugging Face's files hold parses, and anything that is not
// one JSON document is refused with where and what.
#include "util/json_reader.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace memascend::util {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

TEST(JsonReader, ParsesAConfigAsHuggingFaceWritesIt) {
  ASSERT_OK_AND_ASSIGN(JsonValue v, ParseJson(R"({
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 2048, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 32.0, "rope_type": "llama3"},
  "tie_word_embeddings": true, "bos_token_id": null, "name": "caf\u00e9 \ud83d\ude00 \u00e9t\u00e9"
})"));
  EXPECT_EQ(*v.GetInt("hidden_size"), 2048);
  EXPECT_DOUBLE_EQ(*v.GetDouble("rms_norm_eps"), 1e-5);
  EXPECT_DOUBLE_EQ(*v.GetDouble("rope_theta"), 500000.0);
  EXPECT_TRUE(*v.GetBool("tie_word_embeddings"));
  EXPECT_TRUE(v.Find("bos_token_id")->is_null());
  EXPECT_EQ(*v.Find("rope_scaling")->GetString("rope_type"), "llama3");
  EXPECT_EQ(*v.Find("architectures")->items()[0].AsString(), "LlamaForCausalLM");
  EXPECT_EQ(*v.GetString("name"), "caf\xc3\xa9 \xf0\x9f\x98\x80 \xc3\xa9t\xc3\xa9");
  EXPECT_EQ(v.Find("missing"), nullptr);
  EXPECT_THAT(v.GetInt("missing"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  // A fraction is no integer, and an integer past int64 is refused, not wrapped.
  EXPECT_THAT(v.GetInt("rope_theta"), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(JsonValue big, ParseJson("[9223372036854775807, 9223372036854775808]"));
  EXPECT_EQ(*big.items()[0].AsInt(), INT64_MAX);
  EXPECT_THAT(big.items()[1].AsInt(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(v.GetString("hidden_size"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a number")));
}

TEST(JsonReader, RefusesWhatIsNotOneJsonDocument) {
  for (const char* bad : {"",
                          " ",
                          "{",
                          "{\"a\":1,}",
                          "[1,]",
                          "[1 2]",
                          "{\"a\" 1}",
                          "{1:2}",
                          "01",
                          "1.",
                          ".5",
                          "1e",
                          "-",
                          "+1",
                          "NaN",
                          "Infinity",
                          "tru",
                          "nul",
                          "\"abc",
                          "\"a\\x\"",
                          "\"\\ud800\"",
                          "\"\\udc00\"",
                          "\"tab\there\"",
                          "\"\xff\"",
                          "\"\xc0\xaf\"",
                          "\"\xed\xa0\x80\"",
                          "{} {}",
                          "[1] x",
                          "{\"a\":1,\"a\":2}",
                          "/* c */ 1"}) {
    EXPECT_THAT(ParseJson(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  EXPECT_THAT(ParseJson("{\"a\":1,\"a\":2}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
  EXPECT_THAT(ParseJson("[1, x]"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte 4")));
}

TEST(JsonReader, RefusesNestingDeepEnoughToExhaustTheStack) {
  EXPECT_OK(ParseJson(std::string(200, '[') + std::string(200, ']')).status());
  EXPECT_THAT(ParseJson(std::string(100000, '[') + std::string(100000, ']')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nesting")));
}

TEST(JsonReader, BoundsTheValuesADocumentMayHold) {
  // The document, its array and three items: five values.
  EXPECT_OK(ParseJson(R"({"a":[1,2,3]})", 5).status());
  EXPECT_THAT(ParseJson(R"({"a":[1,2,3]})", 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more values")));
  EXPECT_THAT(ParseJson(R"({"a":1,"b":2})", 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more values")));
  EXPECT_OK(
      ParseJson(std::string(100, '[') + std::string(100, ']')).status());  // unbounded by default
}

}  // namespace
}  // namespace memascend::util
