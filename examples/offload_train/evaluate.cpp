// A Run's forward passes without training (run.h): the master weights group by group (for
// evaluation and export), the mean next-token loss over held-out tokens (--eval), and the
// next token for sampling.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include <memascend/status.h>

#include "run.h"

namespace offload_train {

using memascend::DType;

// Group g's fp32 master weights, in its working buffer (the tied embeddings' in a buffer of
// their own, which replaces their 16 bits: Note [tied head]), valid until the next call
// for a group in the same buffer.
// With several ranks, a collective: each reads its shard, and all are gathered.
absl::StatusOr<const float*> Run::Master(std::size_t g) {
  const bool embed = g == 0 && tied_;  // not in the working buffer (Note [tied head])
  if (embed && master_embed_.size() == 0) {
    we_.reset();  // made again by the next Working(0)
    master_embed_ = FloatBuffer(GroupParams(c_, 0));
  }
  float* w = embed ? master_embed_.data() : wf_.data();
  if (shard_ == nullptr) {
    MEMASCEND_RETURN_IF_ERROR(
        adam_->ReadState(memascend::StateKind::kMaster, g, {w, GroupParams(c_, g), DType::kF32}));
    return w;
  }
  if (const auto local = shard_->local[g]) {
    const auto [b, e] = shard_->range[g];
    MEMASCEND_RETURN_IF_ERROR(
        adam_->ReadState(memascend::StateKind::kMaster, *local, {w + b, e - b, DType::kF32}));
  }
  MEMASCEND_RETURN_IF_ERROR(Gather(g, w, sizeof(float)));
  return w;
}

absl::Status Run::ReadMaster(std::size_t g, std::size_t first, std::size_t count, float* out) {
  if (g == 0 && tied_) we_.reset();  // Note [tied head]: made again by the next Working(0)
  if (shard_ == nullptr) {
    return adam_->ReadStateRange(memascend::StateKind::kMaster, g, first,
                                 {out, count, DType::kF32});
  }
  // Every group gathered in order, once: a collective every rank joins (Note [data
  // parallel]), so a group asked for nothing is gathered too.
  if (g + 1 < gathered_) {
    return absl::FailedPreconditionError(
        fmt::format("master weights of group {} asked for after group {}'s", g, gathered_ - 1));
  }
  while (gathered_ <= g) {
    MEMASCEND_ASSIGN_OR_RETURN(gathered_data_, Master(gathered_));
    ++gathered_;
  }
  std::copy(gathered_data_ + first, gathered_data_ + first + count, out);
  return absl::OkStatus();
}

absl::StatusOr<MatrixRows<float>> Run::MasterEmbedRowsFor(const std::int32_t* tokens) {
  const std::size_t ch = c_.channels, most = wr_.size() / ch;
  wanted_.clear();
  net_->Embed(MatrixRows<float>(
                  [this](std::size_t begin, std::size_t end) {
                    for (std::size_t r = begin; r < end; ++r) wanted_.push_back(r);
                    return static_cast<const float*>(wr_.data());  // read, never used
                  },
                  most),
              tokens);
  std::sort(wanted_.begin(), wanted_.end());
  wanted_.erase(std::unique(wanted_.begin(), wanted_.end()), wanted_.end());
  rows_.resize(wanted_.size() * ch);
  for (std::size_t i = 0; i < wanted_.size();) {
    // A window from wanted_[i]: the rows up to `most` beyond it, read as one range.
    std::size_t j = i + 1;
    while (j < wanted_.size() && wanted_[j] - wanted_[i] < most) ++j;
    const std::size_t first = wanted_[i], span = wanted_[j - 1] - first + 1;
    MEMASCEND_RETURN_IF_ERROR(adam_->ReadStateRange(memascend::StateKind::kMaster, 0, first * ch,
                                                    {wr_.data(), span * ch, DType::kF32}));
    for (std::size_t k = i; k < j; ++k) {
      const float* row = wr_.data() + (wanted_[k] - first) * ch;
      std::copy(row, row + ch, rows_.begin() + static_cast<std::ptrdiff_t>(k * ch));
    }
    i = j;
  }
  return MatrixRows<float>(
      [this, ch](std::size_t begin, std::size_t) {  // rows begin.. are consecutive in rows_
        const auto at = std::lower_bound(wanted_.begin(), wanted_.end(), begin);
        return static_cast<const float*>(rows_.data()) +
               static_cast<std::size_t>(at - wanted_.begin()) * ch;
      },
      most);
}

MatrixRows<float> Run::MasterEmbedRows() {
  const std::size_t ch = c_.channels;
  return MatrixRows<float>(
      [this, ch](std::size_t begin, std::size_t end) {
        if (rows_status_.ok()) {
          rows_status_ = adam_->ReadStateRange(memascend::StateKind::kMaster, 0, begin * ch,
                                               {wr_.data(), (end - begin) * ch, DType::kF32});
        }
        return static_cast<const float*>(wr_.data());
      },
      wr_.size() / ch);
}

// The mean next-token loss over `tokens` cut into windows of seq + 1 (a partial last
// window dropped), each predicting its tokens 1..seq from 0..seq-1, in fp32 from the
// master weights; `batch` windows a pass (the last pass padded with its first window,
// whose rows are not counted). Passes go group by group in chunks whose residual
// streams take at most kEvalStreamBytes, so each group's master weights are read once
// per chunk, not once per pass. Returns {mean, positions}.
absl::StatusOr<std::pair<double, std::uint64_t>> Run::Evaluate(
    const std::vector<std::int32_t>& tokens) {
  const std::size_t seq = c_.seq, batch = c_.batch, groups = GroupCount(c_);
  const std::size_t windows = tokens.size() / (seq + 1);
  if (windows == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "--eval: {} tokens, fewer than one window of --seq + 1 = {}", tokens.size(), seq + 1));
  }
  MakeNet();
  // Note [tied head]: one process reads the tied embeddings' master weights a chunk of
  // rows at a time, and their 16 bits are let go meanwhile (Working(0) makes them again).
  const bool by_rows = tied_ && shard_ == nullptr;
  if (by_rows) we_.reset();
  rows_status_ = absl::OkStatus();
  constexpr std::size_t kEvalStreamBytes = std::size_t{256} << 20;
  const std::size_t stream = batch * seq * c_.channels;  // one pass's residual stream
  const std::size_t passes = (windows + batch - 1) / batch;
  const std::size_t per_chunk = std::max<std::size_t>(1, kEvalStreamBytes / (stream * 4));
  std::vector<std::int32_t> inputs(batch * seq), targets(batch * seq);
  // Pass p's windows into inputs/targets; returns how many are real.
  const auto fill = [&](std::size_t p) {
    const std::size_t first = p * batch, n = std::min(batch, windows - first);
    for (std::size_t b = 0; b < batch; ++b) {
      const std::int32_t* w = tokens.data() + (first + (b < n ? b : 0)) * (seq + 1);
      std::copy(w, w + seq, inputs.begin() + static_cast<std::ptrdiff_t>(b * seq));
      std::copy(w + 1, w + seq + 1, targets.begin() + static_cast<std::ptrdiff_t>(b * seq));
    }
    return n;
  };
  // Note [data parallel]: each rank takes its run of the passes; every rank reads (and
  // gathers) the master weights as often as the rank with the most.
  const std::size_t world = shard_ != nullptr ? static_cast<std::size_t>(shard_->world) : 1;
  const std::size_t rank = shard_ != nullptr ? static_cast<std::size_t>(shard_->rank) : 0;
  const std::size_t lo = passes * rank / world, mine = passes * (rank + 1) / world - lo;
  const std::size_t most = (passes + world - 1) / world;
  std::vector<float> streams;
  double sum = 0;
  for (std::size_t chunk = 0; chunk < most; chunk += per_chunk) {
    const std::size_t k = chunk < mine ? std::min(per_chunk, mine - chunk) : 0;
    streams.resize(k * stream);
    for (std::size_t g = 0; g < groups; ++g) {
      const float* w = nullptr;
      if (g != 0 || !by_rows) {
        MEMASCEND_ASSIGN_OR_RETURN(w, Master(g));
      }
      for (std::size_t p = 0; p < k; ++p) {
        const std::size_t n = fill(lo + chunk + p);
        float* kept = streams.data() + p * stream;
        if (g == 0 && by_rows) {
          MEMASCEND_ASSIGN_OR_RETURN(const MatrixRows<float> rows,
                                     MasterEmbedRowsFor(inputs.data()));
          net_->Embed(rows, inputs.data());
        } else if (g == 0) {
          net_->Embed(MatrixRows<float>(w), inputs.data());
        } else {
          net_->SetResidual(kept);
          if (g + 1 < groups) {
            net_->Block(g - 1, w);
          } else {
            const MatrixRows<float> embed =
                !tied_ ? MatrixRows<float>()
                       : (by_rows ? MasterEmbedRows() : MatrixRows<float>(master_embed_.data()));
            net_->Head(w, embed, targets.data(), 1.0f, /*backward=*/false);
            MEMASCEND_RETURN_IF_ERROR(rows_status_);
            const float* rows = net_->RowLosses();
            for (std::size_t r = 0; r < n * seq; ++r) sum += static_cast<double>(rows[r]);
            continue;
          }
        }
        std::copy(net_->Residual(), net_->Residual() + stream, kept);
      }
    }
  }
  if (comm_ != nullptr) {
    double all[] = {sum};
    MEMASCEND_RETURN_IF_ERROR(comm_->AllReduceSum(all));
    sum = all[0];
  }
  const std::uint64_t positions = static_cast<std::uint64_t>(windows) * seq;
  return std::make_pair(sum / static_cast<double>(positions), positions);
}

