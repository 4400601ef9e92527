// The scheduler's request lifecycle driven step by step without ranks: plans in, hand-made step results out,
// and the client events that come of them.
#include "server/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>

#include "runtime/tokenizer/utf8.h"
#include "tests/unit/server/scheduler_steps.h"
#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server {
namespace {

std::shared_ptr<Request> chat_request(std::vector<std::string> stops, std::int64_t max_new_tokens = 16,
                                      std::size_t prompt_tokens = 3) {
  runtime::SamplingParams params;
  params.max_new_tokens = max_new_tokens;
  return std::make_shared<Request>(
      "r", std::vector<std::int32_t>(prompt_tokens, 5), params,
      OutputForm{.text = true, .stop_strings = std::move(stops), .skip_special_tokens = true},
      Clock::time_point::max());
}

// Every event the request has received so far.
std::vector<RequestEvent> drain_events(Request& request) {
  std::vector<RequestEvent> events;
  while (auto e = request.try_next()) events.push_back(std::move(*e));
  return events;
}

class SchedulerTest : public testing::Test {
 protected:
  SchedulerTest() : tokenizer_(load_tiny_tokenizer()) {}

  // Runs one step in which every sequence of the plan samples `token`.
  static void step(Scheduler& scheduler, std::int32_t token) { SchedulerSteps(scheduler).step(token); }

  runtime::Tokenizer tokenizer_;
};

TEST_F(SchedulerTest, StopStringHoldBackCutsOnCharacterBoundaries) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto request = chat_request({"QQ"}, 4);
  ASSERT_TRUE(scheduler.submit(request).ok());
  // "a" then the 3-byte "に": holding back one byte for "QQ" must not split the character.
  const std::int32_t a = single_token(tokenizer_, "a");
  const std::int32_t ni = single_token(tokenizer_, "\xE3\x81\xAB");
  for (const std::int32_t token : {a, ni, a, ni}) step(scheduler, token);
  std::string text;
  const std::vector<RequestEvent> events = drain_events(*request);
  ASSERT_FALSE(events.empty());
  for (const RequestEvent& e : events) {
    EXPECT_TRUE(runtime::utf8::is_valid(e.text))
        << "a chunk splits a character: " << testing::PrintToString(e.text);
    text += e.text;
  }
  EXPECT_EQ(text,
            "a\xE3\x81\xAB"
            "a\xE3\x81\xAB");
  EXPECT_EQ(events.back().terminal, Terminal::ok_length);
}

// Log-probability entries travel with the events that carry their tokens: the prompt's (all but its first
// token) with the first event, a generated token's with the text delta that completes its text (text held
// back for a possible stop string takes its entries along), the rest at the end; a stop token's entry is not
// sent, like its text.
TEST_F(SchedulerTest, LogprobEntriesGoWithTheTextThatCoversTheirTokens) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  runtime::SamplingParams params;
  params.max_new_tokens = 8;
  params.logprobs = true;
  params.prompt_logprobs = true;
  params.top_logprobs = 1;
  const std::int32_t a = single_token(tokenizer_, "a");
  const std::int32_t q = single_token(tokenizer_, "Q");
  params.stop_token_ids = {q};
  const auto request =
      std::make_shared<Request>("r", std::vector<std::int32_t>{5, 6, 7}, params,
                                OutputForm{.text = true, .stop_strings = {"QQ"}, .skip_special_tokens = true},
                                Clock::time_point::max());
  ASSERT_TRUE(scheduler.submit(request).ok());
  float logprob = -1.0F;
  for (const std::int32_t token : {a, a, a, q}) {
    const StepPlan plan = scheduler.plan(Clock::now());
    StepResult result;
    const std::uint64_t id = plan.starts.empty() ? plan.decodes.at(0) : plan.starts[0].id;
    if (!plan.starts.empty()) {
      EXPECT_TRUE(plan.starts[0].params.logprobs);
      EXPECT_TRUE(plan.starts[0].params.prompt_logprobs);
      EXPECT_EQ(plan.starts[0].params.top_logprobs, 1);
    }
    add_token(result, id, token);
    if (!plan.starts.empty()) {
      for (const std::int32_t next : {6, 7}) {
        result.logprobs.push_back({id, next, -0.5F, 1, 1});
        result.top_logprobs.push_back({next, -0.5F});
      }
    }
    result.logprobs.push_back({id, token, logprob, 1, 0});
    result.top_logprobs.push_back({9, logprob / 2});
    scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
    logprob -= 1.0F;
  }
  // One byte is held back for "QQ": each "a" is sent one step after it was sampled.
  const std::vector<RequestEvent> events = drain_events(*request);
  ASSERT_EQ(events.size(), 3U);
  EXPECT_EQ(events[0].prompt_logprobs.tokens, (std::vector<std::int32_t>{6, 7}));
  EXPECT_EQ(events[0].prompt_logprobs.alternatives(1)[0].token, 7);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(events[i].text, "a") << "event " << i;
    EXPECT_EQ(events[i].logprobs.tokens, std::vector<std::int32_t>{a}) << "event " << i;
    EXPECT_EQ(events[i].logprobs.logprobs, std::vector<float>{-1.0F - static_cast<float>(i)})
        << "event " << i;
    ASSERT_EQ(events[i].logprobs.alternatives(0).size(), 1U);
    EXPECT_EQ(events[i].logprobs.alternatives(0)[0].logprob, (-1.0F - static_cast<float>(i)) / 2);
    if (i > 0) {
      EXPECT_TRUE(events[i].prompt_logprobs.empty()) << "event " << i;
    }
  }
  EXPECT_EQ(events[2].terminal, Terminal::ok_stop);
  EXPECT_EQ(events[2].completion_tokens, 4U);
}

