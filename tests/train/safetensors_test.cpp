// Safetensors files: a writer's file read back (in any dtype, range by range), the bytes
// of the format as its specification lays them out, and every structural fault refused
// with the file and the tensor named.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/safetensors.h>

#include "storage/volume_test_util.h"
#include "testing/status_matchers.h"

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

// The file's bytes; empty when it does not exist.
std::string Slurp(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}
void Spit(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}
// A file as the specification lays it out: the header's length, the header, the data.
std::string Raw(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>(header.size() >> (8 * i));
  return out + header + data;
}

TEST(Safetensors, WrittenTensorsReadBackInAnyDtypeRangeByRange) {
  ScratchPath path("st_roundtrip");
  std::vector<float> a(1000), b(6);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.001f * static_cast<float>(i) - 0.3f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) + 0.5f;
  {
    ASSERT_OK_AND_ASSIGN(
        auto w, SafetensorsWriter::Create(path.path(),
                                          {{"model.layers.0.mlp.up_proj.weight", "BF16", {10, 100}},
                                           {"lm_head.weight", "F32", {2, 3}}},
                                          {{"format", "pt"}}));
    // Appended in pieces that straddle the tensors, converted to each one's dtype.
    ASSERT_OK(w->Append({a.data(), 333, DType::kF32}));
    ASSERT_OK(w->Append({a.data() + 333, 667, DType::kF32}));
    EXPECT_THAT(w->Finish(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lm_head")));
    ASSERT_OK(w->Append({b.data(), 6, DType::kF32}));
    EXPECT_THAT(w->Append({b.data(), 1, DType::kF32}),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    ASSERT_OK(w->Finish());
  }
  ASSERT_OK_AND_ASSIGN(auto r, SafetensorsReader::Open(path.path()));
  EXPECT_EQ(r->metadata().at("format"), "pt");
  ASSERT_EQ(r->tensors().size(), 2u);
  const SafetensorsTensor* up = r->Find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->shape, (std::vector<std::uint64_t>{10, 100}));
  std::vector<float> back(1000);
  ASSERT_OK(r->Read(*up, 0, {back.data(), 400, DType::kF32}));
  ASSERT_OK(r->Read(*up, 400, {back.data() + 400, 600, DType::kF32}));
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(back[i], BFloat16ToFloat(FloatToBFloat16(a[i]))) << i;
  std::vector<std::uint16_t> raw(1000);
  ASSERT_OK(r->Read(*up, 0, {raw.data(), 1000, DType::kBF16}));
  EXPECT_EQ(raw[7], FloatToBFloat16(a[7]));
  std::vector<float> head(6);
  ASSERT_OK(r->Read(*r->Find("lm_head.weight"), 0, {head.data(), 6, DType::kF32}));
  EXPECT_EQ(head, b);
  EXPECT_THAT(r->Read(*up, 990, {back.data(), 11, DType::kF32}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("up_proj")));
  // The layout of the format: little-endian header length, the header padded to 8 bytes.
  const std::string bytes = Slurp(path.path());
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 2000 + 24);
  EXPECT_THAT(bytes.substr(8, n), HasSubstr("\"data_offsets\":[0,2000]"));
  EXPECT_THAT(bytes.substr(8, n), HasSubstr("\"data_offsets\":[2000,2024]"));
}

// A header of one tensor whose shape is `n` ones (n + 7 values), two bytes of text each.
std::string ManyOnes(std::size_t n) {
  std::string shape;
  shape.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) shape += i == 0 ? "1" : ",1";
  return R"({"w":{"dtype":"F32","shape":[)" + shape + R"(],"data_offsets":[0,4]}})";
}

