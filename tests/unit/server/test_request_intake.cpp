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

  runtime::SamplingParams sampled(const runtime::GenerationDefaults& defaults, const SamplingInput& in,
                                  double unset_temperature = 0.0) {
    ServiceLimits limits;
    limits.model_id = "tiny";
    limits.vocab_size = tokenizer_.vocab_size();
    limits.generation_defaults = defaults;
    RequestIntake intake(scheduler_, &tokenizer_, std::nullopt, limits, nullptr);
    IntakeRequest request;
    request.prompts.resize(1);
    request.prompts[0] = {TokenPrompt{{1, 2, 3, 4}}, "input_ids"};
    request.sampling = in;
    request.unset_temperature = unset_temperature;
    const runtime::StatusOr<RequestIntake::Admitted> admitted = intake.admit(request, [] {});
    EXPECT_TRUE(admitted.ok()) << admitted.status().message();
    return admitted->requests.at(0)->params();
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

  // The front end's own default (the OpenAI API's 1) applies only where the checkpoint sets none.
  EXPECT_EQ(sampled({}, {}, 1.0).temperature, 1.0F);
  EXPECT_FLOAT_EQ(sampled(qwen3, {}, 1.0).temperature, 0.6F);
  EXPECT_EQ(sampled({}, greedy, 1.0).temperature, 0.0F);
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
  const auto admit = [&](std::size_t tokens, const std::string& field) {
    IntakeRequest request;
    request.prompts.resize(1);
    request.prompts[0] = {TokenPrompt{std::vector<std::int32_t>(tokens, 1)}, field};
    request.sampling.max_tokens = 1;
    return intake.admit(request, [] {});
  };
  EXPECT_TRUE(admit(4, "input_ids").ok());
  const runtime::StatusOr<RequestIntake::Admitted> refused = admit(5, "prompt[1]");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().field(), "prompt[1]");
  EXPECT_EQ(
      refused.status().message(),
      "prompt[1]: 5 tokens exceed the 4 batched tokens of a step (--max-batched-tokens); the model's dynamic "
      "rope scaling needs a prompt longer than its max_position_embeddings (2) prefilled in one step");
}

// One admit for both APIs: every choice of every prompt is one request (ids "-index", seeds from the client's
// seed up), each takes an in-flight slot of the address until the slots are released, and errors name the
// field as the request's front end spells it.
TEST_F(RequestIntakeTest, AdmitQueuesEveryChoiceAndNamesFieldsAsTheFrontEndSpellsThem) {
  ServiceLimits limits;
  limits.vocab_size = tokenizer_.vocab_size();
  limits.max_requests_per_peer = 4;
  RequestIntake intake(scheduler_, &tokenizer_, std::nullopt, limits, nullptr);
  IntakeRequest request;
  request.request_id = "call";
  request.prompts.resize(2);
  request.prompts[0] = {TokenPrompt{{5, 6}}, "prompt[0]"};
  request.prompts[1] = {TextPrompt{"a"}, "prompt[1]"};
  request.n = 2;
  request.sampling.seed = 7;
  request.peer = "ipv4:10.0.0.1:1000";
  IntakeRequest one;
  one.prompts.resize(1);
  one.prompts[0] = {TokenPrompt{{5}}, "input_ids"};
  one.peer = "ipv4:10.0.0.1:1001";  // the same address as the call's
  {
    int wakes = 0;
    runtime::StatusOr<RequestIntake::Admitted> admitted = intake.admit(request, [&wakes] { ++wakes; });
    ASSERT_TRUE(admitted.ok()) << admitted.status().message();
    ASSERT_EQ(admitted->requests.size(), 4U);
    for (std::size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(admitted->requests[i]->id(), "call-" + std::to_string(i));
      EXPECT_EQ(admitted->requests[i]->params().seed, 7 + i);
      EXPECT_EQ(admitted->requests[i]->peer(), request.peer);
    }
    EXPECT_EQ(admitted->requests[0]->prompt(), (std::vector<std::int32_t>{5, 6}));
    EXPECT_EQ(admitted->requests[1]->prompt(), admitted->requests[0]->prompt());
    admitted->requests[3]->push({});  // the listener set by admit wakes its front end
    EXPECT_EQ(wakes, 1);

    const runtime::StatusOr<RequestIntake::Admitted> full = intake.admit(one, [] {});
    ASSERT_FALSE(full.ok());
    EXPECT_EQ(full.status().code(), runtime::StatusCode::resource_exhausted);
  }  // the call's response is gone: so are its slots
  EXPECT_TRUE(intake.admit(one, [] {}).ok());

  one.sampling.top_p = 2;
  one.fields.sampling_prefix = "sampling.";
  const runtime::StatusOr<RequestIntake::Admitted> grpc = intake.admit(one, [] {});
  ASSERT_FALSE(grpc.ok());
  EXPECT_EQ(grpc.status().field(), "sampling.top_p");
  EXPECT_EQ(grpc.status().message(), "sampling.top_p: must be in [0, 1] (0 or 1: off), got 2.000000");
  one.fields.sampling_prefix.clear();
  const runtime::StatusOr<RequestIntake::Admitted> http = intake.admit(one, [] {});
  ASSERT_FALSE(http.ok());
  EXPECT_EQ(http.status().field(), "top_p");
}

}  // namespace
}  // namespace capserve::server