// A rank that could not sample one sequence (non-finite logits) fails that request alone, with a message; the
// other sequence of the same step goes on to finish normally, and the failed one is freed on the ranks.
TEST_F(SchedulerTest, ASequenceWithoutATokenFailsAloneWithAnError) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto bad = chat_request({}, 3);
  const auto good = chat_request({}, 3);
  ASSERT_TRUE(scheduler.submit(bad).ok());
  ASSERT_TRUE(scheduler.submit(good).ok());
  const std::int32_t a = single_token(tokenizer_, "a");
  StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.starts.size(), 2U);
  StepResult result;
  result.sequences.push_back({plan.starts[0].id, 0, 0, 0, SequenceFailure::non_finite_logits});
  add_token(result, plan.starts[1].id, a);
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  const std::vector<RequestEvent> failed = drain_events(*bad);
  ASSERT_EQ(failed.size(), 1U);
  EXPECT_EQ(failed[0].terminal, Terminal::internal);
  EXPECT_NE(failed[0].message.find("not finite"), std::string::npos) << failed[0].message;
  plan = scheduler.plan(Clock::now());
  EXPECT_EQ(plan.frees, std::vector<std::uint64_t>{result.sequences[0].id});
  EXPECT_EQ(plan.decodes, std::vector<std::uint64_t>{result.sequences[1].id});
  for (int i = 0; i < 2; ++i) step(scheduler, a);
  const std::vector<RequestEvent> served = drain_events(*good);
  ASSERT_FALSE(served.empty());
  EXPECT_EQ(served.back().terminal, Terminal::ok_length);
  EXPECT_EQ(served.back().completion_tokens, 3U);
}

// A sequence whose controls rule out every token (an allowed-token mask with min_tokens) ends as the
// client's error, INVALID_ARGUMENT naming the controls, after the tokens it kept.
TEST_F(SchedulerTest, ASequenceWhoseControlsAllowNoTokenEndsAsInvalidArgument) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto request = chat_request({}, 3);
  ASSERT_TRUE(scheduler.submit(request).ok());
  const std::int32_t a = single_token(tokenizer_, "a");
  const StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.starts.size(), 1U);
  StepResult result;
  add_token(result, plan.starts[0].id, a);
  result.sequences[0].failure = SequenceFailure::no_allowed_token;
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  const std::vector<RequestEvent> events = drain_events(*request);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().terminal, Terminal::invalid_argument);
  EXPECT_NE(events.back().message.find("rule out every token at completion token 2"), std::string::npos)
      << events.back().message;
  EXPECT_EQ(events.back().completion_tokens, 1U);
}

// A request that could never be admitted, even by an idle server, is refused at submission naming the limit,
// and the requests behind it are served. (A prompt longer than a step's batched tokens fits: it is prefilled
// in chunks.)
TEST_F(SchedulerTest, RequestsThatCanNeverFitAreRefusedAtSubmission) {
  SchedulerConfig config;
  config.max_batched_tokens = 16;
  config.kv_blocks_per_rank = 4;  // 64 tokens of 16
  Scheduler scheduler(config, 2, &tokenizer_, nullptr, nullptr);
  const auto long_prompt = chat_request({}, 1, 60);
  EXPECT_TRUE(scheduler.limits().check_fits(*long_prompt).ok());
  const auto many_tokens = chat_request({}, 100);
  EXPECT_EQ(scheduler.submit(many_tokens).code(), runtime::StatusCode::invalid_argument);
  EXPECT_NE(scheduler.limits().check_fits(*many_tokens).message().find("--kv-blocks"), std::string::npos)
      << scheduler.limits().check_fits(*many_tokens).message();
  const auto fits = chat_request({}, 61);  // 3 + 61 tokens: exactly the 4 blocks of a rank
  EXPECT_TRUE(scheduler.limits().check_fits(*fits).ok());
  ASSERT_TRUE(scheduler.submit(fits).ok());
  EXPECT_EQ(scheduler.plan(Clock::now()).starts.size(), 1U);
  EXPECT_TRUE(scheduler.submit(long_prompt).ok());
}