TEST(Safetensors, AHandWrittenFileReads) {
  ScratchPath path("st_hand");
  float v[3] = {1.5f, -2.0f, 0.25f};
  std::string data(reinterpret_cast<const char*>(v), sizeof(v));
  Spit(path.path(), Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", data));
  ASSERT_OK_AND_ASSIGN(auto r, SafetensorsReader::Open(path.path()));
  float out[3];
  ASSERT_OK(r->Read(r->tensors()[0], 0, {out, 3, DType::kF32}));
  EXPECT_EQ(out[1], -2.0f);
}

TEST(Safetensors, EveryStructuralFaultIsRefusedNamingTheFileAndTheTensor) {
  ScratchPath path("st_bad");
  const std::string d12(12, '\1');
  struct Case {
    std::string bytes;
    absl::StatusCode code;
    std::string says;
  } cases[] = {
      {"short", absl::StatusCode::kFailedPrecondition, "too short"},
      {Raw("not json at all", d12), absl::StatusCode::kFailedPrecondition, "not a safetensors"},
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
       absl::StatusCode::kFailedPrecondition, "not a safetensors"},
      {Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", "").substr(0, 30),
       absl::StatusCode::kDataLoss, "passes the end"},
      {Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", d12.substr(0, 8)),
       absl::StatusCode::kDataLoss, "truncated"},
      {Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"v":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           d12),
       absl::StatusCode::kDataLoss, "overlaps"},
      {Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", d12),
       absl::StatusCode::kDataLoss, "belong to no tensor"},
      {Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", d12),
       absl::StatusCode::kDataLoss, "after the last tensor"},
      {Raw(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", d12),
       absl::StatusCode::kDataLoss, "needs 16"},
      {Raw(R"({"w":{"dtype":"F31","shape":[3],"data_offsets":[0,12]}})", d12),
       absl::StatusCode::kDataLoss, "unknown dtype"},
      {Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[12,0]}})", d12),
       absl::StatusCode::kDataLoss, "ordered pair"},
      {Raw(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,12]}})",
           d12),
       absl::StatusCode::kDataLoss, "overflows"},
      {Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"w":{}})", d12),
       absl::StatusCode::kDataLoss, "repeated"},
      // A shape whose bytes pass 64 bits is named as such, not by a wrapped byte count.
      {Raw(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", ""),
       absl::StatusCode::kDataLoss, "more bytes than 64 bits count"},
      // Two bytes of text a value ("1,"): a header of more values than any checkpoint's is
      // refused before its tree is built (it took some 75 times its text in memory).
      {Raw(ManyOnes(1'100'000), std::string(4, '\0')), absl::StatusCode::kDataLoss, "more values"},
  };
  for (const Case& c : cases) {
    Spit(path.path(), c.bytes);
    auto r = SafetensorsReader::Open(path.path());
    EXPECT_THAT(r, StatusIs(c.code, HasSubstr(c.says))) << c.says;
    EXPECT_THAT(r, StatusIs(c.code, HasSubstr(path.path()))) << c.says;
  }
  // A dtype the format has and MemAscend does not compute in: the file opens, the read is
  // refused naming the tensor.
  Spit(path.path(), Raw(R"({"ids":{"dtype":"I32","shape":[3],"data_offsets":[0,12]}})", d12));
  ASSERT_OK_AND_ASSIGN(auto r, SafetensorsReader::Open(path.path()));
  float out[3];
  EXPECT_THAT(r->Read(r->tensors()[0], 0, {out, 3, DType::kF32}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'ids' has dtype I32")));
}

TEST(Safetensors, AWriterRefusesToReplaceAFileAndLeavesNoPartialFile) {
  ScratchPath path("st_keep");
  Spit(path.path(), "the user's file");
  EXPECT_THAT(SafetensorsWriter::Create(path.path(), {{"w", "F32", {1}}}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("overwrite")));
  EXPECT_EQ(Slurp(path.path()), "the user's file");
  {
    ASSERT_OK_AND_ASSIGN(auto w, SafetensorsWriter::Create(path.path(), {{"w", "F32", {4}}}, {},
                                                           /*overwrite=*/true));
    float x = 1;
    ASSERT_OK(w->Append({&x, 1, DType::kF32}));
  }  // abandoned: the partial file goes, the user's stays
  EXPECT_EQ(Slurp(path.path()), "the user's file");
  EXPECT_TRUE(Slurp(path.path() + ".partial").empty());
  EXPECT_THAT(
      SafetensorsWriter::Create(path.path(), {{"w", "F32", {1}}, {"w", "F32", {1}}}, {}, true),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
  EXPECT_THAT(SafetensorsWriter::Create(path.path(), {{"w", "Q4", {1}}}, {}, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Q4")));
}

TEST(Safetensors, OnlyARegularFileIsRead) {
  // A FIFO would wait for a writer forever; a directory reads as nothing.
  ScratchPath fifo("st_fifo");
  ASSERT_EQ(::mkfifo(fifo.path().c_str(), 0600), 0);
  EXPECT_THAT(SafetensorsReader::Open(fifo.path()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("a FIFO")));
  EXPECT_THAT(SafetensorsReader::Open(::testing::TempDir()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("a directory")));
  ::unlink(fifo.path().c_str());
}

TEST(Safetensors, AWriterMakesItsPartialFileAndNeverWritesThroughWhatIsThere) {
  ScratchPath path("st_links");
  const std::string partial = path.path() + ".partial";
  ScratchPath victim("st_victim");
  Spit(victim.path(), "the user's other file");
  // A file already at the partial name (a user's, or an earlier writer's that died) is
  // refused without overwrite, and kept.
  Spit(partial, "the user's notes");
  EXPECT_THAT(SafetensorsWriter::Create(path.path(), {{"w", "F32", {1}}}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr(partial)));
  EXPECT_EQ(Slurp(partial), "the user's notes");
  // A link there is replaced with overwrite, never written through.
  ::unlink(partial.c_str());
  ASSERT_EQ(::symlink(victim.path().c_str(), partial.c_str()), 0);
  {
    ASSERT_OK_AND_ASSIGN(auto w, SafetensorsWriter::Create(path.path(), {{"w", "F32", {1}}}, {},
                                                           /*overwrite=*/true));
    float x = 1;
    ASSERT_OK(w->Append({&x, 1, DType::kF32}));
    ASSERT_OK(w->Finish());
  }
  EXPECT_EQ(Slurp(victim.path()), "the user's other file");
  ASSERT_OK_AND_ASSIGN(auto r, SafetensorsReader::Open(path.path()));
  EXPECT_EQ(r->tensors().size(), 1u);
  // A dangling link at the file's own name is something there: refused without overwrite.
  ::unlink(path.path().c_str());
  ASSERT_EQ(::symlink((victim.path() + ".gone").c_str(), path.path().c_str()), 0);
  EXPECT_THAT(SafetensorsWriter::Create(path.path(), {{"w", "F32", {1}}}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("overwrite")));
  ::unlink(path.path().c_str());
  // A shape whose bytes pass 64 bits is refused, not wrapped into a small file.
  EXPECT_THAT(SafetensorsWriter::Create(path.path(), {{"w", "F32", {std::uint64_t{1} << 62}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pass what a file")));
}

TEST(Safetensors, ACheckpointOfShardsFindsEveryTensorThroughItsIndex) {
  const std::string dir = ::testing::TempDir() + "/st_shards_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  float v[2] = {1, 2};
  for (int s = 1; s <= 2; ++s) {
    const std::string file = dir + "/model-0000" + std::to_string(s) + "-of-00002.safetensors";
    ASSERT_OK_AND_ASSIGN(auto w,
                         SafetensorsWriter::Create(file, {{"t" + std::to_string(s), "F32", {2}}}));
    ASSERT_OK(w->Append({v, 2, DType::kF32}));
    ASSERT_OK(w->Finish());
  }
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir), StatusIs(absl::StatusCode::kNotFound));
  Spit(dir + "/model.safetensors.index.json",
       R"({"metadata":{"total_size":16},"weight_map":{"t1":"model-00001-of-00002.safetensors",)"
       R"("t2":"model-00002-of-00002.safetensors"}})");
  ASSERT_OK_AND_ASSIGN(auto c, SafetensorsCheckpoint::Open(dir));
  EXPECT_EQ(c->names(), (std::vector<std::string>{"t1", "t2"}));
  ASSERT_OK_AND_ASSIGN(auto where, c->Find("t2"));
  EXPECT_THAT(where.file->path(), HasSubstr("00002-of"));
  EXPECT_THAT(c->Find("t3"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'t3'")));
  Spit(dir + "/model.safetensors.index.json",
       R"({"weight_map":{"t1":"model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not hold it")));
  Spit(dir + "/model.safetensors.index.json", R"({"weight_map":{"t1":"../etc/passwd"}})");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a file name")));
  // A NUL inside a name (JSON's \u0000) would cut it short at the open.
  Spit(dir + "/model.safetensors.index.json",
       R"({"weight_map":{"t1":"model-00001-of-00002.safetensors\u0000junk"}})");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a file name")));
  Spit(dir + "/model.safetensors.index.json", R"({"weight_map":{"t1":"gone.safetensors"}})");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("gone.safetensors")));
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace
}  // namespace memascend
