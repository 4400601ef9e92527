// One rank's step loop over a real engine (the qwen2_moe fixture on the CPU backend): plans in, sampled
// tokens out.
#include "server/rank_worker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <regex>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/capacity_config.h"
#include "runtime/grammar/grammar_cache.h"
#include "runtime/model.h"
#include "runtime/npy.h"
#include "runtime/speculative/ngram_drafter.h"
#include "tests/unit/kernels/log_softmax_reference.h"
#include "tests/unit/kernels/sampling_controls_checks.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::server {
namespace {

constexpr int kDecodeSteps = 5;

// Starts `s` in `plan` with its whole prompt prefilled in this step.
void add_start(StepPlan& plan, const SequenceStart& s) {
  plan.starts.push_back(s);
  plan.prefills.push_back({s.id, static_cast<std::int64_t>(s.prompt.size()) - s.cached});
}

class RankWorkerTest : public ::testing::Test {
 protected:
  RankWorkerTest()
      : backend_(2),
        model_(runtime::Model::load(capserve::testing::fixture_models_dir() / "qwen2_moe", backend_)),
        engine_(*model_, {}) {
    const nlohmann::json ref = capserve::testing::fixture_reference("qwen2_moe");
    for (const auto& p : ref["prompts"]) prompts_.push_back(p["input_ids"].get<std::vector<std::int32_t>>());
  }

  static SequenceStart start(std::uint64_t id, std::int32_t rank, std::vector<std::int32_t> prompt,
                             float temperature = 0.0F, std::uint64_t seed = 0) {
    runtime::SamplingParams params;
    params.temperature = temperature;
    params.seed = seed;
    return {.id = id, .rank = rank, .prompt = std::move(prompt), .params = params};
  }

  // The tokens `worker` samples for `s`: its prefill, then kDecodeSteps decodes.
  static std::vector<std::int32_t> generate(RankWorker& worker, const SequenceStart& s) {
    std::vector<std::int32_t> tokens;
    StepPlan plan;
    add_start(plan, s);
    for (int step = 0; step <= kDecodeSteps; ++step) {
      const StepResult result = worker.run(plan);
      EXPECT_TRUE(result.ok) << result.error;
      EXPECT_EQ(result.sequences.size(), 1U);
      if (result.sequences.size() != 1) break;
      tokens.insert(tokens.end(), result.tokens.begin(), result.tokens.end());
      plan = {};
      plan.decodes.push_back(s.id);
    }
    return tokens;
  }

  // Three sequences side by side for speculative decoding: a prompt repeating itself (the n-gram lookup finds
  // it from the first decode), a plain one, and a seeded sampled one.
  [[nodiscard]] std::vector<SequenceStart> speculation_starts() const {
    std::vector<std::int32_t> looping;
    for (int i = 0; i < 4; ++i) looping.insert(looping.end(), prompts_[1].begin(), prompts_[1].end());
    return {start(1, 0, looping), start(2, 0, prompts_[2]), start(3, 0, prompts_[3], 0.8F, 77)};
  }

  kernels::cpu::CpuBackend backend_;
  std::unique_ptr<runtime::Model> model_;
  runtime::Engine engine_;
  std::vector<std::vector<std::int32_t>> prompts_;
};

TEST_F(RankWorkerTest, PrefillsPlacedOnThisRankYieldOneTokenEachAndOtherRanksAreIgnored) {
  RankWorker worker(engine_, 1);
  StepPlan plan;
  add_start(plan, start(10, 1, prompts_[1]));
  add_start(plan, start(11, 0, prompts_[2]));  // another rank's
  add_start(plan, start(12, 1, prompts_[3]));
  plan.decodes.push_back(13);  // another rank's running sequence
  const StepResult result = worker.run(plan);
  ASSERT_TRUE(result.ok) << result.error;
  ASSERT_EQ(result.sequences.size(), 2U);
  EXPECT_EQ(result.sequences[0].id, 10U);
  EXPECT_EQ(result.sequences[1].id, 12U);
  ASSERT_EQ(result.tokens.size(), 2U);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(result.sequences[i].failure, SequenceFailure::none);
    EXPECT_EQ(result.sequences[i].tokens, 1);
    EXPECT_EQ(result.sequences[i].drafted, 0);
    EXPECT_GE(result.tokens[i], 0);
    EXPECT_LT(result.tokens[i], model_->config().vocab_size);
  }
  EXPECT_EQ(worker.sequences(), 2U);
  EXPECT_EQ(engine_.length(10), static_cast<std::int64_t>(prompts_[1].size()));
  EXPECT_EQ(engine_.length(11), 0);
  EXPECT_EQ(engine_.length(12), static_cast<std::int64_t>(prompts_[3].size()));
}

