// CpuBackend::token_logprobs against log_softmax of Hugging Face's recorded logits (every fixture's prompt
// logits: the chosen tokens and the top 20 within 1e-4), its order on ties and NaN, and its refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/npy.h"
#include "tests/unit/kernels/log_softmax_reference.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::kernels {
namespace {

constexpr double kTolerance = 1e-4;

struct Result {
  std::vector<float> values;
  std::vector<std::int32_t> ids;
};

Result run(Backend& backend, std::vector<float> logits, std::int64_t vocab, std::vector<std::int32_t> tokens,
           std::int64_t k) {
  const auto rows = static_cast<std::int64_t>(tokens.size());
  Result r{std::vector<float>(static_cast<std::size_t>(rows * (1 + k)), -1.0F),
           std::vector<std::int32_t>(static_cast<std::size_t>(rows * k), -1)};
  backend.token_logprobs(
      Tensor::host(std::span(logits), {rows, vocab}), Tensor::host(std::span(tokens), {rows}),
      Tensor::host(std::span(r.values), {rows, 1 + k}), Tensor::host(std::span(r.ids), {rows, k}));
  return r;
}

TEST(TokenLogprobs, EqualLogSoftmaxOfTheHfFixturesLogits) {
  cpu::CpuBackend backend(1);
  constexpr std::int64_t k = 20;
  for (const std::string& name : testing::fixture_model_names()) {
    const nlohmann::json ref = testing::fixture_reference(name);
    for (const auto& prompt : ref["prompts"]) {
      const runtime::NpyArray logits = runtime::read_npy(testing::fixture_models_dir() / name /
                                                         prompt["prompt_logits"].get<std::string>());
      const std::int64_t vocab = logits.shape[1];
      // Each position's next token: the prompt's, then the first greedy token.
      auto tokens = prompt["input_ids"].get<std::vector<std::int32_t>>();
      tokens.erase(tokens.begin());
      tokens.push_back(prompt["greedy_ids"][0].get<std::int32_t>());
      const Result got = run(backend, logits.data, vocab, tokens, k);
      for (std::size_t r = 0; r < tokens.size(); ++r) {
        const std::span<const float> row(logits.data.data() + r * static_cast<std::size_t>(vocab),
                                         static_cast<std::size_t>(vocab));
        const std::vector<double> expected = testing::log_softmax(row);
        const std::vector<std::int32_t> ranked = testing::ranked_ids(row);
        const std::size_t base = r * (1 + k);
        EXPECT_NEAR(got.values[base], expected[static_cast<std::size_t>(tokens[r])], kTolerance)
            << name << " row " << r;
        for (std::size_t j = 0; j < k; ++j) {
          EXPECT_EQ(got.ids[r * k + j], ranked[j]) << name << " row " << r << " rank " << j;
          EXPECT_NEAR(got.values[base + 1 + j], expected[static_cast<std::size_t>(ranked[j])], kTolerance)
              << name << " row " << r << " rank " << j;
        }
      }
    }
  }
}

TEST(TokenLogprobs, TiesGoToTheLowerIdAndNanComesLast) {
  cpu::CpuBackend backend(1);
  const std::vector<float> row = {2.0F, 5.0F, 5.0F, 1.0F, 5.0F};
  const Result ties = run(backend, row, 5, {4}, 5);
  EXPECT_EQ(ties.ids, (std::vector<std::int32_t>{1, 2, 4, 0, 3}));
  const std::vector<double> expected = testing::log_softmax(row);
  EXPECT_NEAR(ties.values[0], expected[4], 1e-6);
  EXPECT_FLOAT_EQ(ties.values[1], ties.values[3]);  // the three tied tokens score alike
  EXPECT_NEAR(ties.values[4], expected[0], 1e-6);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Result with_nan = run(backend, {nan, 1.0F, 3.0F}, 3, {1}, 3);
  EXPECT_EQ(with_nan.ids, (std::vector<std::int32_t>{2, 1, 0}));
  EXPECT_TRUE(std::isnan(with_nan.values[0])) << "a NaN logit leaves no distribution";
}

TEST(TokenLogprobs, TokensOutsideTheVocabularyScoreNanAndBadShapesAreRefused) {
  cpu::CpuBackend backend(1);
  const Result r = run(backend, {0.0F, 1.0F, 0.0F, 1.0F}, 2, {-1, 2}, 0);
  EXPECT_TRUE(std::isnan(r.values[0]));
  EXPECT_TRUE(std::isnan(r.values[1]));
  try {
    run(backend, {0.0F, 1.0F}, 2, {0}, 3);
    ADD_FAILURE() << "top_k 3 of a 2-token vocabulary was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("token_logprobs: logits [1, 2]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("k <= vocab"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capserve::kernels
