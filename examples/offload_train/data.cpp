#include "data.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace offload_train {
namespace {

bool IsWordChar(unsigned char ch) { return std::isalnum(ch) != 0; }

std::uint64_t Mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(fmt::format("cannot read '{}'", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<std::vector<std::int32_t>> ReadTokenFile(const std::string& path,
                                                        std::size_t vocab) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(fmt::format("{}: cannot open the token file", path));
  std::error_code ec;
  const std::uintmax_t bytes = std::filesystem::file_size(path, ec);
  if (ec) return absl::UnavailableError(fmt::format("{}: {}", path, ec.message()));
  if (bytes % 4 != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: {} bytes is not a whole number of uint32 token ids (raw little-endian, 4 bytes "
        "each)",
        path, bytes));
  }
  std::vector<std::int32_t> ids(bytes / 4);
  std::vector<unsigned char> raw(std::size_t{1} << 20);
  for (std::size_t at = 0; at < ids.size();) {
    const std::size_t n = std::min(raw.size() / 4, ids.size() - at);
    if (!in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(n * 4))) {
      return absl::UnavailableError(
          fmt::format("{}: read failed at byte {} of {}", path, at * 4, bytes));
    }
    for (std::size_t i = 0; i < n; ++i) {
      const unsigned char* b = raw.data() + 4 * i;
      const std::uint32_t id = std::uint32_t{b[0]} | std::uint32_t{b[1]} << 8 |
                               std::uint32_t{b[2]} << 16 | std::uint32_t{b[3]} << 24;
      if (id >= vocab) {
        return absl::InvalidArgumentError(
            fmt::format("{}: token id {} at position {} is beyond the model's vocabulary of {}",
                        path, id, at + i, vocab));
      }
      ids[at + i] = static_cast<std::int32_t>(id);
    }
    at += n;
  }
  return ids;
}

absl::StatusOr<std::string> ReadLicenceCorpus(const std::string& dir) {
  std::error_code ec;
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.is_symlink(ec) || !e.is_regular_file(ec)) continue;
    files.push_back(e.path());
  }
  if (files.empty())
    return absl::NotFoundError(fmt::format("no licence texts under '{}' (use --data FILE)", dir));
  std::sort(files.begin(), files.end());
  std::string corpus;
  for (const auto& f : files) {
    auto text = ReadTextFile(f.string());
    if (!text.ok()) return text.status();
    corpus += *text;
  }
  return corpus;
}

absl::StatusOr<Tokenizer> Tokenizer::Build(const std::string& corpus, std::size_t vocab) {
  if (vocab < 256 || vocab > (std::size_t{1} << 24)) {
    return absl::InvalidArgumentError(
        fmt::format("--vocab {}: from 256 (the bytes) to 2^24 words", vocab));
  }
  Tokenizer t;
  for (int b = 0; b < 256; ++b) t.pieces_.push_back(std::string(1, static_cast<char>(b)));
  std::unordered_map<std::string, std::size_t> counts;
  for (std::size_t i = 0; i < corpus.size();) {
    if (!IsWordChar(static_cast<unsigned char>(corpus[i]))) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < corpus.size() && IsWordChar(static_cast<unsigned char>(corpus[j]))) ++j;
    if (j - i > 1) ++counts[corpus.substr(i, j - i)];
    i = j;
  }
  std::vector<std::pair<std::size_t, std::string>> ranked;
  for (auto& [w, n] : counts) ranked.emplace_back(n, w);
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (std::size_t k = 0; k < ranked.size() && t.pieces_.size() < vocab; ++k) {
    t.words_.emplace(ranked[k].second, static_cast<std::int32_t>(t.pieces_.size()));
    t.pieces_.push_back(ranked[k].second);
  }
  // A corpus with fewer distinct words than asked for: the rest stay unused ids, so the
  // model has the size the user asked for.
  while (t.pieces_.size() < vocab) t.pieces_.push_back(fmt::format("<unused{}>", t.pieces_.size()));
  return t;
}

std::vector<std::int32_t> Tokenizer::Encode(const std::string& text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 2);
  for (std::size_t i = 0; i < text.size();) {
    const auto ch = static_cast<unsigned char>(text[i]);
    if (IsWordChar(ch)) {
      std::size_t j = i;
      while (j < text.size() && IsWordChar(static_cast<unsigned char>(text[j]))) ++j;
      auto it = words_.find(text.substr(i, j - i));
      if (it != words_.end()) {
        out.push_back(it->second);
      } else {
        for (std::size_t k = i; k < j; ++k) out.push_back(static_cast<unsigned char>(text[k]));
      }
      i = j;
      continue;
    }
    out.push_back(ch);
    ++i;
  }
  return out;
}

std::string Tokenizer::Decode(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= pieces_.size()) return "?";
  return pieces_[static_cast<std::size_t>(id)];
}

std::uint64_t Tokenizer::Fingerprint() const {
  std::uint64_t h = pieces_.size();
  for (const std::string& p : pieces_) {
    for (char c : p) h = Mix(h ^ static_cast<unsigned char>(c));
    h = Mix(h + 0x9e37);
  }
  return h;
}

void SampleBatch(const std::vector<std::int32_t>& tokens, std::uint64_t seed, std::uint64_t step,
                 std::size_t batch, std::size_t seq, std::vector<std::int32_t>* inputs,
                 std::vector<std::int32_t>* targets) {
  inputs->resize(batch * seq);
  targets->resize(batch * seq);
  const std::size_t span = tokens.size() - seq - 1;  // the caller checked the corpus length
  for (std::size_t b = 0; b < batch; ++b) {
    const std::size_t start = Mix(seed * 0x9e3779b97f4a7c15ull + step * 1315423911ull + b) % span;
    for (std::size_t t = 0; t < seq; ++t) {
      (*inputs)[b * seq + t] = tokens[start + t];
      (*targets)[b * seq + t] = tokens[start + t + 1];
    }
  }
}

}  // namespace offload_train