TEST_F(SchedulerTest, AFullQueueAndADrainingServerRefuse) {
  SchedulerConfig config;
  config.max_queue = 2;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  EXPECT_TRUE(scheduler.submit(chat_request({})).ok());
  EXPECT_TRUE(scheduler.submit(chat_request({})).ok());
  EXPECT_EQ(scheduler.submit(chat_request({})).code(), runtime::StatusCode::resource_exhausted);
  EXPECT_FALSE(scheduler.draining());
  scheduler.drain();
  EXPECT_TRUE(scheduler.draining());
  EXPECT_EQ(scheduler.submit(chat_request({})).code(), runtime::StatusCode::unavailable);
}

// The stop signal's flag refuses at once, before the engine loop has seen it and called drain(): a request
// that arrived just after SIGTERM was once still accepted.
TEST_F(SchedulerTest, TheStopFlagRefusesBeforeDrain) {
  std::atomic<bool> stop_requested{false};
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr, &stop_requested);
  EXPECT_TRUE(scheduler.submit(chat_request({})).ok());
  EXPECT_FALSE(scheduler.draining());
  stop_requested.store(true);
  EXPECT_TRUE(scheduler.draining());
  EXPECT_EQ(scheduler.submit(chat_request({})).code(), runtime::StatusCode::unavailable);
}

// A cancelled waiting request leaves the queue with one CANCELLED event; a cancelled running one is freed on
// the ranks in the same plan.
TEST_F(SchedulerTest, CancelledRequestsEndOnceAndAreFreed) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto waiting = chat_request({});
  ASSERT_TRUE(scheduler.submit(waiting).ok());
  waiting->cancel();
  EXPECT_TRUE(scheduler.plan(Clock::now()).starts.empty());
  std::vector<RequestEvent> events = drain_events(*waiting);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::cancelled);
  EXPECT_EQ(events[0].prompt_tokens, 3U);

  const auto running = chat_request({});
  ASSERT_TRUE(scheduler.submit(running).ok());
  const StepPlan first = scheduler.plan(Clock::now());
  ASSERT_EQ(first.starts.size(), 1U);
  running->cancel();
  const StepPlan second = scheduler.plan(Clock::now());
  EXPECT_EQ(second.frees, std::vector<std::uint64_t>{first.starts[0].id});
  EXPECT_TRUE(second.decodes.empty());
  events = drain_events(*running);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::cancelled);
}

// A client whose own deadline passed (before the server's, by the request's transit time) ends its request as
// DEADLINE_EXCEEDED, waiting or running, even when it cancelled too.
TEST_F(SchedulerTest, ARequestWhoseClientDeadlinePassedEndsAsDeadlineExceeded) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto waiting = chat_request({});
  ASSERT_TRUE(scheduler.submit(waiting).ok());
  waiting->expire();
  waiting->cancel();
  EXPECT_TRUE(scheduler.plan(Clock::now()).starts.empty());
  std::vector<RequestEvent> events = drain_events(*waiting);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::deadline_exceeded);

  const auto running = chat_request({});
  ASSERT_TRUE(scheduler.submit(running).ok());
  const StepPlan first = scheduler.plan(Clock::now());
  ASSERT_EQ(first.starts.size(), 1U);
  running->expire();
  const StepPlan second = scheduler.plan(Clock::now());
  EXPECT_EQ(second.frees, std::vector<std::uint64_t>{first.starts[0].id});
  events = drain_events(*running);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::deadline_exceeded);
}

// KV blocks are reserved for prompt + max tokens: a request that does not fit waits, and is admitted in the
// plan that frees the blocks it needs.
TEST_F(SchedulerTest, ARequestWaitsForKvBlocksAndJoinsWhenTheyAreFreed) {
  SchedulerConfig config;
  config.kv_blocks_per_rank = 4;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  std::vector<std::shared_ptr<Request>> requests;
  for (int i = 0; i < 3; ++i) {
    requests.push_back(chat_request({}, 29));  // 3 + 29 tokens: 2 blocks of 16
    ASSERT_TRUE(scheduler.submit(requests.back()).ok());
  }
  const StepPlan first = scheduler.plan(Clock::now());
  ASSERT_EQ(first.starts.size(), 2U);
  EXPECT_TRUE(scheduler.plan(Clock::now()).starts.empty());
  requests[0]->cancel();
  const StepPlan third = scheduler.plan(Clock::now());
  EXPECT_EQ(third.frees.size(), 1U);
  EXPECT_EQ(third.starts.size(), 1U);
}

