// Engine::score, the one scoring path of the server's log-probabilities and capserve-eval-heldout: every
// prompt position's next-token log-probability and top 5 equal log_softmax of Hugging Face's recorded
// prompt logits within 1e-4, in one synchronisation that never copies the logits.
#include <gtest/gtest.h>

#include <stdexcept>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/npy.h"
#include "tests/unit/kernels/log_softmax_reference.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

using kernels::HostSync;

class PromptLogprobs : public ::testing::TestWithParam<std::string> {
 protected:
  kernels::cpu::CpuBackend backend_{2};
};

TEST_P(PromptLogprobs, EqualLogSoftmaxOfTheHfPromptLogits) {
  const auto dir = testing::fixture_models_dir() / GetParam();
  const auto model = runtime::Model::load(dir, backend_);
  runtime::Engine engine(*model, runtime::EngineOptions{});
  const nlohmann::json prompt = testing::fixture_reference(GetParam())["prompts"][3];
  const auto ids = prompt["input_ids"].get<std::vector<std::int32_t>>();
  const runtime::NpyArray logits = runtime::read_npy(dir / prompt["prompt_logits"].get<std::string>());
  const auto vocab = static_cast<std::size_t>(logits.shape[1]);

  const runtime::Engine::Work work{7, ids, true};
  ASSERT_TRUE(engine.step(std::span(&work, 1)).ok());
  std::vector<std::int32_t> next(ids.begin() + 1, ids.end());
  next.push_back(prompt["greedy_ids"][0].get<std::int32_t>());
  runtime::TokenLogprobs scores;
  const std::int64_t logits_syncs = backend_.host_syncs(HostSync::logits);
  const std::int64_t syncs = backend_.host_syncs(HostSync::logprobs);
  engine.score(next, 5, scores);
  EXPECT_EQ(backend_.host_syncs(HostSync::logprobs), syncs + 1);
  EXPECT_EQ(backend_.host_syncs(HostSync::logits), logits_syncs) << "the logits never go to the host";
  ASSERT_EQ(scores.rows(), static_cast<std::int64_t>(ids.size()));
  ASSERT_EQ(scores.top_k(), 5);
  for (std::size_t r = 0; r < ids.size(); ++r) {
    const std::span<const float> row(logits.data.data() + r * vocab, vocab);
    const std::vector<double> expected = testing::log_softmax(row);
    const std::vector<std::int32_t> ranked = testing::ranked_ids(row);
    const auto row_index = static_cast<std::int64_t>(r);
    EXPECT_NEAR(scores.logprob(row_index), expected[static_cast<std::size_t>(next[r])], 1e-4)
        << "position " << r;
    for (std::int64_t j = 0; j < 5; ++j) {
      EXPECT_EQ(scores.top_id(row_index, j), ranked[static_cast<std::size_t>(j)]) << "position " << r;
      EXPECT_NEAR(scores.top_logprob(row_index, j),
                  expected[static_cast<std::size_t>(ranked[static_cast<std::size_t>(j)])], 1e-4);
    }
  }
}

TEST_P(PromptLogprobs, RefusesTokensThatDoNotMatchTheRows) {
  const auto model = runtime::Model::load(testing::fixture_models_dir() / GetParam(), backend_);
  runtime::Engine engine(*model, runtime::EngineOptions{});
  const std::vector<std::int32_t> ids{5, 6, 7};
  const runtime::Engine::Work work{1, ids, false};  // one logits row
  ASSERT_TRUE(engine.step(std::span(&work, 1)).ok());
  runtime::TokenLogprobs scores;
  EXPECT_THROW(engine.score(ids, 0, scores), std::invalid_argument);
  const std::vector<std::int32_t> one{8};
  EXPECT_THROW(engine.score(one, model->config().vocab_size + 1, scores), std::invalid_argument);
  engine.score(one, 2, scores);
  EXPECT_EQ(scores.rows(), 1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PromptLogprobs, ::testing::ValuesIn(testing::fixture_model_names()));

}  // namespace
}  // namespace capserve