// Forward only, for sampling: the model must be built for batch 1.
absl::StatusOr<std::int32_t> Run::NextToken(Network& model, const std::vector<std::int32_t>& ctx,
                                            std::uint64_t* rng) {
  const std::size_t groups = GroupCount(c_);
  std::vector<std::int32_t> window(c_.seq, 0);
  const std::size_t n = std::min(ctx.size(), c_.seq);
  std::copy(ctx.end() - static_cast<std::ptrdiff_t>(n), ctx.end(), window.begin());
  for (std::size_t g = 0; g < groups; ++g) {
    MEMASCEND_RETURN_IF_ERROR(LoadInto(g, Working(g), nullptr));
    if (g == 0) {
      model.Embed(EmbedRows(), window.data());
    } else if (g + 1 < groups) {
      model.Block(g - 1, wf_.data());
    } else {
      model.Head(wf_.data(), HeadRows(), window.data(), 1.0f, /*backward=*/false);
    }
  }
  const float* logits = model.Logits(0, n - 1);
  std::vector<double> p(c_.vocab);
  double maxv = logits[0], sum = 0;
  for (std::size_t v = 1; v < c_.vocab; ++v) maxv = std::max(maxv, double{logits[v]});
  for (std::size_t v = 0; v < c_.vocab; ++v)
    sum += p[v] = std::exp((double{logits[v]} - maxv) / 0.8);
  *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
  double u = static_cast<double>(*rng >> 11) * 0x1.0p-53 * sum;
  for (std::size_t v = 0; v < c_.vocab; ++v) {
    u -= p[v];
    if (u <= 0) return static_cast<std::int32_t>(v);
  }
  return static_cast<std::int32_t>(c_.vocab - 1);
}

}  // namespace offload_train