// A rank that refuses the whole step ends each of its sequences with INTERNAL and the rank's reason.
TEST_F(SchedulerTest, ARefusedStepFailsTheRanksSequencesWithItsReason) {
  Scheduler scheduler({}, 1, &tokenizer_, nullptr, nullptr);
  const auto request = chat_request({});
  ASSERT_TRUE(scheduler.submit(request).ok());
  const StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.starts.size(), 1U);
  StepResult result;
  result.ok = false;
  result.error = "boom";
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  const std::vector<RequestEvent> events = drain_events(*request);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::internal);
  EXPECT_EQ(events[0].message, "rank 0 refused the step: boom");
  EXPECT_EQ(scheduler.plan(Clock::now()).frees, std::vector<std::uint64_t>{plan.starts[0].id});
}

// A request's life reaches the metrics: its KV blocks while it runs, then its lengths and phase times once it
// ends; the blocks are released with it.
TEST_F(SchedulerTest, AFinishedRequestFeedsTheKvAndRequestMetrics) {
  const std::vector<std::int64_t> layers{0};
  ServerMetrics metrics(layers, 2, 2,
                        MetricsOptions{.model_name = "m",
                                       .per_expert = false,
                                       .max_context = 64,
                                       .version = "v",
                                       .git_commit = "c",
                                       .build_type = "Release",
                                       .device = "cpu"});
  SchedulerConfig config;
  config.kv_blocks_per_rank = 8;
  Scheduler scheduler(config, 2, &tokenizer_, nullptr, &metrics);
  ASSERT_TRUE(scheduler.submit(chat_request({}, 3, 20)).ok());  // 23 tokens: 2 blocks
  const auto has = [&](const std::string& sample) {
    return metrics.exposition().find(sample) != std::string::npos;
  };
  step(scheduler, 7);
  EXPECT_TRUE(has("capserve_kv_cache_usage_ratio{model_name=\"m\"} 0.125\n")) << metrics.exposition();
  step(scheduler, 7);
  step(scheduler, 7);  // the third token: max_tokens reached
  EXPECT_TRUE(has("capserve_request_generation_tokens_sum{model_name=\"m\"} 3\n"));
  EXPECT_TRUE(has("capserve_request_prompt_tokens_sum{model_name=\"m\"} 20\n"));
  EXPECT_TRUE(has("capserve_request_prefill_time_seconds_count{model_name=\"m\"} 1\n"));
  EXPECT_TRUE(has("capserve_request_decode_time_seconds_count{model_name=\"m\"} 1\n"));
  scheduler.plan(Clock::now());  // frees the finished sequence
  EXPECT_TRUE(has("capserve_kv_cache_usage_ratio{model_name=\"m\"} 0\n")) << metrics.exposition();
}

// Speculative decoding: a decode's kept tokens reach the client in order, each as a lone token would; a stop
// token among them ends the request there, and the kept tokens after it are never sent.
TEST_F(SchedulerTest, AStopTokenInsideAMultiTokenResultEndsTheRequestThere) {
  SchedulerConfig config;
  config.speculative_tokens = 3;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  const std::int32_t a = single_token(tokenizer_, "a");
  const std::int32_t b = single_token(tokenizer_, "b");
  const std::int32_t q = single_token(tokenizer_, "Q");
  runtime::SamplingParams params;
  params.max_new_tokens = 16;
  params.stop_token_ids = {q};
  const auto request = std::make_shared<Request>(
      "r", std::vector<std::int32_t>{5, 6, 7}, params,
      OutputForm{.text = true, .stop_strings = {}, .skip_special_tokens = true}, Clock::time_point::max());
  ASSERT_TRUE(scheduler.submit(request).ok());
  step(scheduler, a);
  const StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.decodes.size(), 1U);
  EXPECT_EQ(plan.max_drafts, std::vector<std::int32_t>{3});
  StepResult result;
  result.sequences.push_back({plan.decodes[0], 4, 0, 0, SequenceFailure::none, 3, 3});
  result.tokens = {b, q, a, b};
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  std::string text;
  const std::vector<RequestEvent> events = drain_events(*request);
  for (const RequestEvent& e : events) text += e.text;
  EXPECT_EQ(text, "ab");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().terminal, Terminal::ok_stop);
  EXPECT_EQ(events.back().completion_tokens, 3U) << "a, b and the stop token; the two after it are dropped";
  EXPECT_EQ(scheduler.plan(Clock::now()).frees, std::vector<std::uint64_t>{plan.decodes[0]});
}

