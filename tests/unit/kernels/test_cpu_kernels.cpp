// CPU kernels against straightforward double-precision references, for every weight dtype and for the row
// counts that take the direct (decode) path and the sgemm (prefill) path.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/weight_convert.h"

namespace capserve::kernels::cpu {
namespace {

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0F, 1.0F);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A weight stored in `dtype`, plus the exact float values it holds.
struct StoredWeight {
  std::vector<std::byte> bytes;
  std::vector<float> values;
  Tensor view;
};

std::uint16_t to_bf16(float f) {
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16);
}

// Rounds to the nearest f16 by search over the exact decoder (test-only; inputs are small normals).
std::uint16_t to_f16(float f) {
  std::uint16_t best = 0;
  float err = INFINITY;
  const std::uint16_t sign = f < 0 ? 0x8000 : 0;
  for (std::uint32_t h = 0; h < 0x7C00; ++h) {
    const float e = std::fabs(f16_to_f32(static_cast<std::uint16_t>(h | sign)) - f);
    if (e < err) {
      err = e;
      best = static_cast<std::uint16_t>(h | sign);
    }
  }
  return best;
}

StoredWeight make_weight(DType dtype, std::int64_t rows, std::int64_t cols, unsigned seed) {
  StoredWeight w;
  const std::vector<float> src = random_vector(static_cast<std::size_t>(rows * cols), seed);
  w.bytes.resize(src.size() * dtype_size(dtype));
  w.values.resize(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(w.bytes.data() + i * 4, &src[i], 4);
      w.values[i] = src[i];
    } else {
      const std::uint16_t h = dtype == DType::bf16 ? to_bf16(src[i]) : to_f16(src[i]);
      std::memcpy(w.bytes.data() + i * 2, &h, 2);
      w.values[i] = dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
  w.view = weight_tensor({dtype, w.bytes.data(), rows, cols});
  return w;
}

TEST(WeightConvert, F16SpecialValues) {
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0F);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0F);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0F, -24));
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0F);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7C00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0F);
}

class LinearTest : public ::testing::TestWithParam<std::tuple<DType, std::int64_t>> {};

