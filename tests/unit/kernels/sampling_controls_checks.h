#pragma once
// Backend::adjust_logits and Backend::sample's controls (bitmask, banned ids, logit_bias, presence /
// frequency / repetition penalties, min_p) against a straightforward reference of each, written from vLLM's
// definitions (vllm/model_executor/layers/utils.py apply_penalties; its min_p and logit_bias processors), on
// the same logits. Shared by the CPU backend's unit test and the CUDA backend's test (gpu and cuda-emu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace capserve::test {

using kernels::Backend;
using kernels::IndexRange;
using kernels::LogitBias;
using kernels::SampleControls;
using kernels::SampleInputs;
using kernels::Tensor;

inline constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Row r's logits adjusted as vLLM does: mask, banned (min_tokens), bias, then repetition (over prompt and
// output), frequency and presence (over the output).
inline std::vector<float> reference_adjusted(std::span<const float> raw, const SampleInputs& in,
                                             std::size_t r) {
  const SampleControls& c = in.controls[r];
  const auto vocab = static_cast<std::int64_t>(raw.size());
  std::vector<float> v(raw.begin(), raw.end());
  if (!in.allowed.empty()) {
    const std::int64_t words = (vocab + 31) / 32;
    for (std::int64_t i = 0; i < vocab; ++i) {
      const auto word = static_cast<std::uint32_t>(
          in.allowed[static_cast<std::size_t>(static_cast<std::int64_t>(r) * words + i / 32)]);
      if (((word >> (i % 32)) & 1U) == 0U) v[static_cast<std::size_t>(i)] = kMinusInf;
    }
  }
  for (std::int64_t j = c.banned.begin; j < c.banned.end; ++j)
    v[static_cast<std::size_t>(in.banned[static_cast<std::size_t>(j)])] = kMinusInf;
  for (std::int64_t j = c.bias.begin; j < c.bias.end; ++j) {
    const LogitBias& b = in.biases[static_cast<std::size_t>(j)];
    v[static_cast<std::size_t>(b.token)] += b.bias;
  }
  if (c.history.end > c.history.begin) {
    const auto history = in.history.subspan(static_cast<std::size_t>(c.history.begin),
                                            static_cast<std::size_t>(c.history.end - c.history.begin));
    const auto prompt = history.first(static_cast<std::size_t>(c.prompt_tokens));
    const auto output = history.subspan(static_cast<std::size_t>(c.prompt_tokens));
    for (std::int64_t i = 0; i < vocab; ++i) {
      float& l = v[static_cast<std::size_t>(i)];
      const auto count = static_cast<float>(std::count(output.begin(), output.end(), i));
      const bool seen = count > 0 || std::find(prompt.begin(), prompt.end(), i) != prompt.end();
      if (seen) l = l > 0 ? l / c.repetition_penalty : l * c.repetition_penalty;
      l -= c.frequency_penalty * count;
      l -= c.presence_penalty * (count > 0 ? 1.0F : 0.0F);
    }
  }
  return v;
}

// Which controls a case sets.
enum class Controls { bias, banned, presence, frequency, repetition, bitmask, all };

// A batch of random rows under the case's controls, the arrays it points into kept here.
struct RandomBatch {
  std::int64_t rows = 0, vocab = 0;
  std::vector<float> logits;
  std::vector<SampleControls> controls;
  std::vector<std::int32_t> history, banned, allowed;
  std::vector<LogitBias> biases;
  [[nodiscard]] SampleInputs inputs() const { return {controls, history, banned, biases, allowed}; }
};

