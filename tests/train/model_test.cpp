// Gradient checks: every layer's backward pass, and the whole model's, against central
// finite differences, in double precision.
#include "model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "blas.h"
#include "llama.h"
#include "llama_ops.h"
#include "network.h"
#include "ops.h"

namespace offload_train {
namespace {

using Vec = std::vector<double>;

Vec Random(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (double& x : v) x = d(rng);
  return v;
}

// d(sum(w . f(x)))/dx numerically, for the entries of x listed (all by default).
Vec Numeric(Vec& x, const std::function<double()>& loss) {
  const double h = 1e-6;
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

void ExpectClose(const Vec& analytic, const Vec& numeric, const char* what) {
  ASSERT_EQ(analytic.size(), numeric.size());
  // Central differences with h = 1e-6 carry about 1e-10 of rounding: an absolute floor
  // for the tiny entries, relative agreement for the rest.
  for (std::size_t i = 0; i < analytic.size(); ++i) {
    EXPECT_NEAR(analytic[i], numeric[i], 1e-8 + 1e-6 * std::abs(numeric[i]))
        << what << "[" << i << "]";
  }
}

double Weighted(const Vec& out, const Vec& w) {
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * w[i];
  return s;
}

TEST(Gradients, Matmul) {
  std::mt19937_64 rng(1);
  const std::size_t rows = 5, in = 7, out = 3;
  Vec x = Random(rows * in, rng), w = Random(out * in, rng), b = Random(out, rng);
  const Vec upstream = Random(rows * out, rng);
  auto loss = [&] {
    Vec y(rows * out);
    ops::MatmulForward(y.data(), x.data(), w.data(), b.data(), rows, in, out, nullptr);
    return Weighted(y, upstream);
  };
  Vec dx(x.size()), dw(w.size()), db(b.size());
  ops::MatmulBackward(dx.data(), dw.data(), db.data(), upstream.data(), x.data(), w.data(), rows,
                      in, out, nullptr);
  ExpectClose(dx, Numeric(x, loss), "input");
  ExpectClose(dw, Numeric(w, loss), "weight");
  ExpectClose(db, Numeric(b, loss), "bias");
}

TEST(Gradients, LayerNorm) {
  std::mt19937_64 rng(2);
  const std::size_t rows = 4, ch = 9;
  Vec x = Random(rows * ch, rng), w = Random(ch, rng), b = Random(ch, rng);
  const Vec upstream = Random(rows * ch, rng);
  Vec mean(rows), rstd(rows);
  auto loss = [&] {
    Vec y(rows * ch);
    ops::LayerNormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows,
                          ch, nullptr);
    return Weighted(y, upstream);
  };
  loss();
  Vec dx(x.size()), dw(w.size()), db(b.size());
  ops::LayerNormBackward(dx.data(), dw.data(), db.data(), upstream.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), rows, ch, nullptr);
  ExpectClose(dx, Numeric(x, loss), "input");
  ExpectClose(dw, Numeric(w, loss), "gain");
  ExpectClose(db, Numeric(b, loss), "bias");
}

TEST(Gradients, CausalAttention) {
  std::mt19937_64 rng(3);
  const std::size_t batch = 2, seq = 5, ch = 8, heads = 2;
  Vec qkv = Random(batch * seq * 3 * ch, rng);
  const Vec upstream = Random(batch * seq * ch, rng);
  Vec att(batch * heads * seq * seq);
  auto loss = [&] {
    Vec y(batch * seq * ch);
    ops::AttentionForward(y.data(), att.data(), qkv.data(), batch, seq, ch, heads, nullptr);
    return Weighted(y, upstream);
  };
  loss();
  Vec dqkv(qkv.size());
  ops::AttentionBackward(dqkv.data(), upstream.data(), qkv.data(), att.data(), batch, seq, ch,
                         heads, nullptr);
  ExpectClose(dqkv, Numeric(qkv, loss), "qkv");
  // Causality: the output at position t does not depend on keys or values after t.
  Vec y1(batch * seq * ch), y2(batch * seq * ch);
  ops::AttentionForward(y1.data(), att.data(), qkv.data(), batch, seq, ch, heads, nullptr);
  qkv[(seq - 1) * 3 * ch + ch] += 1.0;  // a key of the last position of sequence 0
  ops::AttentionForward(y2.data(), att.data(), qkv.data(), batch, seq, ch, heads, nullptr);
  for (std::size_t i = 0; i < (seq - 1) * ch; ++i) EXPECT_EQ(y1[i], y2[i]) << i;
}

TEST(Gradients, RmsNorm) {
  std::mt19937_64 rng(12);
  const std::size_t rows = 4, ch = 9;
  Vec x = Random(rows * ch, rng), w = Random(ch, rng);
  const Vec upstream = Random(rows * ch, rng);
  Vec rstd(rows);
  auto loss = [&] {
    Vec y(rows * ch);
    ops::RmsNormForward(y.data(), rstd.data(), x.data(), w.data(), rows, ch, 1e-5, nullptr);
    return Weighted(y, upstream);
  };
  loss();
  Vec dx(x.size()), dw(w.size());
  ops::RmsNormBackward(dx.data(), dw.data(), upstream.data(), x.data(), w.data(), rstd.data(), rows,
                       ch, nullptr);
  ExpectClose(dx, Numeric(x, loss), "input");
  ExpectClose(dw, Numeric(w, loss), "gain");
}

TEST(Gradients, RotaryEmbeddingsRotateHalvesAndTheirBackwardIsTheInverse) {
  std::mt19937_64 rng(13);
  const std::size_t seq = 5, rows = 2 * seq, heads = 3, hd = 8;
  const std::vector<float> inv = ops::RopeInverseFrequencies(hd, 10000.0, {});
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_FLOAT_EQ(inv[1], 1.0f / std::pow(10000.0f, 0.25f));
  Vec cos, sin;
  ops::RopeTables(&cos, &sin, inv, seq);
  Vec x = Random(rows * heads * hd, rng);
  const Vec upstream = Random(x.size(), rng);
  // Element i pairs with i + hd/2 (rotate_half), by the row's position's angle.
  Vec y = x;
  ops::RopeApply(y.data(), cos.data(), sin.data(), rows, seq, heads, hd, false, nullptr);
  const std::size_t r = seq + 3, h = 1, i = 2;  // position 3
  const double angle = 3.0 * static_cast<double>(inv[i]);
  const double a = x[(r * heads + h) * hd + i], b = x[(r * heads + h) * hd + i + hd / 2];
  EXPECT_NEAR(y[(r * heads + h) * hd + i], a * std::cos(angle) - b * std::sin(angle), 1e-6);
  EXPECT_NEAR(y[(r * heads + h) * hd + i + hd / 2], b * std::cos(angle) + a * std::sin(angle),
              1e-6);
  auto loss = [&] {
    Vec z = x;
    ops::RopeApply(z.data(), cos.data(), sin.data(), rows, seq, heads, hd, false, nullptr);
    return Weighted(z, upstream);
  };
  Vec dx = upstream;
  ops::RopeApply(dx.data(), cos.data(), sin.data(), rows, seq, heads, hd, true, nullptr);
  ExpectClose(dx, Numeric(x, loss), "input");
}

TEST(Rope, Llama3ScalingKeepsShortWavelengthsAndStretchesLongOnes) {
  // Llama 3.2's: theta 500000, factor 32, low 1, high 4, original context 8192, head 64.
  ops::RopeScaling s;
  s.llama3 = true;
  s.factor = 32;
  const std::vector<float> plain = ops::RopeInverseFrequencies(64, 500000.0, {});
  const std::vector<float> scaled = ops::RopeInverseFrequencies(64, 500000.0, s);
  int kept = 0, divided = 0, blended = 0;
  for (std::size_t i = 0; i < plain.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / static_cast<double>(plain[i]);
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(scaled[i], plain[i]) << i;
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(scaled[i], plain[i] / 32.0f) << i;
      ++divided;
    } else {
      EXPECT_LT(scaled[i], plain[i]) << i;
      EXPECT_GT(scaled[i], plain[i] / 32.0f) << i;
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(Gradients, GroupedQueryAttention) {
  std::mt19937_64 rng(14);
  const ops::AttentionShape a{2, 4, 4, 2, 3};  // batch, seq, heads, kv heads, head dim
  const std::size_t rows = a.batch * a.seq;
  Vec q = Random(rows * a.heads * a.head_dim, rng), k = Random(rows * a.kv_heads * a.head_dim, rng),
      v = Random(rows * a.kv_heads * a.head_dim, rng);
  const Vec upstream = Random(q.size(), rng);
  Vec att(a.batch * a.heads * a.seq * a.seq);
  auto loss = [&] {
    Vec y(q.size());
    ops::GqaForward(y.data(), att.data(), q.data(), k.data(), v.data(), a, nullptr);
    return Weighted(y, upstream);
  };
  loss();
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  ops::GqaBackward(dq.data(), dk.data(), dv.data(), upstream.data(), q.data(), k.data(), v.data(),
                   att.data(), a, nullptr);
  ExpectClose(dq, Numeric(q, loss), "q");
  ExpectClose(dk, Numeric(k, loss), "k");
  ExpectClose(dv, Numeric(v, loss), "v");
}

TEST(Gqa, WithAsManyKeyHeadsAsQueryHeadsItIsMultiHeadAttention) {
  std::mt19937_64 rng(15);
  const std::size_t batch = 2, seq = 5, ch = 8, heads = 2, rows = batch * seq;
  const Vec qkv = Random(rows * 3 * ch, rng);
  Vec q(rows * ch), k(rows * ch), v(rows * ch);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < ch; ++c) {
      q[r * ch + c] = qkv[r * 3 * ch + c];
      k[r * ch + c] = qkv[r * 3 * ch + ch + c];
      v[r * ch + c] = qkv[r * 3 * ch + 2 * ch + c];
    }
  }
  Vec mha(rows * ch), gqa(rows * ch), att(batch * heads * seq * seq);
  ops::AttentionForward(mha.data(), att.data(), qkv.data(), batch, seq, ch, heads, nullptr);
  ops::GqaForward(gqa.data(), att.data(), q.data(), k.data(), v.data(),
                  {batch, seq, heads, heads, ch / heads}, nullptr);
  EXPECT_EQ(mha, gqa);
}

TEST(Gradients, Swiglu) {
  std::mt19937_64 rng(16);
  const std::size_t n = 20;
  Vec gate = Random(n, rng, 2.0), up = Random(n, rng);
  const Vec upstream = Random(n, rng);
  auto loss = [&] {
    Vec y(n);
    ops::SwigluForward(y.data(), gate.data(), up.data(), n);
    return Weighted(y, upstream);
  };
  Vec dgate(n), dup(n);
  ops::SwigluBackward(dgate.data(), dup.data(), upstream.data(), gate.data(), up.data(), n);
  ExpectClose(dgate, Numeric(gate, loss), "gate");
  ExpectClose(dup, Numeric(up, loss), "up");
}

TEST(Gradients, GeluAndCrossEntropyAndEmbedding) {
  std::mt19937_64 rng(4);
  {
    Vec x = Random(50, rng, 2.0);
    const Vec upstream = Random(50, rng);
    auto loss = [&] {
      Vec y(50);
      ops::GeluForward(y.data(), x.data(), 50);
      return Weighted(y, upstream);
    };
    Vec dx(50);
    ops::GeluBackward(dx.data(), upstream.data(), x.data(), 50);
    ExpectClose(dx, Numeric(x, loss), "gelu");
  }
  {
    const std::size_t rows = 6, vocab = 11;
    Vec logits = Random(rows * vocab, rng, 3.0);
    std::vector<std::int32_t> targets = {0, 3, 10, 5, 5, 1};
    Vec scratch(rows);
    auto loss = [&] {
      return ops::CrossEntropy<double>(nullptr, logits.data(), targets.data(), rows, vocab, 1.0,
                                       nullptr, scratch.data());
    };
    Vec d(logits.size());
    ops::CrossEntropy(d.data(), logits.data(), targets.data(), rows, vocab, 1.0, nullptr,
                      scratch.data());
    ExpectClose(d, Numeric(logits, loss), "cross-entropy");
    Vec d8(logits.size());
    ops::CrossEntropy(d8.data(), logits.data(), targets.data(), rows, vocab, 8.0, nullptr,
                      scratch.data());
    for (std::size_t i = 0; i < d.size(); ++i) EXPECT_DOUBLE_EQ(d8[i], 8.0 * d[i]);
  }
  {
    const std::size_t rows = 6, seq = 3, ch = 4, vocab = 5;
    Vec wte = Random(vocab * ch, rng), wpe = Random(seq * ch, rng);
    const std::vector<std::int32_t> tokens = {1, 4, 1, 0, 1, 2};
    const Vec upstream = Random(rows * ch, rng);
    auto loss = [&] {
      Vec y(rows * ch);
      const auto rows_of = [&](std::size_t i, std::size_t) {
        return i < vocab ? wte.data() + i * ch : wpe.data() + (i - vocab) * ch;
      };
      ops::EmbeddingForward<double>(y.data(), tokens.data(), rows_of, rows, seq, vocab, ch);
      return Weighted(y, upstream);
    };
    Vec flat(wte.size() + wpe.size());  // [wte; wpe], as the embeddings' group lays them out
    ops::EmbeddingGradientRange(flat.data(), upstream.data(), tokens.data(), rows, seq, vocab, ch,
                                0, flat.size());
    const Vec dwte(flat.begin(), flat.begin() + static_cast<std::ptrdiff_t>(wte.size()));
    const Vec dwpe(flat.begin() + static_cast<std::ptrdiff_t>(wte.size()), flat.end());
    ExpectClose(dwte, Numeric(wte, loss), "wte");
    ExpectClose(dwpe, Numeric(wpe, loss), "wpe");
  }
}

// The whole model: every group's gradient from the streamed backward pass against
// finite differences of the loss, over a sample of each group's parameters.
// Whole-model gradient checks (Gpt and Llama alike): every group's parameters from the
// model's initialisation, ten times larger and perturbed, so the attention and MLP are
// far from linear.
template <typename Init>
std::vector<Vec> CheckParams(std::size_t groups,
                             const std::function<std::size_t(std::size_t)>& size, Init&& init) {
  std::vector<Vec> params(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    std::vector<float> f(size(g));
    init(g, f.data());
    std::mt19937_64 rng(g);
    params[g].resize(f.size());
    for (std::size_t i = 0; i < f.size(); ++i)
      params[g][i] = double{f[i]} * 10 + static_cast<double>(rng() % 100) * 1e-3;
  }
  return params;
}

// Fixed inputs and next-token targets over `rows` positions.
void CheckTokens(std::size_t rows, std::size_t vocab, std::vector<std::int32_t>* tokens,
                 std::vector<std::int32_t>* targets) {
  tokens->resize(rows);
  targets->resize(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    (*tokens)[i] = static_cast<std::int32_t>((i * 7 + 3) % vocab);
    (*targets)[i] = static_cast<std::int32_t>((i * 5 + 1) % vocab);
  }
}

// `forward(grads)` returns the loss and, with `grads`, fills every group's gradient. A few
// entries of every slice of every group are checked against central differences (with
// Richardson's extrapolation when `richardson`: the O(h^2) error cancels, for weights
// large enough that the loss curves sharply).
void ExpectGroupGradients(std::vector<Vec>& params,
                          const std::function<double(std::vector<Vec>*)>& forward,
                          const std::function<std::vector<Slice>(std::size_t)>& layout,
                          const std::function<std::string(std::size_t, const Slice&)>& name,
                          bool richardson) {
  std::vector<Vec> grads(params.size());
  for (std::size_t g = 0; g < params.size(); ++g) grads[g].assign(params[g].size(), 0.0);
  forward(&grads);
  for (std::size_t g = 0; g < params.size(); ++g) {
    for (const Slice& s : layout(g)) {
      for (std::size_t k = 0; k < std::min<std::size_t>(s.count, 6); ++k) {
        const std::size_t i = s.offset + (k * 7919) % s.count;
        const double keep = params[g][i];
        auto central = [&](double h) {
          params[g][i] = keep + h;
          const double up = forward(nullptr);
          params[g][i] = keep - h;
          const double down = forward(nullptr);
          params[g][i] = keep;
          return (up - down) / (2 * h);
        };
        const double numeric = richardson ? (4 * central(5e-6) - central(1e-5)) / 3 : central(1e-5);
        EXPECT_NEAR(grads[g][i], numeric, 1e-6 + 1e-5 * std::abs(numeric))
            << name(g, s) << "[" << i - s.offset << "]";
      }
    }
  }
}

TEST(Gradients, WholeModelEveryGroup) {
  const ModelConfig c{
      .vocab = 13, .seq = 6, .channels = 8, .layers = 2, .heads = 2, .batch = 2, .hf = {}};
  memascend::KernelThreads threads(2);
  Gpt<double> model(c, &threads);
  std::vector<Vec> params = CheckParams(
      GroupCount(c), [&](std::size_t g) { return GroupParams(c, g); },
      [&](std::size_t g, float* f) { InitGroup(c, g, 7, f); });
  std::vector<std::int32_t> tokens, targets;
  CheckTokens(c.batch * c.seq, c.vocab, &tokens, &targets);
  const std::size_t head = GroupCount(c) - 1;
  auto forward = [&](std::vector<Vec>* grads) {
    model.Embed(params[0].data(), tokens.data());
    for (std::size_t l = 0; l < c.layers; ++l) model.Block(l, params[l + 1].data());
    const double loss =
        model.Head(params[head].data(), nullptr, targets.data(), 1.0, grads != nullptr);
    if (grads != nullptr) {
      model.HeadGradient((*grads)[head].data(), 0, (*grads)[head].size());
      for (std::size_t l = c.layers; l-- > 0;)
        model.BlockBackward(l, params[l + 1].data(), (*grads)[l + 1].data());
      model.EmbedGradient((*grads)[0].data(), 0, (*grads)[0].size());
    }
    return loss;
  };
  ExpectGroupGradients(
      params, forward, [&](std::size_t g) { return GroupLayout(c, g); },
      [&](std::size_t g, const Slice& s) { return GroupName(c, g) + " " + s.name; },
      /*richardson=*/false);
}

// Llama, whole, in double: every slice of every group against central differences, with
// grouped-query attention and llama3 rope scaling, tied and untied.
// A Llama small enough to check by finite differences (head_dim x heads may differ from
// hidden, as Hugging Face configs with head_dim allow).
HfConfig SmallLlama(std::size_t vocab, std::size_t hidden, std::size_t heads, std::size_t kv_heads,
                    std::size_t head_dim, std::size_t intermediate) {
  HfConfig c;
  c.arch = Arch::kLlama;
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = 2;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate = intermediate;
  c.max_positions = 64;
  c.norm_eps = 1e-5;
  return c;
}

void CheckLlamaGradients(bool tied) {
  HfConfig c = SmallLlama(11, 8, 4, 2, 4, 12);  // q is 16 wide, the stream 8
  c.rope_theta = 500000;
  c.rope.llama3 = true;
  c.rope.factor = 32;
  c.rope.original_max_position_embeddings = 16;  // so the short test sequence sees every band
  c.tie_embeddings = tied;
  const std::size_t batch = 2, seq = 6, groups = LlamaGroupCount(c), head = groups - 1;
  memascend::KernelThreads threads(2);
  Llama<double> model(c, batch, seq, &threads);
  std::vector<Vec> params = CheckParams(
      groups, [&](std::size_t g) { return LlamaGroupParams(c, g); },
      [&](std::size_t g, float* f) { InitLlamaGroup(c, g, 7, f); });
  std::vector<std::int32_t> tokens, targets;
  CheckTokens(batch * seq, c.vocab, &tokens, &targets);
  auto forward = [&](std::vector<Vec>* grads) {
    model.Embed(params[0].data(), tokens.data());
    for (std::size_t l = 0; l < c.layers; ++l) model.Block(l, params[l + 1].data());
    const double loss =
        model.Head(params[head].data(), params[0].data(), targets.data(), 1.0, grads != nullptr);
    if (grads != nullptr) {
      model.HeadGradient((*grads)[head].data(), 0, (*grads)[head].size());
      for (std::size_t l = c.layers; l-- > 0;)
        model.BlockBackward(l, params[l + 1].data(), (*grads)[l + 1].data());
      model.EmbedGradient((*grads)[0].data(), 0, (*grads)[0].size());
    }
    return loss;
  };
  ExpectGroupGradients(
      params, forward, [&](std::size_t g) { return LlamaGroupLayout(c, g); },
      [&](std::size_t g, const Slice& s) {
        return LlamaTensorName(c, g, s) + (tied ? " (tied)" : "");
      },
      /*richardson=*/true);
  // Range by range, the embeddings' gradient (with the tied head's share) has the bits
  // of the whole.
  Vec whole(params[0].size()), parts(params[0].size());
  model.EmbedGradient(whole.data(), 0, whole.size());
  for (std::size_t at = 0; at < parts.size(); at += 13)
    model.EmbedGradient(parts.data() + at, at, std::min(parts.size(), at + 13));
  EXPECT_EQ(whole, parts);
}

TEST(Gradients, LlamaWholeModelEveryGroupUntied) { CheckLlamaGradients(false); }
TEST(Gradients, LlamaWholeModelEveryGroupTied) { CheckLlamaGradients(true); }

// Every group's initial parameters.
std::vector<std::vector<float>> InitialParams(const ModelConfig& c, std::uint64_t seed) {
  std::vector<std::vector<float>> params(GroupCount(c));
  for (std::size_t g = 0; g < params.size(); ++g) {
    params[g].resize(GroupParams(c, g));
    InitGroup(c, g, seed, params[g].data());
  }
  return params;
}

// Checkpointed activations: each block's input kept by the caller and the block
// recomputed before its backward pass give the bits of the model that kept everything,
// for both architectures, on the exact path and (where built) the BLAS one.
TEST(Network, RecomputedBlocksGiveTheBitsOfKeptActivations) {
  HfConfig llama = SmallLlama(29, 16, 4, 2, 3, 24);
  llama.tie_embeddings = true;
  const ModelConfig gpt{
      .vocab = 29, .seq = 7, .channels = 16, .layers = 3, .heads = 2, .batch = 2, .hf = {}};
  memascend::KernelThreads threads(2);
  for (const ModelConfig& c : {ForHf(llama, 2, 7), gpt}) {
    const std::size_t groups = GroupCount(c), head = groups - 1, rows = c.batch * c.seq;
    const std::vector<std::vector<float>> params = InitialParams(c, 5);
    std::vector<std::int32_t> tokens, targets;
    CheckTokens(rows, c.vocab, &tokens, &targets);
    for (const bool blas : {false, true}) {
      if (blas && !blas::Available()) continue;
      auto run = [&](bool checkpoint, double* loss) {
        const std::unique_ptr<Network> m = MakeNetwork(c, {blas, checkpoint}, &threads);
        std::vector<std::vector<float>> inputs(c.layers), grads(groups);
        for (std::size_t g = 0; g < groups; ++g) grads[g].assign(params[g].size(), 0.0f);
        m->Embed(params[0].data(), tokens.data());
        for (std::size_t l = 0; l < c.layers; ++l) {
          inputs[l].assign(m->Residual(), m->Residual() + rows * c.channels);
          m->Block(l, params[l + 1].data());
        }
        *loss = m->Head(params[head].data(), params[0].data(), targets.data(), 8.0f, true);
        m->HeadGradient(grads[head].data(), 0, grads[head].size());
        for (std::size_t l = c.layers; l-- > 0;) {
          if (checkpoint) m->Recompute(l, params[l + 1].data(), inputs[l].data());
          m->BlockBackward(l, params[l + 1].data(), grads[l + 1].data());
        }
        m->EmbedGradient(grads[0].data(), 0, grads[0].size());
        return grads;
      };
      double kept_loss = 0, recomputed_loss = 0;
      const auto kept = run(false, &kept_loss);
      const auto recomputed = run(true, &recomputed_loss);
      EXPECT_EQ(kept_loss, recomputed_loss) << ArchName(c);
      for (std::size_t g = 0; g < groups; ++g)
        EXPECT_EQ(kept[g], recomputed[g]) << ArchName(c) << " group " << g << " blas " << blas;
      EXPECT_NE(std::count(kept[1].begin(), kept[1].end(), 0.0f),
                static_cast<std::ptrdiff_t>(kept[1].size()));
    }
  }
}

// The trainer keeps tied embeddings in 16 bits and hands them to Embed and Head a chunk of
// rows at a time (MatrixRows; Note [tied head] in run.h). On the exact path that gives the
// bits of the whole matrix: the loss, the logits and every gradient; through the BLAS the
// products are split, so the same to rounding. Chunks of 1 row, 4 rows and more rows than
// the vocabulary; Llama and GPT-2 (whose embeddings' group holds the positions' rows
// too).
TEST(Network, TiedEmbeddingsReadAChunkAtATimeGiveTheWholeMatrixsResults) {
  HfConfig llama = SmallLlama(29, 16, 4, 2, 4, 24);
  llama.tie_embeddings = true;
  HfConfig gpt2 = llama;
  gpt2.arch = Arch::kGpt2;
  gpt2.kv_heads = gpt2.heads = 2;
  gpt2.head_dim = 8;
  gpt2.intermediate = 64;
  gpt2.max_positions = 16;
  memascend::KernelThreads threads(2);
  for (const ModelConfig& c : {ForHf(llama, 2, 7), ForHf(gpt2, 2, 7)}) {
    ASSERT_TRUE(TiedHead(c));
    const std::size_t groups = GroupCount(c), head = groups - 1, rows = c.batch * c.seq;
    const std::vector<std::vector<float>> params = InitialParams(c, 5);
    std::vector<std::int32_t> tokens, targets;
    CheckTokens(rows, c.vocab, &tokens, &targets);
    for (const bool blas : {false, true}) {
      if (blas && !blas::Available()) continue;
      // chunk 0: the whole matrix.
      auto run = [&](std::size_t chunk, double* loss, std::size_t* reads) {
        const std::unique_ptr<Network> m = MakeNetwork(c, {blas, false}, &threads);
        std::vector<float> buffer(chunk * c.channels);
        MatrixRows<float> embed(params[0].data());
        if (chunk > 0) {
          embed = MatrixRows<float>(
              [&](std::size_t b, std::size_t e) {
                EXPECT_LE(e - b, chunk);
                ++*reads;
                std::fill(buffer.begin(), buffer.end(), NAN);  // what the last read left
                std::copy(params[0].begin() + static_cast<std::ptrdiff_t>(b * c.channels),
                          params[0].begin() + static_cast<std::ptrdiff_t>(e * c.channels),
                          buffer.begin());
                return static_cast<const float*>(buffer.data());
              },
              chunk);
        }
        std::vector<std::vector<float>> grads(groups);
        for (std::size_t g = 0; g < groups; ++g) grads[g].assign(params[g].size(), 0.0f);
        m->Embed(embed, tokens.data());
        for (std::size_t l = 0; l < c.layers; ++l) m->Block(l, params[l + 1].data());
        *loss = m->Head(params[head].data(), embed, targets.data(), 8.0f, true);
        m->HeadGradient(grads[head].data(), 0, grads[head].size());
        for (std::size_t l = c.layers; l-- > 0;)
          m->BlockBackward(l, params[l + 1].data(), grads[l + 1].data());
        m->EmbedGradient(grads[0].data(), 0, grads[0].size());
        return grads;
      };
      double whole_loss = 0;
      std::size_t none = 0;
      const auto whole = run(0, &whole_loss, &none);
      for (const std::size_t chunk : {1u, 4u, 64u}) {
        double loss = 0;
        std::size_t reads = 0;
        const auto chunked = run(chunk, &loss, &reads);
        // Embed reads each token's row (GPT-2: and each position's), Head each chunk of
        // the vocabulary twice (forward, then backward).
        const std::size_t embed_reads = (IsLlama(c) ? 1 : 2) * rows;
        EXPECT_EQ(reads, embed_reads + 2 * ((c.vocab + chunk - 1) / chunk));
        const std::string what = fmt::format("{} chunk {} blas {}", ArchName(c), chunk, blas);
        if (!blas) {
          EXPECT_EQ(loss, whole_loss) << what;
          for (std::size_t g = 0; g < groups; ++g) EXPECT_EQ(chunked[g], whole[g]) << what;
          continue;
        }
        EXPECT_NEAR(loss, whole_loss, 1e-5 * std::abs(whole_loss)) << what;
        for (std::size_t g = 0; g < groups; ++g) {
          for (std::size_t k = 0; k < whole[g].size(); ++k) {
            ASSERT_NEAR(chunked[g][k], whole[g][k], 1e-4f * (1.0f + std::abs(whole[g][k])))
                << what << " group " << g << " [" << k << "]";
          }
        }
      }
    }
  }
}

// Through the BLAS too (blas.h: fixed tiles of rows, so the vocabulary spans several).
void CheckRanges(bool blas) {
  const ModelConfig c{
      .vocab = 150, .seq = 5, .channels = 12, .layers = 1, .heads = 2, .batch = 3, .hf = {}};
  memascend::KernelThreads threads(2);
  Gpt<float> model(c, &threads, blas);
  std::vector<std::vector<float>> params(GroupCount(c));
  for (std::size_t g = 0; g < GroupCount(c); ++g) {
    params[g].resize(GroupParams(c, g));
    InitGroup(c, g, 3, params[g].data());
  }
  std::vector<std::int32_t> tokens(c.batch * c.seq), targets(c.batch * c.seq);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 11 + 2) % c.vocab);
    targets[i] = static_cast<std::int32_t>((i * 3 + 1) % c.vocab);
  }
  const std::size_t head = GroupCount(c) - 1;
  model.Embed(params[0].data(), tokens.data());
  model.Block(0, params[1].data());
  std::vector<float> whole_head(GroupParams(c, head), -1.0f);
  model.Head(params[head].data(), nullptr, targets.data(), 1024.0f, /*backward=*/true);
  model.HeadGradient(whole_head.data(), 0, whole_head.size());
  std::vector<float> block(GroupParams(c, 1), 0.0f);
  model.BlockBackward(0, params[1].data(), block.data());
  std::vector<float> whole_embed(GroupParams(c, 0), -1.0f);
  model.EmbedGradient(whole_embed.data(), 0, whole_embed.size());
  // The same backward pass's gradients again, in ranges of 7 and of 50 elements.
  for (const std::size_t step : {7u, 50u}) {
    std::vector<float> part(step);
    for (std::size_t b = 0; b < whole_head.size(); b += step) {
      const std::size_t e = std::min(whole_head.size(), b + step);
      std::fill(part.begin(), part.end(), 9.0f);  // overwritten, not added to
      model.HeadGradient(part.data(), b, e);
      for (std::size_t k = b; k < e; ++k) ASSERT_EQ(part[k - b], whole_head[k]) << "head " << k;
    }
    for (std::size_t b = 0; b < whole_embed.size(); b += step) {
      const std::size_t e = std::min(whole_embed.size(), b + step);
      std::fill(part.begin(), part.end(), 9.0f);
      model.EmbedGradient(part.data(), b, e);
      for (std::size_t k = b; k < e; ++k) ASSERT_EQ(part[k - b], whole_embed[k]) << "embed " << k;
    }
  }
  // The gradient is a real one: not all zero, and the embeddings' rows of tokens never
  // seen are zero.
  EXPECT_NE(std::count(whole_head.begin(), whole_head.end(), 0.0f),
            static_cast<std::ptrdiff_t>(whole_head.size()));
  std::vector<bool> seen(c.vocab, false);
  for (std::int32_t t : tokens) seen[static_cast<std::size_t>(t)] = true;
  for (std::size_t v = 0; v < c.vocab; ++v) {
    if (seen[v]) continue;
    for (std::size_t k = 0; k < c.channels; ++k) EXPECT_EQ(whole_embed[v * c.channels + k], 0.0f);
  }

  if (blas) return;  // the rest checks the exact loops against sums written out here
  // The split product against the fused one, and the logits' gradient in place.
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n01;
  const std::size_t rows = 9, in_f = 10, out_f = 7;
  std::vector<float> dout(rows * out_f), in(rows * in_f), w(out_f * in_f);
  for (auto* v : {&dout, &in, &w}) {
    for (float& x : *v) x = n01(rng);
  }
  // The reference: the fused loops MatmulBackward had, each element summed in row order.
  std::vector<float> din_ref(rows * in_f, 0.0f), dw_ref(out_f * in_f, 0.0f), db_ref(out_f, 0.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t o = 0; o < out_f; ++o) {
      for (std::size_t i = 0; i < in_f; ++i)
        din_ref[r * in_f + i] += dout[r * out_f + o] * w[o * in_f + i];
    }
  }
  for (std::size_t o = 0; o < out_f; ++o) {
    for (std::size_t r = 0; r < rows; ++r) {
      db_ref[o] += dout[r * out_f + o];
      for (std::size_t i = 0; i < in_f; ++i)
        dw_ref[o * in_f + i] += dout[r * out_f + o] * in[r * in_f + i];
    }
  }
  std::vector<float> din(rows * in_f, 0.0f), dw(out_f * in_f, 0.0f), db(out_f, 0.0f);
  ops::MatmulBackward(din.data(), dw.data(), db.data(), dout.data(), in.data(), w.data(), rows,
                      in_f, out_f, &threads);
  EXPECT_EQ(din, din_ref);
  EXPECT_EQ(dw, dw_ref);
  EXPECT_EQ(db, db_ref);
  std::vector<float> dw2(out_f * in_f, 0.0f);
  for (std::size_t b = 0; b < dw2.size(); b += 13)
    ops::MatmulWeightGradientRange(dw2.data() + b, dout.data(), in.data(), rows, in_f, out_f, b,
                                   b + 13, &threads);
  EXPECT_EQ(dw2, dw_ref);
  std::vector<float> logits(rows * out_f), scratch(rows);
  for (float& x : logits) x = 3.0f * n01(rng);
  const std::vector<std::int32_t> y = {0, 6, 2, 2, 5, 1, 3, 4, 0};
  std::vector<float> d(logits.size());
  const double loss = ops::CrossEntropy(d.data(), logits.data(), y.data(), rows, out_f, 8.0f,
                                        &threads, scratch.data());
  EXPECT_EQ(ops::CrossEntropy(logits.data(), logits.data(), y.data(), rows, out_f, 8.0f, &threads,
                              scratch.data()),
            loss);
  EXPECT_EQ(logits, d);
}

