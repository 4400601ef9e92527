// Rope's per-step tables: dynamic (NTK) scaling recomputes the frequencies per sequence of the step, from
// that sequence's own length only.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "runtime/rope.h"

namespace capserve::runtime {
namespace {

constexpr std::int64_t kDim = 16;
constexpr double kTheta = 10000.0;
constexpr std::int64_t kMax = 16;
constexpr double kFactor = 4.0;

RopeScaling dynamic_scaling() {
  RopeScaling s;
  s.type = RopeScaling::Type::dynamic;
  s.factor = kFactor;
  s.original_max_position_embeddings = static_cast<double>(kMax);
  return s;
}

// The rows [first, first + n) of a step whose positions continue a sequence from `start`.
kernels::SequenceSlice slice(std::int64_t first, std::int64_t n, std::int64_t start,
                             std::vector<std::int32_t>& positions) {
  for (std::int64_t i = 0; i < n; ++i) positions.push_back(static_cast<std::int32_t>(start + i));
  return {first, n, start, {}};
}

struct Tables {
  std::vector<float> cos, sin, scratch;
};

Tables run(const Rope& rope, const std::vector<std::int32_t>& positions,
           const std::vector<kernels::SequenceSlice>& seqs,
           const std::vector<std::uint8_t>& decode_rows = {}) {
  Tables t;
  rope.tables(positions, seqs, decode_rows, t.cos, t.sin, t.scratch);
  return t;
}

// transformers' formula in double: close to its float32 result, independent of Rope's code.
double ntk_inv_freq(std::int64_t seq_len, std::int64_t i) {
  const double base =
      kTheta * std::pow(kFactor * static_cast<double>(seq_len) / static_cast<double>(kMax) - (kFactor - 1.0),
                        static_cast<double>(kDim) / static_cast<double>(kDim - 2));
  return 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(kDim));
}

// transformers 5.23's own values (_compute_dynamic_ntk_parameters of this config, seq_len a tensor as in
// dynamic_rope_update), bit for bit.
TEST(Rope, DynamicFrequenciesAreTransformersBitForBit) {
  const Rope rope(kDim, kTheta, dynamic_scaling());
  std::vector<float> got(kDim / 2);
  rope.dynamic_inv_freq(20, got);
  EXPECT_EQ(got, (std::vector<float>{0x1p+0F, 0x1.2549f6p-2F, 0x1.500266p-4F, 0x1.80f3d4p-6F, 0x1.b9064cp-8F,
                                     0x1.f943ap-10F, 0x1.216e32p-11F, 0x1.4b96cp-13F}));
  rope.dynamic_inv_freq(41, got);
  EXPECT_EQ(got, (std::vector<float>{0x1p+0F, 0x1.e8015cp-3F, 0x1.d12292p-5F, 0x1.bb563p-7F, 0x1.a68f5p-9F,
                                     0x1.92c1b8p-11F, 0x1.7fe1b4p-13F, 0x1.6de424p-15F}));
}

TEST(Rope, DynamicUpToTheOriginalMaximumIsThePlainRope) {
  const Rope dynamic(kDim, kTheta, dynamic_scaling());
  const Rope plain(kDim, kTheta, RopeScaling{});
  std::vector<std::int32_t> positions;
  const std::vector<kernels::SequenceSlice> seqs{slice(0, kMax, 0, positions)};
  const Tables a = run(dynamic, positions, seqs);
  const Tables b = run(plain, positions, seqs);
  EXPECT_EQ(a.cos, b.cos);
  EXPECT_EQ(a.sin, b.sin);
}

TEST(Rope, DynamicAboveTheMaximumUsesTheSequencesOwnLength) {
  const Rope rope(kDim, kTheta, dynamic_scaling());
  const Rope plain(kDim, kTheta, RopeScaling{});
  // One step: a short prefill (positions 0..4), a decode token at position 40 (length 41) and a chunk
  // crossing the maximum (positions 12..19, length 20).
  std::vector<std::int32_t> positions;
  const std::vector<kernels::SequenceSlice> seqs{slice(0, 5, 0, positions), slice(5, 1, 40, positions),
                                                 slice(6, 8, 12, positions)};
  const Tables step = run(rope, positions, seqs);
  const std::size_t half = kDim / 2;
  const auto expect_rows = [&](std::size_t first, std::size_t n, std::int64_t seq_len) {
    for (std::size_t r = first; r < first + n; ++r) {
      for (std::size_t i = 0; i < half; ++i) {
        const double angle = positions[r] * ntk_inv_freq(seq_len, static_cast<std::int64_t>(i));
        EXPECT_NEAR(step.cos[r * half + i], std::cos(angle), 2e-5) << "row " << r << " pair " << i;
        EXPECT_NEAR(step.sin[r * half + i], std::sin(angle), 2e-5) << "row " << r << " pair " << i;
      }
    }
  };
  expect_rows(5, 1, 41);
  expect_rows(6, 8, 20);  // every row of the chunk, those under the maximum too
  // The short sequence keeps the plain frequencies, whatever else is in the step.
  std::vector<std::int32_t> short_positions;
  const Tables alone = run(plain, short_positions, {slice(0, 5, 0, short_positions)});
  EXPECT_EQ(std::vector<float>(step.cos.begin(), step.cos.begin() + 5 * half), alone.cos);
  EXPECT_EQ(std::vector<float>(step.sin.begin(), step.sin.begin() + 5 * half), alone.sin);
  // The scaling matters here: the long sequence's rows differ from the plain rope's.
  const Tables unscaled = run(plain, positions, seqs);
  EXPECT_GT(std::fabs(step.cos[5 * half + 3] - unscaled.cos[5 * half + 3]), 1e-2);
}

TEST(Rope, DynamicDecodeRowsWithDraftsTurnAsOneTokenStepsWould) {
  // A sampled token at position 30 and three drafts after it (speculative decoding), as decode rows: row j
  // gets the frequencies of length 31 + j, exactly the table of the one-token step at its position.
  const Rope rope(kDim, kTheta, dynamic_scaling());
  std::vector<std::int32_t> positions;
  const std::vector<kernels::SequenceSlice> seqs{slice(0, 4, 30, positions)};
  const Tables verify = run(rope, positions, seqs, std::vector<std::uint8_t>(4, 1));
  const std::size_t half = kDim / 2;
  for (std::size_t j = 0; j < 4; ++j) {
    std::vector<std::int32_t> one;
    const Tables step = run(rope, one, {slice(0, 1, 30 + static_cast<std::int64_t>(j), one)}, {1});
    EXPECT_EQ(std::vector<float>(verify.cos.begin() + static_cast<std::ptrdiff_t>(j * half),
                                 verify.cos.begin() + static_cast<std::ptrdiff_t>((j + 1) * half)),
              step.cos)
        << "draft row " << j;
    EXPECT_EQ(std::vector<float>(verify.sin.begin() + static_cast<std::ptrdiff_t>(j * half),
                                 verify.sin.begin() + static_cast<std::ptrdiff_t>((j + 1) * half)),
              step.sin)
        << "draft row " << j;
  }
  // As a prefill chunk the same rows share the length of the last one (transformers' one forward): row 0
  // differs.
  const Tables chunk = run(rope, positions, seqs);
  EXPECT_NE(std::vector<float>(chunk.cos.begin(), chunk.cos.begin() + static_cast<std::ptrdiff_t>(half)),
            std::vector<float>(verify.cos.begin(), verify.cos.begin() + static_cast<std::ptrdiff_t>(half)));
}

}  // namespace
}  // namespace capserve::runtime