TEST_P(LinearTest, MatchesReference) {
  const auto [dtype, m] = GetParam();
  const std::int64_t k = 70;  // not a multiple of the kernel's lane count
  const std::int64_t n = 45;
  const StoredWeight w = make_weight(dtype, n, k, 1);
  const StoredWeight bias = make_weight(dtype, 1, n, 2);
  const std::vector<float> x = random_vector(static_cast<std::size_t>(m * k), 3);
  std::vector<float> y(static_cast<std::size_t>(m * n));
  CpuBackend backend(2);
  backend.linear(Tensor::host(std::span(x), {m, k}), w.view, bias.view, Tensor::host(std::span(y), {m, n}));
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = bias.values[static_cast<std::size_t>(j)];
      for (std::int64_t i = 0; i < k; ++i)
        ref += static_cast<double>(x[static_cast<std::size_t>(r * k + i)]) *
               w.values[static_cast<std::size_t>(j * k + i)];
      EXPECT_NEAR(y[static_cast<std::size_t>(r * n + j)], ref, 1e-4 * (1.0 + std::fabs(ref)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypesAndRows, LinearTest,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Values<std::int64_t>(1, 3, 5, 32, 33, 100)));

TEST(CpuKernels, RmsNorm) {
  const std::int64_t cols = 24;
  const std::vector<float> x = random_vector(3 * cols, 4);
  const StoredWeight g = make_weight(DType::bf16, 1, cols, 5);
  std::vector<float> y(x.size());
  CpuBackend(1).rms_norm(Tensor::host(std::span(x), {3, cols}), g.view, 1e-5F,
                         Tensor::host(std::span(y), {3, cols}));
  for (std::int64_t r = 0; r < 3; ++r) {
    double ss = 0;
    for (std::int64_t i = 0; i < cols; ++i)
      ss += x[static_cast<std::size_t>(r * cols + i)] * x[static_cast<std::size_t>(r * cols + i)];
    const double inv = 1.0 / std::sqrt(ss / cols + 1e-5);
    for (std::int64_t i = 0; i < cols; ++i) {
      const auto at = static_cast<std::size_t>(r * cols + i);
      EXPECT_NEAR(y[at], g.values[static_cast<std::size_t>(i)] * x[at] * inv, 1e-5);
    }
  }
}

TEST(CpuKernels, RopeRotatesHalves) {
  std::vector<float> x = {1.0F, 2.0F, 3.0F, 4.0F};  // one token, one head, head_dim 4
  const std::vector<float> cos = {0.0F, 1.0F};
  const std::vector<float> sin = {1.0F, 0.0F};
  CpuBackend(1).rope(Tensor::host(std::span(x), {1, 4}), {1, 4, 0, 4, false},
                     Tensor::host(std::span(cos), {1, 2}), Tensor::host(std::span(sin), {1, 2}));
  // pair (x0, x2) rotated by 90 degrees, pair (x1, x3) unchanged
  EXPECT_FLOAT_EQ(x[0], -3.0F);
  EXPECT_FLOAT_EQ(x[2], 1.0F);
  EXPECT_FLOAT_EQ(x[1], 2.0F);
  EXPECT_FLOAT_EQ(x[3], 4.0F);
}

TEST(CpuKernels, RopeInterleavedPairsAfterAnOffset) {
  // one token, two heads of 6: dims [2, 6) rotate as pairs (2, 3) and (4, 5)
  std::vector<float> x = {1.0F, 2.0F, 3.0F, 4.0F, 5.0F, 6.0F, 7.0F, 8.0F, 9.0F, 10.0F, 11.0F, 12.0F};
  const std::vector<float> cos = {0.0F, 1.0F};
  const std::vector<float> sin = {1.0F, 0.0F};
  CpuBackend(1).rope(Tensor::host(std::span(x), {1, 12}), {2, 6, 2, 4, true},
                     Tensor::host(std::span(cos), {1, 2}), Tensor::host(std::span(sin), {1, 2}));
  const std::vector<float> want = {1.0F, 2.0F, -4.0F,  3.0F, 5.0F,  6.0F,
                                   7.0F, 8.0F, -10.0F, 9.0F, 11.0F, 12.0F};
  EXPECT_EQ(x, want);
}

// Multi-head latent attention in either form, and in the per-sequence cheaper one, equals DeepSeek-V2's
// attention written out: per head keys [W_uk c | rope key] and values W_uv c of every cached latent, causal
// softmax. One call holds a prefill chunk behind cached context and a decode token, over scattered blocks.
TEST(CpuKernels, LatentAttentionFormsMatchExpandedReference) {
  const std::int64_t heads = 3, dn = 6, dr = 4, dv = 5, r = 8, block = 4;
  const std::int64_t qk = dn + dr;
  const float scale = 0.35F;
  const StoredWeight kv_b = make_weight(DType::bf16, heads * (dn + dv), r, 20);
  const std::vector<std::int32_t> table0 = {3, 0, 5};
  const std::vector<std::int32_t> table1 = {1, 6, 2};
  const std::int64_t context[2] = {11, 10};
  std::vector<float> pool(static_cast<std::size_t>(8 * block * (r + dr)));
  const PagedLatentLayer cache{Tensor::host(std::span(pool), {8, block, r + dr}), block, r, dr};
  CpuBackend backend(2);
  std::vector<std::vector<float>> latents, rope_keys;
  for (int s = 0; s < 2; ++s) {
    latents.push_back(random_vector(static_cast<std::size_t>(context[s] * r), 21 + s));
    rope_keys.push_back(random_vector(static_cast<std::size_t>(context[s] * dr), 23 + s));
    const SequenceSlice all{0, context[s], 0, s == 0 ? table0 : table1};
    backend.latent_store(std::span(&all, 1), Tensor::host(std::span(latents.back()), {context[s], r}),
                         Tensor::host(std::span(rope_keys.back()), {context[s], dr}), cache);
  }
  // Sequence 0: its last 9 positions are new (a prefill chunk: the cheaper form expands it); sequence 1: its
  // last position (decode: the cheaper form absorbs).
  const std::vector<SequenceSlice> seqs = {{0, 9, context[0] - 9, table0}, {9, 1, context[1] - 1, table1}};
  const std::vector<float> q = random_vector(static_cast<std::size_t>(10 * heads * qk), 25);

  std::vector<double> want(static_cast<std::size_t>(10 * heads * dv));
  for (int si = 0; si < 2; ++si) {
    const SequenceSlice& s = seqs[static_cast<std::size_t>(si)];
    const auto& c = latents[static_cast<std::size_t>(si)];
    const auto& kr = rope_keys[static_cast<std::size_t>(si)];
    for (std::int64_t i = 0; i < s.num_tokens; ++i) {
      const std::int64_t row = s.first_row + i;
      for (std::int64_t h = 0; h < heads; ++h) {
        const auto w = [&](std::int64_t out, std::int64_t in) {
          return static_cast<double>(kv_b.values[static_cast<std::size_t>((h * (dn + dv) + out) * r + in)]);
        };
        const float* qh = q.data() + (row * heads + h) * qk;
        std::vector<double> score;
        for (std::int64_t p = 0; p <= s.start_pos + i; ++p) {
          double dot = 0;
          for (std::int64_t e = 0; e < dn; ++e) {
            double k = 0;
            for (std::int64_t j = 0; j < r; ++j) k += w(e, j) * c[static_cast<std::size_t>(p * r + j)];
            dot += qh[e] * k;
          }
          for (std::int64_t e = 0; e < dr; ++e) dot += qh[dn + e] * kr[static_cast<std::size_t>(p * dr + e)];
          score.push_back(dot * scale);
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (double& x : score) sum += (x = std::exp(x - mx));
        for (std::int64_t e = 0; e < dv; ++e) {
          double acc = 0;
          for (std::size_t p = 0; p < score.size(); ++p) {
            double v = 0;
            for (std::int64_t j = 0; j < r; ++j)
              v += w(dn + e, j) * c[p * static_cast<std::size_t>(r) + static_cast<std::size_t>(j)];
            acc += score[p] / sum * v;
          }
          want[static_cast<std::size_t>((row * heads + h) * dv + e)] = acc;
        }
      }
    }
  }
  for (const LatentForm form : {LatentForm::absorbed, LatentForm::expanded, LatentForm::cheaper}) {
    std::vector<float> out(want.size());
    backend.latent_attention(seqs, Tensor::host(std::span(q), {10, heads * qk}), cache, kv_b.view,
                             {heads, dn, dr, dv, scale, form},
                             Tensor::host(std::span(out), {10, heads * dv}));
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(out[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << "form " << static_cast<int>(form);
  }
}

// Paged attention over a scattered block table equals dense causal (and sliding-window) attention.
TEST(CpuKernels, PagedAttentionMatchesDense) {
  const std::int64_t heads = 4, kv_heads = 2, d = 8, block = 4, tokens = 11;
  for (const std::int64_t window : {0, 5}) {
    const std::vector<float> q = random_vector(static_cast<std::size_t>(tokens * heads * d), 6);
    const std::vector<float> k = random_vector(static_cast<std::size_t>(tokens * kv_heads * d), 7);
    const std::vector<float> v = random_vector(static_cast<std::size_t>(tokens * kv_heads * d), 8);
    std::vector<float> kc(static_cast<std::size_t>(8 * block * kv_heads * d)), vc(kc.size());
    const std::vector<std::int32_t> table = {5, 2, 7};  // deliberately out of order
    const PagedKvLayer cache{Tensor::host(std::span(kc), {8, block, kv_heads, d}),
                             Tensor::host(std::span(vc), {8, block, kv_heads, d}), block, kv_heads, d};
    const std::vector<SequenceSlice> seqs = {{0, tokens, 0, table}};
    CpuBackend backend(2);
    backend.kv_store(seqs, Tensor::host(std::span(k), {tokens, kv_heads * d}),
                     Tensor::host(std::span(v), {tokens, kv_heads * d}), cache);
    std::vector<float> out(q.size());
    backend.paged_attention(seqs, Tensor::host(std::span(q), {tokens, heads * d}), cache,
                            {heads, 0.3F, window}, Tensor::host(std::span(out), {tokens, heads * d}));
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t g = h / (heads / kv_heads);
        const std::int64_t lo = window > 0 ? std::max<std::int64_t>(0, t - window + 1) : 0;
        std::vector<double> w;
        double mx = -1e300;
        for (std::int64_t p = lo; p <= t; ++p) {
          double dot = 0;
          for (std::int64_t e = 0; e < d; ++e)
            dot += q[static_cast<std::size_t>((t * heads + h) * d + e)] *
                   k[static_cast<std::size_t>((p * kv_heads + g) * d + e)];
          w.push_back(dot * 0.3);
          mx = std::max(mx, w.back());
        }
        double sum = 0;
        for (double& x : w) sum += (x = std::exp(x - mx));
        for (std::int64_t e = 0; e < d; ++e) {
          double ref = 0;
          for (std::int64_t p = lo; p <= t; ++p)
            ref += w[static_cast<std::size_t>(p - lo)] / sum *
                   v[static_cast<std::size_t>((p * kv_heads + g) * d + e)];
          EXPECT_NEAR(out[static_cast<std::size_t>((t * heads + h) * d + e)], ref, 1e-5)
              << "window " << window;
        }
      }
    }
  }
}

TEST(CpuKernels, GroupedExpertFfnMatchesPerExpertSwiGlu) {
  const std::int64_t hidden = 20, ffn = 12;
  const std::vector<std::int64_t> offsets = {0, 3, 3, 40};  // expert 1 receives nothing
  std::vector<StoredWeight> store;
  std::vector<ExpertWeights> experts;
  for (unsigned e = 0; e < 3; ++e) {
    store.push_back(make_weight(DType::bf16, ffn, hidden, 10 + 3 * e));
    store.push_back(make_weight(DType::bf16, ffn, hidden, 11 + 3 * e));
    store.push_back(make_weight(DType::bf16, hidden, ffn, 12 + 3 * e));
  }
  for (std::size_t e = 0; e < 3; ++e)
    experts.push_back({store[3 * e].view, store[3 * e + 1].view, store[3 * e + 2].view});
  const std::vector<float> x = random_vector(static_cast<std::size_t>(40 * hidden), 9);
  std::vector<float> out(x.size());
  CpuBackend(2).grouped_expert_ffn(Tensor::host(std::span(x), {40, hidden}), offsets, experts,
                                   Tensor::host(std::span(out), {40, hidden}));
  for (std::size_t e = 0; e < 3; ++e) {
    for (std::int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      std::vector<double> act(static_cast<std::size_t>(ffn));
      for (std::int64_t f = 0; f < ffn; ++f) {
        double g = 0, u = 0;
        for (std::int64_t i = 0; i < hidden; ++i) {
          g += x[static_cast<std::size_t>(r * hidden + i)] *
               store[3 * e].values[static_cast<std::size_t>(f * hidden + i)];
          u += x[static_cast<std::size_t>(r * hidden + i)] *
               store[3 * e + 1].values[static_cast<std::size_t>(f * hidden + i)];
        }
        act[static_cast<std::size_t>(f)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (std::int64_t i = 0; i < hidden; ++i) {
        double ref = 0;
        for (std::int64_t f = 0; f < ffn; ++f)
          ref += act[static_cast<std::size_t>(f)] *
                 store[3 * e + 2].values[static_cast<std::size_t>(i * ffn + f)];
        EXPECT_NEAR(out[static_cast<std::size_t>(r * hidden + i)], ref, 1e-4 * (1 + std::fabs(ref)));
      }
    }
  }
}

}  // namespace
}  // namespace capserve::kernels::cpu
