// The step messages between rank 0 and the ranks: a plan and a result survive the round trip field by field,
// and a malformed byte string is refused instead of read past its end.
#include "server/step_plan.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace capserve::server {
namespace {

TEST(StepPlanTest, PlanRoundTripKeepsEveryField) {
  StepPlan plan;
  plan.frees = {7, 9};
  runtime::SamplingParams asking;
  asking.temperature = 0.5F;
  asking.top_k = 40;
  asking.top_p = 0.9F;
  asking.seed = 1234;
  asking.stop_token_ids = {2, 3};
  asking.max_new_tokens = 77;
  asking.logprobs = true;
  asking.prompt_logprobs = true;
  asking.top_logprobs = 20;
  asking.min_p = 0.05F;
  asking.min_tokens = 9;
  asking.presence_penalty = 1.5F;
  asking.frequency_penalty = -0.5F;
  asking.repetition_penalty = 1.2F;
  asking.logit_bias = {{4, -100.0F}, {900, 3.5F}};
  asking.constraint = R"({"regex": "[a-z]+"})";
  asking.protect = true;
  plan.starts.push_back({.id = 11, .rank = 1, .prompt = {5, 6, 7}, .cached = 0, .params = asking});
  plan.starts.push_back(
      {.id = 12, .rank = 0, .prompt = std::vector<std::int32_t>(40, 8), .cached = 32, .params = {}});
  plan.prefills = {{11, 3}, {12, 8}, {13, 100}};
  plan.decodes = {3, 4, 5};
  const StepPlan back = deserialize_plan(serialize(plan));
  EXPECT_FALSE(back.shutdown);
  EXPECT_EQ(back.frees, (std::vector<std::uint64_t>{7, 9}));
  ASSERT_EQ(back.starts.size(), 2U);
  EXPECT_EQ(back.starts[0].id, 11U);
  EXPECT_EQ(back.starts[0].rank, 1);
  EXPECT_EQ(back.starts[0].prompt, (std::vector<std::int32_t>{5, 6, 7}));
  const runtime::SamplingParams& p = back.starts[0].params;
  EXPECT_EQ(p.temperature, 0.5F);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_EQ(p.top_p, 0.9F);
  EXPECT_EQ(p.seed, 1234U);
  EXPECT_EQ(p.stop_token_ids, (std::vector<std::int32_t>{2, 3}));
  EXPECT_EQ(p.max_new_tokens, 77);
  EXPECT_TRUE(p.logprobs);
  EXPECT_TRUE(p.prompt_logprobs);
  EXPECT_EQ(p.top_logprobs, 20);
  EXPECT_EQ(p.min_p, 0.05F);
  EXPECT_EQ(p.min_tokens, 9);
  EXPECT_EQ(p.presence_penalty, 1.5F);
  EXPECT_EQ(p.frequency_penalty, -0.5F);
  EXPECT_EQ(p.repetition_penalty, 1.2F);
  ASSERT_EQ(p.logit_bias.size(), 2U);
  EXPECT_EQ(p.logit_bias[1].token, 900);
  EXPECT_EQ(p.logit_bias[1].bias, 3.5F);
  EXPECT_EQ(p.constraint, R"({"regex": "[a-z]+"})");
  EXPECT_TRUE(p.protect);
  EXPECT_FALSE(back.starts[1].params.protect);
  EXPECT_TRUE(back.starts[1].params.constraint.empty());
  EXPECT_EQ(back.starts[1].params.repetition_penalty, 1.0F);
  EXPECT_TRUE(back.starts[1].params.logit_bias.empty());
  EXPECT_FALSE(back.starts[1].params.logprobs);
  EXPECT_EQ(back.starts[1].params.top_logprobs, 0);
  EXPECT_EQ(back.starts[1].id, 12U);
  EXPECT_EQ(back.starts[1].prompt, std::vector<std::int32_t>(40, 8));
  EXPECT_EQ(back.starts[1].cached, 32);
  ASSERT_EQ(back.prefills.size(), 3U);
  EXPECT_EQ(back.prefills[1].id, 12U);
  EXPECT_EQ(back.prefills[1].tokens, 8);
  EXPECT_EQ(back.prefills[2].tokens, 100);
  EXPECT_EQ(back.decodes, (std::vector<std::uint64_t>{3, 4, 5}));
}

TEST(StepPlanTest, ShutdownFlagRoundTrips) {
  StepPlan plan;
  plan.shutdown = true;
  EXPECT_TRUE(deserialize_plan(serialize(plan)).shutdown);
}

TEST(StepPlanTest, ResultRoundTripKeepsErrorAndSequences) {
  StepResult result;
  result.ok = false;
  result.error = "KV cache: step needs 3 blocks, 1 free";
  result.sequences.push_back({21, 0, 2, 1, SequenceFailure::non_finite_logits});
  result.logprobs.push_back({21, 98, -0.25F, 2, 1});
  result.top_logprobs = {{98, -0.25F}, {3, -1.5F}};
  const StepResult back = deserialize_result(serialize(result));
  ASSERT_EQ(back.logprobs.size(), 1U);
  EXPECT_EQ(back.logprobs[0].id, 21U);
  EXPECT_EQ(back.logprobs[0].token, 98);
  EXPECT_EQ(back.logprobs[0].logprob, -0.25F);
  EXPECT_EQ(back.logprobs[0].top_count, 2);
  EXPECT_EQ(back.logprobs[0].prompt, 1);
  ASSERT_EQ(back.top_logprobs.size(), 2U);
  EXPECT_EQ(back.top_logprobs[1].token, 3);
  EXPECT_EQ(back.top_logprobs[1].logprob, -1.5F);
  EXPECT_FALSE(back.ok);
  EXPECT_EQ(back.error, "KV cache: step needs 3 blocks, 1 free");
  ASSERT_EQ(back.sequences.size(), 1U);
  EXPECT_EQ(back.sequences[0].id, 21U);
  EXPECT_EQ(back.sequences[0].tokens, 0);
  EXPECT_EQ(back.sequences[0].dropped, 2);
  EXPECT_EQ(back.sequences[0].rerouted, 1);
  EXPECT_EQ(back.sequences[0].failure, SequenceFailure::non_finite_logits);
}

// Speculative decoding: each decode's draft limit travels with the plan, and a result carries every kept
// token of each sequence (in the order of the sequences) with its draft counts.
TEST(StepPlanTest, DraftLimitsAndMultiTokenResultsRoundTrip) {
  StepPlan plan;
  plan.decodes = {3, 4, 5};
  plan.max_drafts = {3, 0, 16};
  const StepPlan back = deserialize_plan(serialize(plan));
  EXPECT_EQ(back.decodes, (std::vector<std::uint64_t>{3, 4, 5}));
  EXPECT_EQ(back.max_drafts, (std::vector<std::int32_t>{3, 0, 16}));

  StepResult result;
  result.sequences.push_back({3, 4, 0, 0, SequenceFailure::none, 3, 3});
  result.sequences.push_back({4, 1, 1, 0});
  result.sequences.push_back({5, 2, 0, 2, SequenceFailure::non_finite_logits, 5, 2});
  result.tokens = {10, 11, 12, 13, 20, 30, 31};
  const StepResult r = deserialize_result(serialize(result));
  ASSERT_EQ(r.sequences.size(), 3U);
  EXPECT_EQ(r.tokens, result.tokens);
  EXPECT_EQ(r.sequences[0].tokens, 4);
  EXPECT_EQ(r.sequences[0].drafted, 3);
  EXPECT_EQ(r.sequences[0].accepted, 3);
  EXPECT_EQ(r.sequences[1].tokens, 1);
  EXPECT_EQ(r.sequences[1].drafted, 0);
  EXPECT_EQ(r.sequences[1].dropped, 1);
  EXPECT_EQ(r.sequences[2].tokens, 2);
  EXPECT_EQ(r.sequences[2].drafted, 5);
  EXPECT_EQ(r.sequences[2].accepted, 2);
  EXPECT_EQ(r.sequences[2].rerouted, 2);
  EXPECT_EQ(r.sequences[2].failure, SequenceFailure::non_finite_logits);
}

// Draft limits that are not one per decode, and token counts that do not add up to the result's tokens, are
// refused rather than read out of bounds.
TEST(StepPlanTest, MismatchedDraftLimitsOrTokenCountsAreRefused) {
  StepPlan plan;
  plan.decodes = {3, 4};
  plan.max_drafts = {3};
  EXPECT_THROW(deserialize_plan(serialize(plan)), std::runtime_error);

  StepResult result;
  result.sequences.push_back({3, 3, 0, 0});
  result.tokens = {1, 2};
  EXPECT_THROW(deserialize_result(serialize(result)), std::runtime_error);
  result.tokens = {1, 2, 3, 4};
  EXPECT_THROW(deserialize_result(serialize(result)), std::runtime_error);
  result.sequences[0].tokens = -1;
  EXPECT_THROW(deserialize_result(serialize(result)), std::runtime_error);
}

TEST(StepPlanTest, TruncatedOrTrailingBytesAreRefused) {
  StepPlan plan;
  plan.starts.push_back({.id = 1, .rank = 0, .prompt = {1, 2, 3}, .cached = 0, .params = {}});
  plan.prefills.push_back({1, 3});
  std::vector<std::byte> bytes = serialize(plan);
  std::vector<std::byte> truncated(bytes.begin(), bytes.end() - 1);
  EXPECT_THROW(deserialize_plan(truncated), std::runtime_error);
  bytes.push_back(std::byte{0});
  EXPECT_THROW(deserialize_plan(bytes), std::runtime_error);
  EXPECT_THROW(deserialize_result({}), std::runtime_error);
}

// A length prefix larger than the message is refused before anything is allocated for it.
TEST(StepPlanTest, OversizedLengthPrefixIsRefused) {
  StepPlan plan;
  plan.frees = {1};
  std::vector<std::byte> bytes = serialize(plan);
  // Byte 0 is the shutdown flag; bytes 1..8 the frees count.
  bytes[8] = std::byte{0x7f};
  EXPECT_THROW(deserialize_plan(bytes), std::runtime_error);
}

}  // namespace
}  // namespace capserve::server