// Greedy decoding through plans gives the tokens of the engine driven directly, each the argmax of the
// logits.
TEST_F(RankWorkerTest, DecodesContinueSequencesAsTheEngineDoes) {
  const std::vector<std::int32_t>& prompt = prompts_[2];
  std::vector<std::int32_t> expected;
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  std::vector<std::int32_t> next = prompt;
  for (int step = 0; step <= kDecodeSteps; ++step) {
    const runtime::Engine::Work w{99, next, false};
    ASSERT_TRUE(engine_.step(std::span(&w, 1)).ok());
    const auto row = engine_.logits().subspan(0, vocab);
    next = {static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin())};
    expected.push_back(next[0]);
  }
  engine_.release(99);

  RankWorker worker(engine_, 0);
  EXPECT_EQ(generate(worker, start(1, 0, prompt)), expected);
  EXPECT_EQ(engine_.length(1), static_cast<std::int64_t>(prompt.size()) + kDecodeSteps);
}

TEST_F(RankWorkerTest, FreesReleaseSequences) {
  RankWorker worker(engine_, 0);
  StepPlan plan;
  add_start(plan, start(1, 0, prompts_[1]));
  add_start(plan, start(2, 0, prompts_[2]));
  ASSERT_TRUE(worker.run(plan).ok);
  ASSERT_EQ(worker.sequences(), 2U);

  plan = {};
  plan.frees = {1, 77};   // 77: never on this rank
  plan.decodes = {1, 2};  // the freed sequence's decode is no longer this rank's
  const StepResult result = worker.run(plan);
  ASSERT_TRUE(result.ok) << result.error;
  ASSERT_EQ(result.sequences.size(), 1U);
  EXPECT_EQ(result.sequences[0].id, 2U);
  EXPECT_EQ(worker.sequences(), 1U);
  EXPECT_EQ(engine_.length(1), 0);
  EXPECT_EQ(engine_.length(2), static_cast<std::int64_t>(prompts_[2].size()) + 1);

  plan = {};
  plan.frees = {2};
  ASSERT_TRUE(worker.run(plan).ok);
  EXPECT_EQ(worker.sequences(), 0U);
  EXPECT_EQ(engine_.length(2), 0);
}

// Sampling draws from the request's seed and the sequence's own step count, so a seeded request repeats.
TEST_F(RankWorkerTest, SeededSamplingIsReproducible) {
  RankWorker first(engine_, 0);
  const std::vector<std::int32_t> a = generate(first, start(1, 0, prompts_[1], 1.0F, 1234));
  RankWorker second(engine_, 0);
  const std::vector<std::int32_t> b = generate(second, start(2, 0, prompts_[1], 1.0F, 1234));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), static_cast<std::size_t>(kDecodeSteps) + 1);
}

// A plan the engine refuses (here a prompt token outside the vocabulary, or a sequence twice in one step)
// fails the rank's whole step with the engine's reason; every sequence of the step is dropped and released,
// and the next plan runs normally.
TEST_F(RankWorkerTest, ARefusedStepDropsItsSequencesAndReportsWhy) {
  RankWorker worker(engine_, 0);
  StepPlan plan;
  add_start(plan, start(1, 0, prompts_[1]));
  ASSERT_TRUE(worker.run(plan).ok);

  plan = {};
  add_start(plan, start(2, 0, {5, static_cast<std::int32_t>(model_->config().vocab_size)}));
  plan.decodes.push_back(1);
  StepResult result = worker.run(plan);
  EXPECT_FALSE(result.ok);
  EXPECT_NE(result.error.find("outside the vocabulary"), std::string::npos) << result.error;
  EXPECT_TRUE(result.sequences.empty());
  EXPECT_EQ(worker.sequences(), 0U);
  EXPECT_EQ(engine_.length(1), 0);
  EXPECT_EQ(engine_.length(2), 0);

  plan = {};
  add_start(plan, start(3, 0, prompts_[1]));
  ASSERT_TRUE(worker.run(plan).ok);
  plan = {};
  plan.decodes = {3, 3};
  result = worker.run(plan);
  EXPECT_FALSE(result.ok);
  EXPECT_NE(result.error.find("appears twice"), std::string::npos) << result.error;
  EXPECT_EQ(worker.sequences(), 0U);
  EXPECT_EQ(engine_.length(3), 0);

  plan = {};
  add_start(plan, start(4, 0, prompts_[1]));
  result = worker.run(plan);
  ASSERT_TRUE(result.ok) << result.error;
  EXPECT_EQ(result.sequences.size(), 1U);
}

