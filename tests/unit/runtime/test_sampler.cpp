#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "runtime/sampler.h"

namespace capserve::runtime {
namespace {

const std::vector<float> kLogits = {std::log(0.5F), std::log(0.3F), std::log(0.2F), -1e9F};

// One sequence's successive draws, as the engine makes them: the CPU backend's sample, step after step.
class Sampler {
 public:
  explicit Sampler(SamplingParams params) : params_(std::move(params)) {}

  // The backend's token for the next step (kernels::non_finite_token on a non-finite row).
  std::int32_t sample(std::span<const float> logits) {
    const kernels::SampleControls controls = sample_controls(params_, step_++);
    std::int32_t token = 0;
    backend_.sample(kernels::Tensor::host(logits, {1, static_cast<std::int64_t>(logits.size())}),
                    std::span(&controls, 1), kernels::Tensor::host(std::span(&token, 1), {1}));
    return token;
  }

 private:
  SamplingParams params_;
  std::uint64_t step_ = 0;
  kernels::cpu::CpuBackend backend_{1};
};

std::int32_t draw(Sampler& s, std::span<const float> logits) {
  const std::int32_t token = s.sample(logits);
  EXPECT_FALSE(kernels::is_non_finite_token(token)) << failed_draw_error(token).message();
  return token;
}

std::vector<int> histogram(SamplingParams p, int draws) {
  Sampler s(p);
  std::vector<int> h(kLogits.size(), 0);
  for (int i = 0; i < draws; ++i) ++h[static_cast<std::size_t>(draw(s, kLogits))];
  return h;
}

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  Sampler s({});
  EXPECT_EQ(draw(s, std::vector<float>{0.1F, 2.0F, 2.0F, -3.0F}), 1);
}

// Model-sized logits (the magnitudes of a real vocabulary row) at temperatures from small to so small that
// logit / T overflows: all of them are the greedy token, never the least likely one.
TEST(Sampler, TinyTemperaturesAreGreedy) {
  std::vector<float> logits(6144);
  for (std::size_t i = 0; i < logits.size(); ++i)
    logits[i] = 9.0F * std::sin(0.37F * static_cast<float>(i)) + 3.1F;
  const std::int32_t greedy = 1234;
  logits[greedy] = 12.6F;  // half a logit above every other one
  for (const float t : {1e-3F, 1e-8F, 1e-10F, 1e-20F, 1e-30F, 1e-38F, 1e-45F}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 7;
    Sampler s(p);
    for (int i = 0; i < 20; ++i) EXPECT_EQ(draw(s, logits), greedy) << "temperature " << t;
    p.top_k = 40;
    p.top_p = 0.9F;
    Sampler filtered(p);
    EXPECT_EQ(draw(filtered, logits), greedy) << "temperature " << t << " with top-k/top-p";
  }
}

TEST(Sampler, NonFiniteLogitsAreAnErrorNotAToken) {
  for (const float bad :
       {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    for (const float t : {0.0F, 1.0F}) {
      SamplingParams p;
      p.temperature = t;
      Sampler s(p);
      const std::int32_t token = s.sample(std::vector<float>{0.5F, bad, 1.0F});
      EXPECT_TRUE(kernels::is_non_finite_token(token)) << "logit " << bad << ", temperature " << t;
      const Status status = failed_draw_error(token);
      EXPECT_NE(status.message().find("token id 1"), std::string::npos) << status.message();
    }
  }
}

TEST(Sampler, SameSeedSameTokensOtherSeedOtherTokens) {
  SamplingParams p;
  p.temperature = 1.0F;
  p.seed = 1234;
  std::vector<float> logits(64);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  const auto draws = [&](SamplingParams q) {
    Sampler s(q);
    std::vector<std::int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(draw(s, logits));
    return out;
  };
  EXPECT_EQ(draws(p), draws(p));
  SamplingParams other = p;
  other.seed = 99;
  EXPECT_NE(draws(p), draws(other));
}

TEST(Sampler, TemperatureOneFollowsTheSoftmax) {
  SamplingParams p;
  p.temperature = 1.0F;
  const auto h = histogram(p, 20000);
  EXPECT_NEAR(h[0] / 20000.0, 0.5, 0.02);
  EXPECT_NEAR(h[1] / 20000.0, 0.3, 0.02);
  EXPECT_NEAR(h[2] / 20000.0, 0.2, 0.02);
  EXPECT_EQ(h[3], 0);
}

TEST(Sampler, TopKKeepsOnlyTheKBest) {
  SamplingParams p;
  p.temperature = 1.0F;
  p.top_k = 2;
  const auto h = histogram(p, 5000);
  EXPECT_EQ(h[2], 0);
  EXPECT_NEAR(h[0] / 5000.0, 0.5 / 0.8, 0.03);
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  SamplingParams p;
  p.temperature = 1.0F;
  p.top_p = 0.7F;  // 0.5 < 0.7 <= 0.8: tokens 0 and 1
  const auto h = histogram(p, 5000);
  EXPECT_EQ(h[2], 0);
  EXPECT_GT(h[1], 0);
  p.top_p = 0.4F;  // the best token alone already reaches it
  EXPECT_EQ(histogram(p, 1000)[0], 1000);
}

TEST(Sampler, LowTemperatureSharpens) {
  SamplingParams p;
  p.temperature = 0.05F;
  EXPECT_GT(histogram(p, 2000)[0], 1990);
}

TEST(Sampler, StopTokens) {
  SamplingParams p;
  p.stop_token_ids = {7, 9};
  EXPECT_TRUE(is_stop_token(p, 9));
  EXPECT_FALSE(is_stop_token(p, 8));
}

// A step's rows: an unread row adjusts nothing; a row bans the stop ids while fewer than min_tokens were
// generated; a penalized row's history is the prompt, the generated tokens, then the drafts before it (the
// rows of one verifying decode share one copy).
// A grammar's mask constrains its row only; the other rows allow every id; clear() drops the masks.
TEST(SampleBatch, AllowedRowsDefaultToEveryToken) {
  SampleBatch batch;
  batch.add_unread();
  batch.add(SamplingParams{}, 0, {}, {}, {}, 1);
  EXPECT_TRUE(batch.inputs().allowed.empty()) << "no grammar, no masks";
  const std::int64_t words = kernels::allowed_words(40);
  const std::span<std::int32_t> row = batch.allowed_row(1, words);
  ASSERT_EQ(static_cast<std::int64_t>(row.size()), words);
  std::fill(row.begin(), row.end(), 0);
  row[1] = 1 << 3;  // only id 35
  const kernels::SampleInputs in = batch.inputs();
  ASSERT_EQ(static_cast<std::int64_t>(in.allowed.size()), 2 * words);
  for (std::int64_t id = 0; id < 40; ++id) {
    EXPECT_TRUE(kernels::allowed_bit(in.allowed.data(), id)) << id;
    EXPECT_EQ(kernels::allowed_bit(in.allowed.data() + words, id), id == 35) << id;
  }
  batch.clear();
  batch.add_unread();
  EXPECT_TRUE(batch.inputs().allowed.empty());
}

TEST(SampleBatch, RowsCarryTheirBansBiasesAndHistories) {
  SamplingParams p;
  p.stop_token_ids = {2, 9};
  p.min_tokens = 2;
  p.logit_bias = {{4, 1.5F}};
  p.frequency_penalty = 0.5F;
  const std::vector<std::int32_t> prompt = {7, 8}, generated = {3}, drafts = {5, 6};
  SampleBatch batch;
  batch.add_unread();
  batch.add(p, 1, prompt, generated, drafts, 3);  // draws 1, 2, 3
  p.frequency_penalty = 0.0F;
  batch.add(p, 0, prompt, {}, {}, 1);
  batch.add(p, 5, prompt, generated, {}, 0);  // an earlier prompt chunk: no row
  const kernels::SampleInputs in = batch.inputs();
  ASSERT_EQ(in.controls.size(), 5U);
  EXPECT_FALSE(kernels::adjusts_row(in, 0));
  const auto span_of = [](auto all, kernels::IndexRange r) {
    return std::vector(all.begin() + r.begin, all.begin() + r.end);
  };
  EXPECT_EQ(span_of(in.banned, in.controls[1].banned), (std::vector<std::int32_t>{2, 9})) << "draw 1 < 2";
  EXPECT_TRUE(span_of(in.banned, in.controls[2].banned).empty()) << "draw 2 = min_tokens";
  EXPECT_EQ(span_of(in.history, in.controls[1].history), (std::vector<std::int32_t>{7, 8, 3}));
  EXPECT_EQ(span_of(in.history, in.controls[2].history), (std::vector<std::int32_t>{7, 8, 3, 5}));
  EXPECT_EQ(span_of(in.history, in.controls[3].history), (std::vector<std::int32_t>{7, 8, 3, 5, 6}));
  EXPECT_EQ(in.history.size(), 5U) << "one copy for the three rows";
  EXPECT_EQ(in.controls[3].prompt_tokens, 2);
  EXPECT_EQ(in.controls[3].step, 3U);
  EXPECT_EQ(span_of(in.banned, in.controls[4].banned), (std::vector<std::int32_t>{2, 9})) << "draw 0";
  EXPECT_TRUE(span_of(in.history, in.controls[4].history).empty()) << "no penalty, no history";
  for (std::size_t r = 1; r < 5; ++r) {
    ASSERT_EQ(in.controls[r].bias.end - in.controls[r].bias.begin, 1);
    EXPECT_EQ(in.biases[static_cast<std::size_t>(in.controls[r].bias.begin)].token, 4);
    EXPECT_TRUE(kernels::adjusts_row(in, r));
  }
  batch.clear();
  EXPECT_EQ(batch.rows(), 0U);
}

TEST(Sampler, ValidationNamesTheField) {
  const auto field_of = [](const SamplingParams& p) { return validate_sampling(p).field(); };
  EXPECT_TRUE(validate_sampling({}).ok());
  const auto refused = [&](auto change, const std::string& field) {
    SamplingParams p;
    p.max_new_tokens = 8;
    change(p);
    const Status status = validate_sampling(p);
    EXPECT_EQ(status.code(), StatusCode::invalid_argument) << field;
    EXPECT_EQ(status.field(), field) << status.message();
    EXPECT_EQ(status.message().rfind(field + ": ", 0), 0U) << status.message();
  };
  refused([](SamplingParams& p) { p.temperature = -1.0F; }, "temperature");
  refused([](SamplingParams& p) { p.temperature = std::nanf(""); }, "temperature");
  refused([](SamplingParams& p) { p.top_p = 0.0F; }, "top_p");
  refused([](SamplingParams& p) { p.top_k = -2; }, "top_k");
  refused([](SamplingParams& p) { p.min_p = 1.5F; }, "min_p");
  refused([](SamplingParams& p) { p.min_p = -0.1F; }, "min_p");
  refused([](SamplingParams& p) { p.min_tokens = -1; }, "min_tokens");
  refused([](SamplingParams& p) { p.min_tokens = 9; }, "min_tokens");
  refused([](SamplingParams& p) { p.presence_penalty = 2.5F; }, "presence_penalty");
  refused([](SamplingParams& p) { p.frequency_penalty = -2.01F; }, "frequency_penalty");
  refused([](SamplingParams& p) { p.repetition_penalty = 0.0F; }, "repetition_penalty");
  refused([](SamplingParams& p) { p.repetition_penalty = std::numeric_limits<float>::infinity(); },
          "repetition_penalty");
  refused([](SamplingParams& p) { p.logit_bias = {{3, 100.5F}}; }, "logit_bias");
  refused([](SamplingParams& p) { p.logit_bias = {{-1, 1.0F}}; }, "logit_bias");
  refused([](SamplingParams& p) { p.logit_bias = {{3, 1.0F}, {4, 2.0F}, {3, -1.0F}}; }, "logit_bias");
  refused([](SamplingParams& p) { p.logprobs = true, p.top_logprobs = kMaxTopLogprobs + 1; }, "top_logprobs");
  refused([](SamplingParams& p) { p.logprobs = true, p.top_logprobs = -1; }, "top_logprobs");
  refused([](SamplingParams& p) { p.top_logprobs = 3; }, "top_logprobs");
  SamplingParams p;
  p.max_new_tokens = 8;
  p.min_tokens = 8;
  p.min_p = 1.0F;
  p.presence_penalty = -2.0F;
  p.frequency_penalty = 2.0F;
  p.repetition_penalty = 1.3F;
  p.logit_bias = {{3, -100.0F}, {4, 100.0F}};
  p.prompt_logprobs = true;
  p.top_logprobs = kMaxTopLogprobs;
  EXPECT_TRUE(validate_sampling(p).ok()) << validate_sampling(p).message();
  EXPECT_EQ(field_of(p), "");
}

}  // namespace
}  // namespace capserve::runtime