// A decode's drafts never reach past its request's max_tokens or the context (so the KV blocks reserved at
// admission always suffice), and take only the batched tokens that the decodes and the prompts admitted in
// the same step leave.
TEST_F(SchedulerTest, DraftsStayWithinMaxTokensTheContextAndTheBatchedTokens) {
  SchedulerConfig config;
  config.speculative_tokens = 3;
  config.max_context = 8;
  config.max_batched_tokens = 6;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  const std::int32_t a = single_token(tokenizer_, "a");
  const auto near_max_tokens = chat_request({}, 3, 2);  // after its first token: 2 left, so 1 draft
  const auto near_context = chat_request({}, 16, 5);    // after its first token: 6 of 8, so 1 draft
  ASSERT_TRUE(scheduler.submit(near_max_tokens).ok());
  ASSERT_TRUE(scheduler.submit(near_context).ok());
  StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.starts.size(), 1U) << "the second prompt does not fit the step's 6 tokens beside the first";
  EXPECT_TRUE(plan.max_drafts.empty()) << "no decode yet";
  StepResult result;
  add_token(result, plan.starts[0].id, a);
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());

  plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.decodes.size(), 1U);
  ASSERT_EQ(plan.starts.size(), 1U);
  EXPECT_EQ(plan.max_drafts, std::vector<std::int32_t>{0}) << "1 decode + a 5-token prompt fill the 6 tokens";
  result = {};
  add_token(result, plan.decodes[0], a);
  add_token(result, plan.starts[0].id, a);
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());

  plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.decodes.size(), 2U);
  EXPECT_EQ(plan.max_drafts, (std::vector<std::int32_t>{0, 1}))
      << "max_tokens 3 with 2 generated leaves no draft; the context 8 with 5 + 1 leaves 1";
  result = {};
  add_token(result, plan.decodes[0], a);
  result.sequences.push_back({plan.decodes[1], 2, 0, 0, SequenceFailure::none, 1, 1});
  result.tokens.insert(result.tokens.end(), {a, a});
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  const std::vector<RequestEvent> first = drain_events(*near_max_tokens);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first.back().terminal, Terminal::ok_length);
  EXPECT_EQ(first.back().completion_tokens, 3U);
  const std::vector<RequestEvent> second = drain_events(*near_context);
  ASSERT_FALSE(second.empty());
  EXPECT_EQ(second.back().terminal, Terminal::ok_length);
  EXPECT_EQ(second.back().completion_tokens, 3U) << "5 + 3 tokens: the context";
}

// A verifying step whose row after some kept tokens was not finite: the kept tokens are sent, then the
// request ends with the error, naming the completion token that could not be drawn.
TEST_F(SchedulerTest, TokensKeptBeforeANonFiniteRowAreSentBeforeTheError) {
  SchedulerConfig config;
  config.speculative_tokens = 3;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  const auto request = chat_request({}, 16);
  ASSERT_TRUE(scheduler.submit(request).ok());
  const std::int32_t a = single_token(tokenizer_, "a");
  const std::int32_t b = single_token(tokenizer_, "b");
  step(scheduler, a);
  const StepPlan plan = scheduler.plan(Clock::now());
  StepResult result;
  result.sequences.push_back({plan.decodes.at(0), 2, 0, 0, SequenceFailure::non_finite_logits, 3, 2});
  result.tokens = {b, a};
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  std::string text;
  const std::vector<RequestEvent> events = drain_events(*request);
  for (const RequestEvent& e : events) text += e.text;
  EXPECT_EQ(text, "aba");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().terminal, Terminal::internal);
  EXPECT_NE(events.back().message.find("at completion token 4"), std::string::npos) << events.back().message;
  EXPECT_EQ(events.back().completion_tokens, 3U);
  EXPECT_EQ(scheduler.plan(Clock::now()).frees, std::vector<std::uint64_t>{plan.decodes[0]});
}