// A sequence asking for log-probabilities gets, at its prefill, one record per prompt token after the first
// (each equal to log_softmax of transformers' prompt logits) and one for its sampled token, each with its
// top_logprobs alternatives; a sequence beside it that asks nothing gets none, and its token is unchanged.
TEST_F(RankWorkerTest, ReportsPromptAndSampledLogprobsOfTheSequencesThatAsk) {
  const nlohmann::json prompt = capserve::testing::fixture_reference("qwen2_moe")["prompts"][3];
  const runtime::NpyArray logits = runtime::read_npy(capserve::testing::fixture_models_dir() / "qwen2_moe" /
                                                     prompt["prompt_logits"].get<std::string>());
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  const std::vector<std::int32_t>& ids = prompts_[3];
  const auto greedy = prompt["greedy_ids"].get<std::vector<std::int32_t>>();
  RankWorker worker(engine_, 0);
  StepPlan plan;
  add_start(plan, start(1, 0, prompts_[1]));
  SequenceStart asking = start(2, 0, ids);
  asking.params.logprobs = true;
  asking.params.prompt_logprobs = true;
  asking.params.top_logprobs = 3;
  add_start(plan, asking);
  StepResult result = worker.run(plan);
  ASSERT_TRUE(result.ok) << result.error;
  ASSERT_EQ(result.sequences.size(), 2U);
  EXPECT_EQ(result.tokens.at(1), greedy[0]);
  ASSERT_EQ(result.logprobs.size(), ids.size());
  ASSERT_EQ(result.top_logprobs.size(), 3 * ids.size());
  for (std::size_t r = 0; r < ids.size(); ++r) {
    const LogprobRecord& rec = result.logprobs[r];
    EXPECT_EQ(rec.id, 2U);
    EXPECT_EQ(rec.top_count, 3);
    const bool sampled = r + 1 == ids.size();
    EXPECT_EQ(rec.prompt, sampled ? 0 : 1) << "record " << r;
    EXPECT_EQ(rec.token, sampled ? greedy[0] : ids[r + 1]) << "record " << r;
    const std::span<const float> row(logits.data.data() + r * vocab, vocab);
    const std::vector<double> expected = capserve::testing::log_softmax(row);
    const std::vector<std::int32_t> ranked = capserve::testing::ranked_ids(row);
    EXPECT_NEAR(rec.logprob, expected[static_cast<std::size_t>(rec.token)], 1e-4) << "record " << r;
    for (std::size_t j = 0; j < 3; ++j) {
      EXPECT_EQ(result.top_logprobs[3 * r + j].token, ranked[j]) << "record " << r;
      EXPECT_NEAR(result.top_logprobs[3 * r + j].logprob, expected[static_cast<std::size_t>(ranked[j])],
                  1e-4);
    }
  }

  plan = {};
  plan.decodes = {1, 2};
  result = worker.run(plan);
  ASSERT_TRUE(result.ok) << result.error;
  ASSERT_EQ(result.logprobs.size(), 1U) << "one sampled token, no prompt";
  EXPECT_EQ(result.logprobs[0].id, 2U);
  EXPECT_EQ(result.logprobs[0].token, greedy[1]);
  EXPECT_EQ(result.logprobs[0].prompt, 0);
  EXPECT_EQ(result.top_logprobs.size(), 3U);
  EXPECT_EQ(result.top_logprobs[0].token, greedy[1]) << "greedy takes the most likely token";
  EXPECT_EQ(result.top_logprobs[0].logprob, result.logprobs[0].logprob);
}

// The n-gram drafter, counting its calls: one per step for all of a rank's decodes.
class CountingDrafter final : public runtime::Drafter {
 public:
  CountingDrafter(std::int64_t k) : inner_(k, 1, 4) {}
  [[nodiscard]] std::int64_t max_drafts() const override { return inner_.max_drafts(); }
  void propose(std::span<const runtime::DraftSlot> slots, std::span<std::int64_t> counts) override {
    ++calls;
    inner_.propose(slots, counts);
  }
  int calls = 0;

 private:
  runtime::NgramDrafter inner_;
};

// What a worker generated for several sequences decoded side by side: their tokens, and the drafts verified
// and kept.
struct Generated {
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<std::vector<LogprobRecord>> logprobs;  // each sequence's sampled tokens' records, in order
  std::int64_t drafted = 0, accepted = 0;
  int steps = 0;
};

// Runs `starts` on `worker` (rank 0) until every sequence has at least `count` tokens, letting each decode
// verify up to `max_drafts` drafts.
Generated generate_all(RankWorker& worker, const std::vector<SequenceStart>& starts, std::size_t count,
                       std::int32_t max_drafts) {
  Generated g;
  g.tokens.resize(starts.size());
  g.logprobs.resize(starts.size());
  StepPlan plan;
  for (const SequenceStart& s : starts) add_start(plan, s);
  while (true) {
    const StepResult result = worker.run(plan);
    ++g.steps;
    EXPECT_TRUE(result.ok) << result.error;
    EXPECT_EQ(result.sequences.size(), starts.size());
    if (!result.ok || result.sequences.size() != starts.size()) break;
    std::size_t token = 0;
    for (std::size_t i = 0; i < starts.size(); ++i) {
      const SequenceResult& s = result.sequences[i];
      EXPECT_EQ(s.id, starts[i].id);
      EXPECT_EQ(s.failure, SequenceFailure::none);
      EXPECT_LE(s.drafted, max_drafts);
      EXPECT_EQ(s.tokens, s.accepted + 1);
      g.drafted += s.drafted;
      g.accepted += s.accepted;
      g.tokens[i].insert(g.tokens[i].end(), result.tokens.begin() + static_cast<std::ptrdiff_t>(token),
                         result.tokens.begin() + static_cast<std::ptrdiff_t>(token + s.tokens));
      token += static_cast<std::size_t>(s.tokens);
    }
    EXPECT_EQ(token, result.tokens.size());
    for (const LogprobRecord& r : result.logprobs) {
      EXPECT_TRUE(r.prompt == 0 || g.steps == 1) << "a prompt record after the prefill, step " << g.steps;
      for (std::size_t i = 0; i < starts.size(); ++i) {
        if (r.prompt == 0 && r.id == starts[i].id) g.logprobs[i].push_back(r);
      }
    }
    if (std::all_of(g.tokens.begin(), g.tokens.end(), [&](const auto& t) { return t.size() >= count; }))
      break;
    plan = {};
    for (const SequenceStart& s : starts) {
      plan.decodes.push_back(s.id);
      plan.max_drafts.push_back(max_drafts);
    }
  }
  return g;
}