inline RandomBatch random_batch(std::mt19937& rng, Controls which, std::int64_t rows, std::int64_t vocab) {
  RandomBatch b;
  b.rows = rows;
  b.vocab = vocab;
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(vocab - 1));
  // Few distinct ids in histories so that tokens repeat and prompt and output overlap.
  std::uniform_int_distribution<std::int32_t> common(0, 40);
  std::uniform_real_distribution<float> unit(0.0F, 1.0F);
  for (std::int64_t i = 0; i < rows * vocab; ++i) b.logits.push_back(normal(rng));
  const bool all = which == Controls::all;
  for (std::int64_t r = 0; r < rows; ++r) {
    SampleControls& c = b.controls.emplace_back();
    const auto at = [](const auto& v) { return static_cast<std::int64_t>(v.size()); };
    if (all || which == Controls::banned) {
      c.banned.begin = at(b.banned);
      for (int k = 0; k < 5; ++k)
        b.banned.push_back(
            k == 0 ? static_cast<std::int32_t>(
                         std::max_element(b.logits.begin() + r * vocab, b.logits.begin() + (r + 1) * vocab) -
                         (b.logits.begin() + r * vocab))
                   : id(rng));
      c.banned.end = at(b.banned);
    }
    if (all || which == Controls::bias) {
      c.bias.begin = at(b.biases);
      std::vector<std::int32_t> ids;
      while (ids.size() < 6) {
        const std::int32_t t = id(rng);
        if (std::find(ids.begin(), ids.end(), t) == ids.end()) ids.push_back(t);
      }
      for (std::size_t k = 0; k < ids.size(); ++k)
        b.biases.push_back(
            {ids[k], k == 0 ? 100.0F * (unit(rng) < 0.5F ? 1.0F : -1.0F) : 20.0F * (unit(rng) - 0.5F)});
      c.bias.end = at(b.biases);
    }
    const bool penalty =
        all || which == Controls::presence || which == Controls::frequency || which == Controls::repetition;
    if (all || which == Controls::presence) c.presence_penalty = 4.0F * unit(rng) - 2.0F;
    if (all || which == Controls::frequency) c.frequency_penalty = 4.0F * unit(rng) - 2.0F;
    if (all || which == Controls::repetition) c.repetition_penalty = 0.5F + 1.5F * unit(rng);
    if (penalty) {
      c.history.begin = at(b.history);
      c.prompt_tokens = 30;
      for (int k = 0; k < 30 + 300; ++k) b.history.push_back(k % 7 == 0 ? id(rng) : common(rng));
      c.history.end = at(b.history);
    }
  }
  if (all || which == Controls::bitmask) {
    const std::int64_t words = kernels::allowed_words(vocab);
    std::uniform_int_distribution<std::uint32_t> bits;
    for (std::int64_t i = 0; i < rows * words; ++i)
      b.allowed.push_back(static_cast<std::int32_t>(bits(rng) | bits(rng)));
  }
  return b;
}

// Host values as a tensor of `backend`, over `slot`.
template <typename T>
Tensor on_backend(Backend& backend, kernels::Buffer& slot, const std::vector<T>& host,
                  std::initializer_list<std::int64_t> shape) {
  const Tensor t = backend.scratch(slot, kernels::dtype_of<T>(), shape);
  backend.from_host(std::as_bytes(std::span(host)), t);
  return t;
}

template <typename T>
std::vector<T> to_vector(Backend& backend, const Tensor& t) {
  std::vector<T> out(static_cast<std::size_t>(t.numel()));
  backend.to_host(t, std::as_writable_bytes(std::span(out)), kernels::HostSync::logits);
  return out;
}

inline std::vector<std::int32_t> draw(Backend& backend, const RandomBatch& b) {
  kernels::Buffer logits_slot, tokens_slot;
  const Tensor logits = on_backend(backend, logits_slot, b.logits, {b.rows, b.vocab});
  const Tensor tokens =
      on_backend(backend, tokens_slot, std::vector<std::int32_t>(static_cast<std::size_t>(b.rows)), {b.rows});
  backend.sample(logits, b.inputs(), tokens);
  return to_vector<std::int32_t>(backend, tokens);
}

// adjust_logits equals the reference on every row of b (the penalties' float arithmetic is the same, so up
// to rounding), a greedy draw takes the reference's first maximum, and the controls changed something.
inline void check_batch(Backend& backend, const RandomBatch& b, const char* what) {
  const std::int64_t rows = b.rows, vocab = b.vocab;
  kernels::Buffer logits_slot, adjusted_slot;
  const Tensor logits = on_backend(backend, logits_slot, b.logits, {rows, vocab});
  const Tensor adjusted = backend.scratch(adjusted_slot, kernels::DType::f32, {rows, vocab});
  backend.adjust_logits(logits, b.inputs(), adjusted);
  const std::vector<float> got = to_vector<float>(backend, adjusted);
  const std::vector<std::int32_t> drawn = draw(backend, b);
  int changed = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto at = static_cast<std::size_t>(r * vocab);
    const std::vector<float> want =
        reference_adjusted(std::span(b.logits).subspan(at, static_cast<std::size_t>(vocab)), b.inputs(),
                           static_cast<std::size_t>(r));
    for (std::int64_t i = 0; i < vocab; ++i) {
      const float w = want[static_cast<std::size_t>(i)];
      const float g = got[at + static_cast<std::size_t>(i)];
      changed += w != b.logits[at + static_cast<std::size_t>(i)] ? 1 : 0;
      if (std::isinf(w)) {
        ASSERT_EQ(g, w) << what << " row " << r << " id " << i;
      } else {
        ASSERT_NEAR(g, w, 1e-5F * (1.0F + std::fabs(w))) << what << " row " << r << " id " << i;
      }
    }
    const auto best = std::max_element(want.begin(), want.end()) - want.begin();
    EXPECT_EQ(drawn[static_cast<std::size_t>(r)], best) << what << " row " << r;
  }
  EXPECT_GT(changed, 0) << what << " changed nothing: a test that cannot fail";
}