// The drafts of each decode reach the speculation counters, per draft position, and the access line.
TEST_F(SchedulerTest, VerifiedDraftsFeedTheSpeculationMetrics) {
  const std::vector<std::int64_t> layers{0};
  ServerMetrics metrics(layers, 2, 1,
                        MetricsOptions{.model_name = "m",
                                       .per_expert = false,
                                       .max_context = 64,
                                       .speculative_tokens = 3,
                                       .version = "v",
                                       .git_commit = "c",
                                       .build_type = "Release",
                                       .device = "cpu"});
  SchedulerConfig config;
  config.speculative_tokens = 3;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, &metrics);
  ASSERT_TRUE(scheduler.submit(chat_request({}, 16)).ok());
  const std::int32_t a = single_token(tokenizer_, "a");
  step(scheduler, a);
  for (const auto& [drafted, accepted] : {std::pair{3, 1}, std::pair{2, 2}}) {
    const StepPlan plan = scheduler.plan(Clock::now());
    StepResult result;
    result.sequences.push_back(
        {plan.decodes.at(0), accepted + 1, 0, 0, SequenceFailure::none, drafted, accepted});
    result.tokens.assign(static_cast<std::size_t>(accepted + 1), a);
    scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  }
  const std::string text = metrics.exposition();
  const auto has = [&](const std::string& sample) { return text.find(sample) != std::string::npos; };
  EXPECT_TRUE(has("capserve_spec_draft_tokens_total{model_name=\"m\"} 5\n")) << text;
  EXPECT_TRUE(has("capserve_spec_accepted_tokens_total{model_name=\"m\"} 3\n")) << text;
  EXPECT_TRUE(has("capserve_spec_position_draft_tokens_total{model_name=\"m\",position=\"0\"} 2\n")) << text;
  EXPECT_TRUE(has("capserve_spec_position_draft_tokens_total{model_name=\"m\",position=\"2\"} 1\n")) << text;
  EXPECT_TRUE(has("capserve_spec_position_accepted_tokens_total{model_name=\"m\",position=\"0\"} 2\n"))
      << text;
  EXPECT_TRUE(has("capserve_spec_position_accepted_tokens_total{model_name=\"m\",position=\"1\"} 1\n"))
      << text;
  EXPECT_TRUE(has("capserve_spec_position_accepted_tokens_total{model_name=\"m\",position=\"2\"} 0\n"))
      << text;
  EXPECT_TRUE(has("capserve_generation_tokens_total{model_name=\"m\"} 6\n")) << text;
}

std::int64_t step_tokens(const StepPlan& plan) {
  std::int64_t tokens = static_cast<std::int64_t>(plan.decodes.size());
  for (const PrefillChunk& c : plan.prefills) tokens += c.tokens;
  return tokens;
}

// A prompt of four times the step's token budget is prefilled in chunks that share each step with the running
// decodes: every step keeps to the budget, the running request decodes in every one of them, and the long
// one's first token comes with its last chunk.
TEST_F(SchedulerTest, ALongPromptIsPrefilledInChunksWhileTheDecodesGoOn) {
  SchedulerConfig config;
  config.max_batched_tokens = 16;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  const std::int32_t a = single_token(tokenizer_, "a");
  const auto running = chat_request({}, 100);
  ASSERT_TRUE(scheduler.submit(running).ok());
  run.step(a);
  const auto long_prompt = chat_request({}, 2, 64);
  ASSERT_TRUE(scheduler.submit(long_prompt).ok());
  std::int64_t prefilled = 0;
  int steps = 0;
  while (prefilled < 64) {
    const StepPlan plan = run.step(a);
    ++steps;
    EXPECT_LE(step_tokens(plan), 16) << "step " << steps;
    ASSERT_EQ(plan.decodes.size(), 1U) << "the running request decodes in every step";
    ASSERT_EQ(plan.prefills.size(), 1U);
    prefilled += plan.prefills[0].tokens;
    EXPECT_EQ(drain_events(*long_prompt).empty(), prefilled < 64) << "step " << steps;
  }
  EXPECT_EQ(steps, 5);  // 15 prompt tokens a step beside the decode
  const StepPlan next = run.step(a);
  EXPECT_EQ(next.decodes.size(), 2U);
  EXPECT_TRUE(next.prefills.empty());
  const std::vector<RequestEvent> events = drain_events(*long_prompt);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().terminal, Terminal::ok_length);
  EXPECT_EQ(events.back().prompt_tokens, 64U);
}

// A request cancelled in the middle of its prefill is freed at the next step, and its chunks stop.
TEST_F(SchedulerTest, CancellationMidPrefillStopsTheChunksAndFreesTheSequence) {
  SchedulerConfig config;
  config.max_batched_tokens = 16;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  const auto request = chat_request({}, 4, 100);
  ASSERT_TRUE(scheduler.submit(request).ok());
  const StepPlan first = run.step(1);
  ASSERT_EQ(first.starts.size(), 1U);
  run.step(1);
  request->cancel();
  const StepPlan after = run.step(1);
  EXPECT_EQ(after.frees, std::vector<std::uint64_t>{first.starts[0].id});
  EXPECT_TRUE(after.prefills.empty());
  EXPECT_TRUE(scheduler.idle());
  const std::vector<RequestEvent> events = drain_events(*request);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].terminal, Terminal::cancelled);
}