// Speculative decoding: with an n-gram drafter the worker verifies drafts (proposed in one call per step for
// all its decodes) and keeps exactly the tokens of decoding without them, greedy and seeded sampling alike;
// each sequence's cache holds its prompt and every kept token but the last (the rejected drafts rolled back).
TEST_F(RankWorkerTest, SpeculationKeepsTheTokensOfPlainDecodingWithFewerSteps) {
  constexpr std::size_t kTokens = 24;
  const std::vector<SequenceStart> starts = speculation_starts();
  RankWorker plain(engine_, 0);
  const Generated expected = generate_all(plain, starts, kTokens, 0);
  for (const SequenceStart& s : starts) engine_.release(s.id);
  EXPECT_EQ(expected.drafted, 0);

  CountingDrafter drafter(3);
  RankWorker speculating(engine_, 0, &drafter);
  const Generated got = generate_all(speculating, starts, kTokens, 3);
  EXPECT_GT(got.drafted, 0) << "the n-gram drafter proposed nothing";
  EXPECT_GT(got.accepted, 0) << "no draft was kept";
  EXPECT_EQ(drafter.calls, got.steps - 1) << "one proposal per decode step";
  for (std::size_t i = 0; i < starts.size(); ++i) {
    const std::vector<std::int32_t>& want = expected.tokens[i];
    std::vector<std::int32_t> have = got.tokens[i];
    ASSERT_GE(have.size(), kTokens);
    EXPECT_EQ(std::vector<std::int32_t>(have.begin(), have.begin() + kTokens),
              std::vector<std::int32_t>(want.begin(), want.begin() + kTokens))
        << "sequence " << starts[i].id;
    EXPECT_EQ(engine_.length(starts[i].id),
              static_cast<std::int64_t>(starts[i].prompt.size() + have.size()) - 1)
        << "sequence " << starts[i].id;
  }
}

// Speculative decoding reports one log-probability record per kept token, each scored on its own row's
// logits: the records of decoding without drafts (a verifying decode's rows are never prompt records).
TEST_F(RankWorkerTest, SpeculationReportsALogprobForEveryKeptToken) {
  constexpr std::size_t kTokens = 24;
  std::vector<SequenceStart> starts = speculation_starts();
  for (SequenceStart& s : starts) {
    s.params.logprobs = true;
    s.params.prompt_logprobs = true;
    s.params.top_logprobs = 2;
  }
  RankWorker plain(engine_, 0);
  const Generated expected = generate_all(plain, starts, kTokens, 0);
  for (const SequenceStart& s : starts) engine_.release(s.id);
  CountingDrafter drafter(3);
  RankWorker speculating(engine_, 0, &drafter);
  const Generated got = generate_all(speculating, starts, kTokens, 3);
  ASSERT_GT(got.accepted, 0);
  for (std::size_t i = 0; i < starts.size(); ++i) {
    ASSERT_EQ(got.logprobs[i].size(), got.tokens[i].size()) << "sequence " << i;
    for (std::size_t j = 0; j < kTokens; ++j) {
      EXPECT_EQ(got.logprobs[i][j].token, got.tokens[i][j]) << "sequence " << i << " token " << j;
      EXPECT_EQ(got.logprobs[i][j].token, expected.logprobs[i][j].token)
          << "sequence " << i << " token " << j;
      EXPECT_NEAR(got.logprobs[i][j].logprob, expected.logprobs[i][j].logprob, 1e-4)
          << "sequence " << i << " token " << j;
    }
  }
}

// A plan that allows no drafts (the request's last token, or no room in the step) feeds the lone token.
TEST_F(RankWorkerTest, ADecodeWithoutDraftRoomFeedsOneToken) {
  std::vector<std::int32_t> looping;
  for (int i = 0; i < 4; ++i) looping.insert(looping.end(), prompts_[1].begin(), prompts_[1].end());
  CountingDrafter drafter(3);
  RankWorker worker(engine_, 0, &drafter);
  const Generated got = generate_all(worker, {start(1, 0, looping)}, 4, 0);
  EXPECT_EQ(got.drafted, 0);
  EXPECT_EQ(got.steps, 4);
  EXPECT_EQ(engine_.length(1), static_cast<std::int64_t>(looping.size()) + 3);
}

// What a rank samples for one greedy sequence whose prompt arrives in chunks of `chunk` tokens (the first
// after `cached` tokens from the prefix cache), then `decodes` decodes; and its prompt log-probabilities
// when it asks.
struct ChunkedRun {
  std::vector<std::int32_t> tokens;
  std::vector<float> prompt_logprobs;
};

