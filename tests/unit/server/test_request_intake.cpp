// The shared intake's sampling fields: a request's unset temperature / top_p / top_k take the checkpoint's
// generation_config.json defaults; a set field (0 included) is the request's own.
#include "server/request_intake.h"

#include <gtest/gtest.h>

#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server {
namespace {

class RequestIntakeTest : public testing::Test {
 protected:
  RequestIntakeTest() : tokenizer_(load_tiny_tokenizer()), scheduler_({}, 1, &tokenizer_, nullptr, nullptr) {}

  runtime::SamplingParams sampled(const runtime::GenerationDefaults& defaults, const SamplingInput& in) {
    ServiceLimits limits;
    limits.model_id = "tiny";
    limits.vocab_size = tokenizer_.vocab_size();
    limits.generation_defaults = defaults;
    RequestIntake intake(scheduler_, &tokenizer_, std::nullopt, limits, nullptr);
    runtime::SamplingParams params;
    std::vector<std::string> stops;
    EXPECT_FALSE(intake.sampling(in, 4, true, "", params, stops).has_value());
    return params;
  }

  runtime::Tokenizer tokenizer_;
  Scheduler scheduler_;
};

TEST_F(RequestIntakeTest, UnsetSamplingFieldsTakeTheModelsDefaults) {
  const runtime::GenerationDefaults qwen3{0.6F, 0.95F, 20, {}};
  const runtime::SamplingParams unset = sampled(qwen3, {});
  EXPECT_FLOAT_EQ(unset.temperature, 0.6F);
  EXPECT_FLOAT_EQ(unset.top_p, 0.95F);
  EXPECT_EQ(unset.top_k, 20);

  SamplingInput greedy;
  greedy.temperature = 0.0;
  greedy.top_k = 0;
  const runtime::SamplingParams set = sampled(qwen3, greedy);
  EXPECT_EQ(set.temperature, 0.0F);
  EXPECT_EQ(set.top_k, 0);
  EXPECT_FLOAT_EQ(set.top_p, 0.95F);

  const runtime::SamplingParams none = sampled({}, {});
  EXPECT_EQ(none.temperature, 0.0F);
  EXPECT_EQ(none.top_p, 1.0F);
  EXPECT_EQ(none.top_k, 0);
}

// A prompt that must be prefilled in one step (a model with dynamic rope scaling, past its
// max_position_embeddings) and is longer than a step's batched tokens is refused naming the field the client
// sent it in (it was once refused by the scheduler with param "max_tokens"). Other long prompts are chunked.
TEST_F(RequestIntakeTest, PromptOverTheBatchedTokensNamesItsField) {
  SchedulerConfig config;
  config.max_batched_tokens = 4;
  config.whole_prefill_above = 2;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  ServiceLimits limits;
  limits.vocab_size = tokenizer_.vocab_size();
  RequestIntake intake(scheduler, &tokenizer_, std::nullopt, limits, nullptr);
  const std::vector<std::int32_t> four(4, 1), five(5, 1);
  EXPECT_FALSE(intake.token_prompt(four, "input_ids").has_value());
  const IntakeResult refused = intake.token_prompt(five, "prompt[1]");
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->param, "prompt[1]");
  EXPECT_EQ(
      refused->message,
      "prompt[1]: 5 tokens exceed the 4 batched tokens of a step (--max-batched-tokens); the model's dynamic "
      "rope scaling needs a prompt longer than its max_position_embeddings (2) prefilled in one step");
}

}  // namespace
}  // namespace capserve::server