std::shared_ptr<Request> prompt_request(std::vector<std::int32_t> prompt, std::int64_t max_new_tokens = 1) {
  runtime::SamplingParams params;
  params.max_new_tokens = max_new_tokens;
  return std::make_shared<Request>("r", std::move(prompt), params,
                                   OutputForm{.text = false, .stop_strings = {}, .skip_special_tokens = true},
                                   Clock::time_point::max());
}

std::vector<std::int32_t> iota_prompt(std::int32_t first, std::size_t n) {
  std::vector<std::int32_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = first + static_cast<std::int32_t>(i);
  return ids;
}

// A refused step may have left its sequences' blocks unwritten: the rank drops its idle cached blocks
// (RankWorker), and the scheduler's mirror does too, so no later prompt is planned onto them.
TEST_F(SchedulerTest, ARefusedStepLeavesNothingInThePrefixCache) {
  SchedulerConfig config;
  config.prefix_cache = true;
  config.kv_block_size = 16;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  std::vector<std::int32_t> prompt(48);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(100 + i);
  ASSERT_TRUE(scheduler.submit(prompt_request(prompt)).ok());
  const StepPlan plan = scheduler.plan(Clock::now());
  ASSERT_EQ(plan.starts.size(), 1U);
  StepResult result;
  result.ok = false;
  result.error = "boom";
  scheduler.complete(std::span<const StepResult>(&result, 1), {}, Clock::now());
  prompt.push_back(7);
  ASSERT_TRUE(scheduler.submit(prompt_request(prompt)).ok());
  const StepPlan next = scheduler.plan(Clock::now());
  ASSERT_EQ(next.starts.size(), 1U);
  EXPECT_EQ(next.starts[0].cached, 0);
}

