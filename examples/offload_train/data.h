// The training text and its tokens.
//
// Bytes by default (vocab 256). With a larger vocab, a word-level vocabulary with byte
// fallback: ids 0..255 are the bytes, the rest the most frequent words of the corpus
// (runs of letters and digits; ties broken by the word), so every text encodes
// losslessly and, as in real LLMs, a large vocab makes the embedding and output head the
// largest tensors.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_DATA_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_DATA_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <absl/status/statusor.h>

namespace offload_train {

// The default corpus: the regular files (not symlinks) under `dir`, in name order,
// concatenated. kNotFound when there are none.
absl::StatusOr<std::string> ReadLicenceCorpus(
    const std::string& dir = "/usr/share/common-licenses");
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

class Tokenizer {
 public:
  // kInvalidArgument for vocab < 256 (the bytes need their ids).
  static absl::StatusOr<Tokenizer> Build(const std::string& corpus, std::size_t vocab);
  std::vector<std::int32_t> Encode(const std::string& text) const;
  std::string Decode(std::int32_t id) const;
  std::size_t size() const { return pieces_.size(); }
  // An order-independent digest of the vocabulary (checked when a run resumes).
  std::uint64_t Fingerprint() const;

 private:
  std::vector<std::string> pieces_;
  std::unordered_map<std::string, std::int32_t> words_;
};

// Pre-tokenized data (--tokens, --eval): raw little-endian uint32 token ids, a file whose
// size is a multiple of 4, each id below `vocab`. kInvalidArgument naming the file (and the
// position and value of the first id out of range); kNotFound / kUnavailable as opening
// and reading fail.
absl::StatusOr<std::vector<std::int32_t>> ReadTokenFile(const std::string& path, std::size_t vocab);

// Batch `step` of a run: `batch` windows of seq + 1 tokens at positions drawn from
// (seed, step) alone, so a resumed run sees the same batches as an uninterrupted one.
void SampleBatch(const std::vector<std::int32_t>& tokens, std::uint64_t seed, std::uint64_t step,
                 std::size_t batch, std::size_t seq, std::vector<std::int32_t>* inputs,
                 std::vector<std::int32_t>* targets);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_DATA_H_