ChunkedRun run_chunked(RankWorker& worker, std::uint64_t id, const std::vector<std::int32_t>& prompt,
                       std::int64_t cached, std::int64_t chunk, int decodes, bool prompt_logprobs = false) {
  ChunkedRun out;
  StepPlan plan;
  SequenceStart s{.id = id, .rank = 0, .prompt = prompt, .cached = cached, .params = {}};
  s.params.prompt_logprobs = prompt_logprobs;
  plan.starts.push_back(s);
  std::int64_t done = cached;
  const auto total = static_cast<std::int64_t>(prompt.size());
  while (true) {
    if (done < total) {
      const std::int64_t n = std::min(chunk, total - done);
      plan.prefills.push_back({id, n});
      done += n;
    } else {
      plan.decodes.push_back(id);
    }
    const StepResult result = worker.run(plan);
    EXPECT_TRUE(result.ok) << result.error;
    if (!result.ok) break;
    out.tokens.insert(out.tokens.end(), result.tokens.begin(), result.tokens.end());
    for (const LogprobRecord& r : result.logprobs) {
      if (r.prompt != 0) out.prompt_logprobs.push_back(r.logprob);
    }
    if (static_cast<int>(out.tokens.size()) > decodes) break;
    plan = {};
  }
  return out;
}

class ChunkedPrefillTest : public ::testing::TestWithParam<std::string> {};