TEST(Gradients, RangesGiveTheBitsOfTheWhole) { CheckRanges(false); }

TEST(Gradients, RangesThroughTheBlasGiveTheBitsOfTheWhole) {
  if (!blas::Available()) GTEST_SKIP() << "built without a BLAS (libopenblas-dev)";
  CheckRanges(true);
}

TEST(Model, LayoutAndInitialisation) {
  ModelConfig c;  // the defaults: 4 x 128, vocab 256, seq 64
  EXPECT_EQ(GroupCount(c), 6u);
  EXPECT_EQ(GroupParams(c, 0), 256u * 128 + 64u * 128);
  EXPECT_EQ(GroupParams(c, 1), 12u * 128 * 128 + 13u * 128);
  EXPECT_EQ(GroupParams(c, 5), 2u * 128 + 256u * 128);
  EXPECT_EQ(GroupName(c, 3), "block.2");
  std::vector<float> a(GroupParams(c, 1)), b(GroupParams(c, 1));
  InitGroup(c, 1, 5, a.data());
  InitGroup(c, 1, 5, b.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[0], 1.0f);  // ln1 gain
  double sq = 0;
  const Slice qkv = GroupLayout(c, 1)[2];
  for (std::size_t i = 0; i < qkv.count; ++i)
    sq += double{a[qkv.offset + i]} * double{a[qkv.offset + i]};
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(qkv.count)), 0.02, 0.001);
  ModelConfig bad = c;
  bad.heads = 3;
  EXPECT_FALSE(Validate(bad).ok());
}

// A group made a range at a time (Run::Init, a part at a time) has the bits of the group
// made whole: ranges inside a slice, across slices, and over gains and biases that draw
// nothing, for both architectures.
TEST(Model, AnInitialisationMadeRangeByRangeIsTheWholeOne) {
  HfConfig llama = SmallLlama(29, 16, 4, 2, 4, 24);
  for (const ModelConfig& c : {ModelConfig{}, ForHf(llama, 2, 7)}) {
    for (std::size_t g = 0; g < GroupCount(c); ++g) {
      const std::size_t n = GroupParams(c, g);
      std::vector<float> whole(n);
      InitGroup(c, g, 11, whole.data());
      for (const std::size_t step : {std::size_t{1}, std::size_t{97}, n / 3 + 1}) {
        std::vector<float> ranged(n, NAN);
        for (std::size_t b = 0; b < n; b += step)
          InitGroupRange(c, g, 11, b, std::min(n, b + step), ranged.data() + b);
        ASSERT_EQ(ranged, whole) << ArchName(c) << " group " << g << " step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace offload_train