// Every control alone and all together, on rows wider than a block of threads; then more rows than the CUDA
// backend adjusts at once (its chunks of 64).
inline void check_adjustments_against_reference(Backend& backend) {
  std::mt19937 rng(2026);
  const char* names[] = {"bias", "banned", "presence", "frequency", "repetition", "bitmask", "all"};
  for (const Controls which : {Controls::bias, Controls::banned, Controls::presence, Controls::frequency,
                               Controls::repetition, Controls::bitmask, Controls::all}) {
    for (int trial = 0; trial < 3; ++trial)
      check_batch(backend, random_batch(rng, which, 5, 700), names[static_cast<int>(which)]);
  }
  check_batch(backend, random_batch(rng, Controls::all, 150, 90), "all, 150 rows");
  // Rows with and without adjustments side by side (every third row has none).
  RandomBatch mixed = random_batch(rng, Controls::bias, 150, 90);
  for (std::size_t r = 0; r < mixed.controls.size(); r += 3) mixed.controls[r].bias = {};
  check_batch(backend, mixed, "bias on two rows of three");
}

// min_p at temperature 1.3 with top_k: the drawn tokens are exactly the reference's kept set (every kept
// one drawn, no other), in its renormalised proportions.
inline void check_min_p_against_reference(Backend& backend) {
  const std::vector<float> row = {2.0F, 1.5F, -0.5F, 1.9F, 0.2F, 1.0F, -3.0F, 1.2F};
  const auto vocab = static_cast<std::int64_t>(row.size());
  const float temperature = 1.3F, min_p = 0.6F;
  const std::int32_t top_k = 4;
  // Reference: probabilities after temperature, tokens below min_p * the best one's removed, then top-k.
  std::vector<double> p(row.size());
  double z = 0;
  for (std::size_t i = 0; i < row.size(); ++i) z += p[i] = std::exp(row[i] / temperature);
  const double best = *std::max_element(p.begin(), p.end());
  std::vector<std::size_t> kept;
  for (std::size_t i = 0; i < row.size(); ++i)
    if (p[i] / z >= min_p * best / z) kept.push_back(i);
  std::sort(kept.begin(), kept.end(), [&](std::size_t a, std::size_t b) { return row[a] > row[b]; });
  if (kept.size() > static_cast<std::size_t>(top_k)) kept.resize(static_cast<std::size_t>(top_k));
  ASSERT_EQ(kept.size(), 3U);  // min_p, not top_k, decides here: {0, 3, 1}
  double kept_mass = 0;
  for (const std::size_t i : kept) kept_mass += p[i];

  const std::int64_t draws = 6000;
  RandomBatch b;
  b.rows = draws;
  b.vocab = vocab;
  for (std::int64_t d = 0; d < draws; ++d) {
    b.logits.insert(b.logits.end(), row.begin(), row.end());
    b.controls.push_back({.temperature = temperature,
                          .top_k = top_k,
                          .top_p = 1.0F,
                          .seed = 11,
                          .step = static_cast<std::uint64_t>(d),
                          .min_p = min_p});
  }
  std::vector<int> seen(row.size(), 0);
  for (const std::int32_t t : draw(backend, b)) {
    ASSERT_TRUE(t >= 0 && t < vocab) << t;
    ++seen[static_cast<std::size_t>(t)];
  }
  for (std::size_t i = 0; i < row.size(); ++i) {
    const bool in = std::find(kept.begin(), kept.end(), i) != kept.end();
    const double want = in ? p[i] / kept_mass : 0.0;
    const double got = static_cast<double>(seen[i]) / static_cast<double>(draws);
    // 4 standard deviations of a frequency over 6000 draws is at most 0.026.
    EXPECT_NEAR(got, want, 0.026) << "token " << i;
    if (!in) {
      EXPECT_EQ(seen[i], 0) << "token " << i << " is below min_p";
    }
  }
}

// A row whose controls rule out every token gets kNoAllowedToken; a raw NaN still reports itself.
inline void check_rows_without_a_token(Backend& backend) {
  RandomBatch b;
  b.rows = 3;
  b.vocab = 40;
  for (int i = 0; i < 3 * 40; ++i) b.logits.push_back(std::sin(0.3F * static_cast<float>(i)));
  b.logits[2 * 40 + 7] = std::numeric_limits<float>::quiet_NaN();
  for (std::int32_t id = 0; id < 40; ++id) b.banned.push_back(id);
  b.controls = {
      {.temperature = 0.0F, .banned = {0, 40}}, {.temperature = 1.0F, .seed = 3}, {.temperature = 1.0F}};
  b.allowed = {-1, 0xFF, 0, 0, -1, 0xFF};  // rows 0 and 2: every token allowed; row 1: none
  const std::vector<std::int32_t> got = draw(backend, b);
  EXPECT_EQ(got[0], kernels::kNoAllowedToken);
  EXPECT_EQ(got[1], kernels::kNoAllowedToken);
  EXPECT_EQ(got[2], kernels::non_finite_token(7));
}

}  // namespace capserve::test