// On every fixture architecture (greedy, no capacity factor): a prompt prefilled in chunks through the
// worker samples what it samples whole, with the same prompt log-probabilities; and a prompt started after
// the prefix another sequence left in the cache samples the same too. Dynamic NTK rope turns a step's new
// keys with the frequencies of the sequence's length once it passes max_position_embeddings, so there only
// prompts within it are chunked (the server prefills longer ones whole and keeps no prefix cache).
TEST_P(ChunkedPrefillTest, ChunksAndACachedPrefixSampleWhatAWholePrefillSamples) {
  kernels::cpu::CpuBackend backend(2);
  const auto model = runtime::Model::load(capserve::testing::fixture_models_dir() / GetParam(), backend);
  const nlohmann::json ref = capserve::testing::fixture_reference(GetParam());
  const auto vocab = static_cast<std::int32_t>(model->config().vocab_size);
  std::vector<std::int32_t> prompt = ref["prompts"][1]["input_ids"].get<std::vector<std::int32_t>>();
  while (prompt.size() < 40) prompt.push_back(static_cast<std::int32_t>((prompt.size() * 37 + 5) % vocab));
  const runtime::ModelConfig& config = model->config();
  const bool dynamic_rope = config.rope_scaling.type == runtime::RopeScaling::Type::dynamic;
  if (dynamic_rope) prompt.resize(static_cast<std::size_t>(config.max_position_embeddings));
  constexpr int kDecodes = 6;

  runtime::Engine plain(*model, {});
  RankWorker whole_worker(plain, 0);
  const ChunkedRun whole = run_chunked(whole_worker, 1, prompt, 0, 1 << 20, kDecodes, true);
  ASSERT_EQ(whole.prompt_logprobs.size(), prompt.size() - 1);
  for (const std::int64_t chunk : {1, 7, 16}) {
    const ChunkedRun chunked =
        run_chunked(whole_worker, 10 + static_cast<std::uint64_t>(chunk), prompt, 0, chunk, kDecodes, true);
    EXPECT_EQ(chunked.tokens, whole.tokens) << "chunks of " << chunk;
    ASSERT_EQ(chunked.prompt_logprobs.size(), whole.prompt_logprobs.size()) << "chunks of " << chunk;
    for (std::size_t i = 0; i < whole.prompt_logprobs.size(); ++i)
      EXPECT_NEAR(chunked.prompt_logprobs[i], whole.prompt_logprobs[i], 1e-4)
          << "chunks of " << chunk << " at " << i;
  }

  if (dynamic_rope) return;
  runtime::EngineOptions caching;
  caching.prefix_cache = true;
  runtime::Engine cached_engine(*model, caching);
  RankWorker cached_worker(cached_engine, 0);
  // Another prompt with the same first 32 tokens leaves them cached when it ends.
  std::vector<std::int32_t> other(prompt.begin(), prompt.begin() + 32);
  other.push_back((prompt[32] + 1) % vocab);
  run_chunked(cached_worker, 1, other, 0, 1 << 20, 1);
  StepPlan free;
  free.frees.push_back(1);
  ASSERT_TRUE(cached_worker.run(free).ok);
  ASSERT_EQ(cached_engine.cache().blocks().cached_prefix(prompt), 32);
  const ChunkedRun reused = run_chunked(cached_worker, 2, prompt, 32, 5, kDecodes);
  EXPECT_EQ(reused.tokens, whole.tokens);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ChunkedPrefillTest,
                         ::testing::ValuesIn(capserve::testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

// ---- Sampling controls through the worker (kernels/sampling.h), on the model's real logits.

// logit_bias +100 on a token the model would not choose makes greedy decoding choose it every time; -100 on
// the greedy first token makes it choose another.
TEST_F(RankWorkerTest, LogitBiasSteersGreedyDecoding) {
  RankWorker worker(engine_, 0);
  const std::vector<std::int32_t> plain = generate(worker, start(1, 0, prompts_[1]));
  const std::int32_t favoured = plain[0] == 7 ? 8 : 7;
  ASSERT_EQ(std::count(plain.begin(), plain.end(), favoured), 0) << "pick a token greedy decoding avoids";
  SequenceStart biased = start(2, 0, prompts_[1]);
  biased.params.logit_bias = {{favoured, 100.0F}};
  EXPECT_EQ(generate(worker, biased), std::vector<std::int32_t>(kDecodeSteps + 1, favoured));
  SequenceStart banned = start(3, 0, prompts_[1]);
  banned.params.logit_bias = {{plain[0], -100.0F}};
  const std::vector<std::int32_t> other = generate(worker, banned);
  EXPECT_NE(other[0], plain[0]);
}

// min_tokens keeps the stop ids (EOS among them unless ignore_eos) out of the first min_tokens draws: with
// the greedy first token as the "EOS", it comes only once min_tokens tokens were generated.
TEST_F(RankWorkerTest, MinTokensDelaysTheStopIds) {
  RankWorker worker(engine_, 0);
  const std::vector<std::int32_t> plain = generate(worker, start(1, 0, prompts_[2]));
  const std::int32_t eos = plain[0];
  for (const std::int64_t min_tokens : {0, 2, 4}) {
    SequenceStart s = start(10 + static_cast<std::uint64_t>(min_tokens), 0, prompts_[2]);
    s.params.stop_token_ids = {eos};
    s.params.max_new_tokens = 16;
    s.params.min_tokens = min_tokens;
    const std::vector<std::int32_t> got = generate(worker, s);
    for (std::int64_t i = 0; i < min_tokens; ++i)
      EXPECT_NE(got[static_cast<std::size_t>(i)], eos) << "min_tokens " << min_tokens << ", token " << i;
    if (min_tokens == 0) {
      EXPECT_EQ(got[0], eos);
    }
  }
}

// Penalties over the sequence's own tokens: each greedy draw is the first maximum of the step's raw logits
// adjusted by the reference (vLLM's definitions) over the prompt and the tokens generated so far.
TEST_F(RankWorkerTest, PenaltiesFollowTheReferenceOverPromptAndGeneratedTokens) {
  RankWorker worker(engine_, 0);
  // A prompt that holds what greedy decoding would continue it with, so that the penalties bite.
  std::vector<std::int32_t> prompt = prompts_[1];
  const std::vector<std::int32_t> plain = generate(worker, start(1, 0, prompt));
  prompt.insert(prompt.end(), plain.begin(), plain.end());
  prompt.insert(prompt.end(), prompts_[1].begin(), prompts_[1].end());
  SequenceStart s = start(2, 0, prompt);
  s.params.repetition_penalty = 4.0F;
  s.params.frequency_penalty = 2.0F;
  s.params.presence_penalty = 1.5F;
  std::vector<std::int32_t> generated;
  int steered = 0;  // steps whose draw differs from the raw logits' greedy choice
  StepPlan plan;
  add_start(plan, s);
  for (int step = 0; step <= kDecodeSteps; ++step) {
    const StepResult result = worker.run(plan);
    ASSERT_TRUE(result.ok) << result.error;
    ASSERT_EQ(result.tokens.size(), 1U);
    const std::span<const float> logits = engine_.logits();
    std::vector<std::int32_t> history = prompt;
    history.insert(history.end(), generated.begin(), generated.end());
    const kernels::SampleControls c{.presence_penalty = s.params.presence_penalty,
                                    .frequency_penalty = s.params.frequency_penalty,
                                    .repetition_penalty = s.params.repetition_penalty,
                                    .history = {0, static_cast<std::int64_t>(history.size())},
                                    .prompt_tokens = static_cast<std::int64_t>(prompt.size())};
    const std::vector<float> want =
        capserve::test::reference_adjusted(logits, {.controls = std::span(&c, 1), .history = history}, 0);
    EXPECT_EQ(result.tokens[0], std::max_element(want.begin(), want.end()) - want.begin()) << "step " << step;
    steered += result.tokens[0] != std::max_element(logits.begin(), logits.end()) - logits.begin() ? 1 : 0;
    generated.push_back(result.tokens[0]);
    plan = {};
    plan.decodes.push_back(s.id);
  }
  EXPECT_GT(steered, 0) << "the penalties changed no draw: the check above cannot fail";
}

// Speculative decoding keeps the tokens of plain decoding under every control: each verified row counts the
// drafts before it in its penalties and its min_tokens.
TEST_F(RankWorkerTest, SpeculationKeepsTheTokensOfPlainDecodingUnderSamplingControls) {
  constexpr std::size_t kTokens = 16;
  std::vector<SequenceStart> starts = speculation_starts();
  for (SequenceStart& s : starts) {
    s.params.repetition_penalty = 1.3F;
    s.params.frequency_penalty = 0.3F;
    s.params.presence_penalty = 0.2F;
    s.params.min_p = 0.05F;
    s.params.logit_bias = {{5, 2.0F}};
    s.params.stop_token_ids = {s.prompt.back()};
    s.params.min_tokens = 6;
    s.params.max_new_tokens = 64;
  }
  RankWorker plain(engine_, 0);
  const Generated expected = generate_all(plain, starts, kTokens, 0);
  for (const SequenceStart& s : starts) engine_.release(s.id);
  CountingDrafter drafter(3);
  RankWorker speculating(engine_, 0, &drafter);
  const Generated got = generate_all(speculating, starts, kTokens, 3);
  EXPECT_GT(got.drafted, 0) << "the n-gram drafter proposed nothing";
  for (std::size_t i = 0; i < starts.size(); ++i) {
    ASSERT_GE(got.tokens[i].size(), kTokens);
    EXPECT_EQ(std::vector<std::int32_t>(got.tokens[i].begin(), got.tokens[i].begin() + kTokens),
              std::vector<std::int32_t>(expected.tokens[i].begin(), expected.tokens[i].begin() + kTokens))
        << "sequence " << starts[i].id;
  }
}

// ---- Output constraints (SamplingParams::constraint) through the worker.

constexpr std::int32_t kStopToken = 40;

// A vocabulary over the fixture model's 512 ids: 0-9 spell the digits, 10-35 the letters a-z, 36 "ab", the
// others nothing (special tokens); kStopToken ends a complete output.
runtime::grammar::GrammarCache fixture_grammars() {
  std::vector<std::optional<std::string>> bytes(512);
  for (int i = 0; i < 10; ++i)
    bytes[static_cast<std::size_t>(i)] = std::string(1, static_cast<char>('0' + i));
  for (int i = 0; i < 26; ++i)
    bytes[static_cast<std::size_t>(10 + i)] = std::string(1, static_cast<char>('a' + i));
  bytes[36] = "ab";
  return runtime::grammar::GrammarCache(std::make_shared<const runtime::grammar::TokenVocabulary>(
                                            std::move(bytes), std::vector<std::int32_t>{kStopToken}),
                                        4);
}

// Each sequence's tokens until it draws kStopToken (included) or has `limit` tokens, decoded side by side
// with up to `max_drafts` drafts per decode; `accepted` counts the drafts kept.
std::vector<std::vector<std::int32_t>> generate_until_stop(RankWorker& worker,
                                                           const std::vector<SequenceStart>& starts,
                                                           std::size_t limit, std::int32_t max_drafts,
                                                           std::int64_t* accepted = nullptr) {
  std::vector<std::vector<std::int32_t>> tokens(starts.size());
  const auto done = [&](std::size_t i) {
    return tokens[i].size() >= limit || (!tokens[i].empty() && tokens[i].back() == kStopToken);
  };
  StepPlan plan;
  for (const SequenceStart& s : starts) add_start(plan, s);
  while (true) {
    const StepResult result = worker.run(plan);
    EXPECT_TRUE(result.ok) << result.error;
    if (!result.ok) break;
    std::size_t token = 0;
    for (const SequenceResult& out : result.sequences) {
      EXPECT_EQ(out.failure, SequenceFailure::none) << "sequence " << out.id;
      if (accepted != nullptr) *accepted += out.accepted;
      const auto i = static_cast<std::size_t>(
          std::find_if(starts.begin(), starts.end(), [&](const SequenceStart& s) { return s.id == out.id; }) -
          starts.begin());
      for (std::int32_t k = 0; k < out.tokens; ++k) {
        if (!done(i)) tokens[i].push_back(result.tokens[token]);
        ++token;
      }
    }
    plan = {};
    for (std::size_t i = 0; i < starts.size(); ++i) {
      if (done(i)) {
        plan.frees.push_back(starts[i].id);
        continue;
      }
      plan.decodes.push_back(starts[i].id);
      plan.max_drafts.push_back(max_drafts);
    }
    if (plan.decodes.empty()) {
      worker.run(plan);  // frees the last ones
      break;
    }
  }
  return tokens;
}

std::string spelled(std::span<const std::int32_t> tokens) {
  std::string text;
  for (const std::int32_t t : tokens) {
    if (t < 10) text += static_cast<char>('0' + t);
    if (t >= 10 && t < 36) text += static_cast<char>('a' + t - 10);
    if (t == 36) text += "ab";
  }
  return text;
}

// Greedy decoding under a regex: every draw is a token the grammar allows, the text matches the whole regex,
// and the stop token comes once it is complete; a sequence without a constraint beside it draws exactly what
// it draws alone.
TEST_F(RankWorkerTest, AConstrainedSequenceDrawsOnlyWhatItsGrammarAllows) {
  runtime::grammar::GrammarCache grammars = fixture_grammars();
  const std::string regex = "[a-c]{2,5}[0-9]{1,3}";
  SequenceStart constrained = start(1, 0, prompts_[1]);
  constrained.params.constraint = nlohmann::json{{"regex", regex}}.dump();
  const SequenceStart free = start(2, 0, prompts_[2]);

  RankWorker alone(engine_, 0, nullptr, &grammars);
  const std::vector<std::int32_t> unconstrained = generate_until_stop(alone, {free}, 12, 0)[0];
  RankWorker worker(engine_, 0, nullptr, &grammars);
  const auto tokens = generate_until_stop(worker, {constrained, free}, 12, 0);
  ASSERT_FALSE(tokens[0].empty());
  EXPECT_EQ(tokens[0].back(), kStopToken);
  const std::span<const std::int32_t> text(tokens[0].data(), tokens[0].size() - 1);
  for (const std::int32_t t : text) EXPECT_TRUE(t <= 12 || t == 36) << "token " << t << " spells no [a-c0-9]";
  EXPECT_TRUE(std::regex_match(spelled(text), std::regex(regex))) << spelled(text);
  EXPECT_EQ(tokens[1], unconstrained);
  EXPECT_EQ(worker.sequences(), 0U);
}

// Speculative decoding under a constraint keeps the tokens of plain decoding under it: each verified row's
// mask follows the drafts before it, and the drafts the grammar refuses are never kept.
TEST_F(RankWorkerTest, SpeculationKeepsTheTokensOfPlainDecodingUnderAConstraint) {
  runtime::grammar::GrammarCache grammars = fixture_grammars();
  std::vector<SequenceStart> starts = speculation_starts();
  const std::string constraints[] = {R"({"regex": "([a-z][0-9])+"})", R"({"choice": ["abc", "ab9", "b1b2"]})",
                                     R"({"regex": "[0-9a-f]{6,10}"})"};
  for (std::size_t i = 0; i < starts.size(); ++i) starts[i].params.constraint = constraints[i];
  RankWorker plain(engine_, 0, nullptr, &grammars);
  const auto expected = generate_until_stop(plain, starts, 16, 0);
  CountingDrafter drafter(3);
  RankWorker speculating(engine_, 0, &drafter, &grammars);
  std::int64_t accepted = 0;
  EXPECT_EQ(generate_until_stop(speculating, starts, 16, 3, &accepted), expected);
  EXPECT_GT(accepted, 0) << "no draft was kept: the masks of rows after a draft went untested";
}

// A rank that cannot compile a sequence's constraint (no vocabulary here) fails that sequence at its first
// draw, naming why in its log; rank 0 ends the request with an error.
TEST_F(RankWorkerTest, AConstraintThisRankCannotCompileFailsItsSequence) {
  RankWorker worker(engine_, 0);
  SequenceStart s = start(1, 0, prompts_[1]);
  s.params.constraint = R"({"regex": "[a-c]+"})";
  StepPlan plan;
  add_start(plan, s);
  const StepResult result = worker.run(plan);
  ASSERT_TRUE(result.ok);
  ASSERT_EQ(result.sequences.size(), 1U);
  EXPECT_EQ(result.sequences[0].failure, SequenceFailure::constraint);
  EXPECT_EQ(result.sequences[0].tokens, 0);
}

// ---- Capacity classes: protected sequences (SamplingParams::protect).

// Under a capacity factor that drops, a protected sequence loses no expert assignment, so it decodes exactly
// as the model without capacity does, while the standard sequences beside it lose some.
TEST_F(RankWorkerTest, AProtectedSequenceIsNeverDroppedAndDecodesAsTheExactModel) {
  runtime::ParallelOptions options;
  options.capacity.gamma = {0.5};
  options.capacity.policy = parallel::CapacityPolicy::drop;
  const auto capped_model =
      runtime::Model::load(capserve::testing::fixture_models_dir() / "qwen2_moe", backend_, options);
  runtime::Engine capped(*capped_model, {});
  std::vector<SequenceStart> starts;
  for (std::uint64_t i = 0; i < 4; ++i) starts.push_back(start(i + 1, 0, prompts_[i % prompts_.size()]));
  starts[1].params.protect = true;

  RankWorker exact(engine_, 0);
  const std::vector<std::int32_t> expected = generate(exact, starts[1]);
  RankWorker worker(capped, 0);
  std::vector<std::vector<std::int32_t>> tokens(starts.size());
  std::vector<std::int64_t> dropped(starts.size(), 0);
  StepPlan plan;
  for (const SequenceStart& s : starts) add_start(plan, s);
  for (int step = 0; step <= kDecodeSteps; ++step) {
    const StepResult result = worker.run(plan);
    ASSERT_TRUE(result.ok) << result.error;
    ASSERT_EQ(result.sequences.size(), starts.size());
    for (std::size_t i = 0; i < starts.size(); ++i) {
      dropped[i] += result.sequences[i].dropped;
      tokens[i].push_back(result.tokens[i]);
    }
    plan = {};
    for (const SequenceStart& s : starts) plan.decodes.push_back(s.id);
  }
  EXPECT_EQ(dropped[1], 0);
  EXPECT_EQ(tokens[1], expected);
  EXPECT_GT(dropped[0] + dropped[2] + dropped[3], 0)
      << "the capacity factor dropped nothing: the test cannot fail";
}

}  // namespace
}  // namespace capserve::server