// With the prefix cache, a prompt starts after the whole blocks of it that a rank's cache holds — from a
// finished request or a running one — leaving at least one token to compute, and goes to that rank even
// when another is idle; a prompt asking for prompt log-probabilities is computed whole.
TEST_F(SchedulerTest, APromptStartsAfterItsCachedPrefixOnTheRankThatHoldsIt) {
  SchedulerConfig config;
  config.prefix_cache = true;
  config.kv_block_size = 16;
  Scheduler scheduler(config, 2, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  // Two requests occupy rank 0 and rank 1; the first one's prompt spans two whole blocks and a part.
  const std::vector<std::int32_t> shared = iota_prompt(100, 40);
  ASSERT_TRUE(scheduler.submit(prompt_request(shared, 30)).ok());
  ASSERT_TRUE(scheduler.submit(prompt_request(iota_prompt(500, 20), 30)).ok());
  const StepPlan first = run.step(1);
  ASSERT_EQ(first.starts.size(), 2U);
  EXPECT_EQ(first.starts[0].rank, 0);
  EXPECT_EQ(first.starts[1].rank, 1);
  EXPECT_EQ(first.starts[0].cached, 0);

  // The same 32 leading tokens, another tail: 32 cached tokens on rank 0, 13 to compute.
  std::vector<std::int32_t> follow_up(shared.begin(), shared.begin() + 32);
  for (std::int32_t t = 900; t < 913; ++t) follow_up.push_back(t);
  ASSERT_TRUE(scheduler.submit(prompt_request(follow_up)).ok());
  // Exactly the two cached blocks: one block is computed again, for the prompt's last logits.
  ASSERT_TRUE(
      scheduler.submit(prompt_request(std::vector<std::int32_t>(shared.begin(), shared.begin() + 32))).ok());
  runtime::SamplingParams scoring;
  scoring.max_new_tokens = 1;
  scoring.prompt_logprobs = true;
  ASSERT_TRUE(scheduler
                  .submit(std::make_shared<Request>(
                      "r", shared, scoring,
                      OutputForm{.text = false, .stop_strings = {}, .skip_special_tokens = true},
                      Clock::time_point::max()))
                  .ok());
  const StepPlan second = run.step(1);
  ASSERT_EQ(second.starts.size(), 3U);
  EXPECT_EQ(second.starts[0].rank, 0);
  EXPECT_EQ(second.starts[0].cached, 32);
  EXPECT_EQ(second.starts[1].rank, 0);
  EXPECT_EQ(second.starts[1].cached, 16);
  EXPECT_EQ(second.starts[2].cached, 0);
  std::int64_t chunk_of_follow_up = 0;
  for (const PrefillChunk& c : second.prefills) {
    if (c.id == second.starts[0].id) chunk_of_follow_up = c.tokens;
  }
  EXPECT_EQ(chunk_of_follow_up, 13);
}

// Cache affinity yields to balance: a rank more than the slack busier than the least busy one does not get
// the request even though its cache holds the prefix.
TEST_F(SchedulerTest, CacheAffinityYieldsWhenItsRankIsTooBusy) {
  SchedulerConfig config;
  config.prefix_cache = true;
  config.cache_affinity_slack = 0;
  Scheduler scheduler(config, 2, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  const std::vector<std::int32_t> shared = iota_prompt(100, 40);
  ASSERT_TRUE(scheduler.submit(prompt_request(shared, 30)).ok());
  run.step(1);  // rank 0 now runs one sequence, rank 1 none
  ASSERT_TRUE(scheduler.submit(prompt_request(shared)).ok());
  const StepPlan plan = run.step(1);
  ASSERT_EQ(plan.starts.size(), 1U);
  EXPECT_EQ(plan.starts[0].rank, 1);
  EXPECT_EQ(plan.starts[0].cached, 0);
}

// A cached prefix covering less than cache_affinity_min_share of the prompt (a shared system prompt) does not
// pull a request to a busier rank; one covering more does.
TEST_F(SchedulerTest, AShortCachedPrefixDoesNotPullARequestToABusierRank) {
  SchedulerConfig config;
  config.prefix_cache = true;
  config.kv_block_size = 16;
  config.cache_affinity_min_share = 0.5;
  Scheduler scheduler(config, 2, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  const std::vector<std::int32_t> system = iota_prompt(100, 49);
  ASSERT_TRUE(scheduler.submit(prompt_request(system, 30)).ok());
  run.step(1);  // rank 0 runs it and caches its three full blocks; rank 1 runs nothing
  const auto with_tail = [&](std::size_t shared, std::int32_t first, std::int32_t length) {
    std::vector<std::int32_t> prompt(system.begin(), system.begin() + static_cast<std::ptrdiff_t>(shared));
    for (std::int32_t t = first; t < first + length; ++t) prompt.push_back(t);
    return prompt;
  };
  ASSERT_TRUE(scheduler.submit(prompt_request(with_tail(32, 1000, 40))).ok());  // 32 of 72 cached: 44%
  StepPlan plan = run.step(1);
  ASSERT_EQ(plan.starts.size(), 1U);
  EXPECT_EQ(plan.starts[0].rank, 1);
  EXPECT_EQ(plan.starts[0].cached, 0);
  // That one ended (one token) and left its first 32 tokens cached on rank 1 too; rank 0 still runs the
  // first request and holds 48 tokens of the next one: 86% of it, against 57% on the idle rank 1.
  ASSERT_TRUE(scheduler.submit(prompt_request(with_tail(48, 2000, 8))).ok());
  plan = run.step(1);
  ASSERT_EQ(plan.starts.size(), 1U);
  EXPECT_EQ(plan.starts[0].rank, 0);
  EXPECT_EQ(plan.starts[0].cached, 48);
}

// A model whose rope depends on the sequence's length (dynamic NTK) prefills a prompt past that length whole:
// it waits for a step with room for all of it, and one longer than a step is refused naming the flag.
TEST_F(SchedulerTest, PromptsPastAWholePrefillLengthAreNeverChunked) {
  SchedulerConfig config;
  config.max_batched_tokens = 16;
  config.whole_prefill_above = 8;
  Scheduler scheduler(config, 1, &tokenizer_, nullptr, nullptr);
  SchedulerSteps run(scheduler);
  const auto too_long = chat_request({}, 1, 17);
  EXPECT_EQ(scheduler.submit(too_long).code(), runtime::StatusCode::invalid_argument);
  EXPECT_NE(scheduler.limits().check_fits(*too_long).message().find("--max-batched-tokens"),
            std::string::npos);
  const auto running = chat_request({}, 10, 3);
  ASSERT_TRUE(scheduler.submit(running).ok());
  run.step(1);
  // 16 tokens: with the running decode in the step, not all of it fits; it waits, then goes whole.
  const auto whole = chat_request({}, 1, 16);
  ASSERT_TRUE(scheduler.submit(whole).ok());
  const StepPlan waiting = run.step(1);
  EXPECT_TRUE(waiting.starts.empty());
  EXPECT_EQ(waiting.decodes.size(), 1U);
  StepPlan admitted = run.step(1);
  for (int i = 0; i < 12 && admitted.prefills.empty(); ++i) admitted = run.step(1);
  ASSERT_EQ(admitted.prefills.size(), 1U);
  EXPECT_EQ(admitted.prefills[0].tokens, 16);
  EXPECT_TRUE(admitted.decodes.empty()) << "admitted only once the running request ended";
}

}  // namespace
}  // namespace capserve::server
