// DeepSeek-V3's multi-token-prediction layer as speculative decoding's draft: loading it (the rank's own
// experts, refusals naming the cause), its logits against tools/mtp_reference.py's goldens in both
// DeepSeek-V3 fixtures (the catch-up over a prompt and the chain of drafts after it, 1e-4 relative as the HF
// parity tests), and greedy decoding with MTP drafts equal to plain greedy decoding, sampled tokens equal per
// seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/npy.h"
#include "runtime/speculative/mtp_drafter.h"
#include "runtime/speculative/speculation_config.h"
#include "tests/unit/runtime/decode_params.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

using Tokens = std::vector<std::int32_t>;
constexpr double kTolerance = 1e-4;  // max|diff| <= 1e-4 * max|logit|, as test_hf_parity

ParallelOptions with_mtp() {
  ParallelOptions options;
  options.mtp = true;
  return options;
}

class MtpFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    model_ = Model::load(dir(), backend_, with_mtp());
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{});
    reference_ = testing::fixture_reference(GetParam());
  }
  [[nodiscard]] std::filesystem::path dir() const { return testing::fixture_models_dir() / GetParam(); }

  std::vector<Generation> run(const std::vector<Tokens>& prompts, const SamplingParams& params,
                              Drafter* drafter, SpeculationStats* stats = nullptr) {
    std::vector<Generation> out;
    const std::vector<SamplingParams> all(prompts.size(), params);
    const Status s = generate(*engine_, prompts, all, false, out, drafter, stats);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(engine_->cache().blocks().free_blocks(), engine_->cache().blocks().num_blocks());
    return out;
  }

  std::vector<Tokens> prompts() const {
    std::vector<Tokens> out;
    for (const auto& p : reference_["prompts"]) out.push_back(p["input_ids"].get<Tokens>());
    return out;
  }

  kernels::cpu::CpuBackend backend_{1};
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  nlohmann::json reference_;
};

TEST_P(MtpFixture, LoadsTheLayerWithItsExperts) {
  ASSERT_EQ(model_->mtp_layers(), 1);
  const MtpWeights& m = model_->weights().mtp[0];
  EXPECT_TRUE(m.layer.is_moe);
  EXPECT_EQ(static_cast<std::int64_t>(m.layer.moe.experts.size()), model_->config().num_experts);
  EXPECT_EQ(model_->mtp_moe_layers().size(), 1U);
  EXPECT_EQ(model_->moe_index(model_->config().num_layers), 0);
  kernels::cpu::CpuBackend backend(1);
  const auto plain = Model::load(dir(), backend);
  EXPECT_EQ(plain->mtp_layers(), 0);
  EXPECT_GT(model_->weights().bytes, plain->weights().bytes);
  // The fp8 fixture's layer has its own embedding and head (as released), the other shares the model's.
  const bool own = GetParam() == "deepseek_v3_fp8";
  EXPECT_EQ(m.embed.data() != model_->weights().embed.data(), own);
  EXPECT_EQ(m.lm_head.data() != model_->weights().lm_head.data(), own);
}

// Catch-up over the whole prompt (row t: the decoder's state at t and token t + 1, the last row the first
// greedy token), then the chain: each draft from the previous row's output state and the draft before.
TEST_P(MtpFixture, LogitsEqualTheReference) {
  const nlohmann::json& mtp = reference_["mtp"];
  ASSERT_EQ(mtp["layer"].get<std::int64_t>(), model_->config().num_layers);
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  SequenceId seq = 0;
  for (const auto& p : mtp["prompts"]) {
    const std::string where = GetParam() + ", prompt " + std::to_string(seq);
    const Tokens prompt = reference_["prompts"][seq]["input_ids"].get<Tokens>();
    const auto n = static_cast<std::int64_t>(prompt.size());
    const Engine::Work work{seq, prompt};
    ASSERT_TRUE(engine_->step({&work, 1}).ok());
    std::int32_t first = 0;
    engine_->sample(std::vector<kernels::SampleControls>(1), {&first, 1});
    EXPECT_EQ(first, reference_["prompts"][seq]["greedy_ids"][0].get<std::int32_t>()) << where;
    Tokens next(prompt.begin() + 1, prompt.end());
    next.push_back(first);
    EXPECT_EQ(next, p["input_ids"].get<Tokens>()) << where;  // the reference's MTP inputs
    const Engine::DraftWork catch_up{seq, 0, next, 0, true};
    const Status s = engine_->draft_step(0, Engine::DraftInput::step_hidden, {&catch_up, 1});
    ASSERT_TRUE(s.ok()) << s.message();
    const NpyArray expected = read_npy(dir() / p["mtp_logits"].get<std::string>());
    ASSERT_EQ(expected.data.size(), static_cast<std::size_t>(n) * vocab) << where;
    EXPECT_LE(testing::relative_max_diff(engine_->logits(), expected.data), kTolerance) << where;

    const nlohmann::json& chain = p["mtp_chain"];
    const Tokens drafts = chain["draft_ids"].get<Tokens>();
    const NpyArray chain_expected = read_npy(dir() / chain["logits"].get<std::string>());
    std::vector<std::int32_t> drawn(static_cast<std::size_t>(n));
    engine_->draft_argmax(drawn);
    EXPECT_EQ(drawn.back(), drafts[0]) << where;
    for (std::size_t j = 0; j + 1 < drafts.size(); ++j) {
      const Engine::DraftWork step{seq, n + static_cast<std::int64_t>(j), std::span(drafts).subspan(j, 1),
                                   j == 0 ? n - 1 : 0};
      ASSERT_TRUE(engine_->draft_step(0, Engine::DraftInput::draft_hidden, {&step, 1}).ok());
      const std::span<const float> row(chain_expected.data.data() + j * vocab, vocab);
      EXPECT_LE(testing::relative_max_diff(engine_->logits(), row), kTolerance) << where << ", chain " << j;
      engine_->draft_argmax({drawn.data(), 1});
      EXPECT_EQ(drawn[0], drafts[j + 1]) << where << ", chain " << j;
    }
    engine_->end_drafts();
    // The chain's rows past the sequence's length took blocks only until end_drafts.
    EXPECT_EQ(engine_->cache().blocks().block_table(seq).size(),
              static_cast<std::size_t>(engine_->cache().blocks().blocks_for(n)));
    engine_->release(seq++);
  }
}

TEST_P(MtpFixture, GreedyWithMtpDraftsEqualsPlainGreedy) {
  const std::vector<Tokens> all = prompts();
  const std::vector<Generation> plain = run(all, testing::decode_params(32), nullptr);
  for (const std::int64_t k : {1, 3}) {
    MtpDrafter drafter(*engine_, k);
    SpeculationStats stats;
    const std::vector<Generation> spec = run(all, testing::decode_params(32), &drafter, &stats);
    ASSERT_EQ(spec.size(), all.size());
    for (std::size_t i = 0; i < all.size(); ++i)
      EXPECT_EQ(spec[i].tokens, plain[i].tokens) << GetParam() << ", prompt " << i << ", k " << k;
    // Every verifying step had k drafts while the token budget left room.
    EXPECT_GT(stats.total_proposed(), 0);
    EXPECT_EQ(static_cast<std::int64_t>(stats.proposed.size()), k);
  }
}

TEST_P(MtpFixture, SampledTokensAreThoseOfTheSameSeedWithoutSpeculation) {
  const std::vector<Tokens> all = prompts();
  const std::vector<Generation> plain = run(all, testing::decode_params(24, 0.9F), nullptr);
  MtpDrafter drafter(*engine_, 2);
  const std::vector<Generation> spec = run(all, testing::decode_params(24, 0.9F), &drafter);
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(spec[i].tokens, plain[i].tokens) << "prompt " << i;
}

TEST_P(MtpFixture, BadDraftWorkIsRefusedAndChangesNothing) {
  const Tokens prompt = prompts().front();
  const Engine::Work work{5, prompt};
  ASSERT_TRUE(engine_->step({&work, 1}).ok());
  const auto vocab = static_cast<std::int32_t>(model_->config().vocab_size);
  const Tokens bad_token{vocab};
  const Tokens good(prompt.size(), 1);
  const std::vector<Engine::DraftWork> cases = {
      {6, 0, good, 0},                                      // not in the cache
      {5, 0, bad_token, 0},                                 // outside the vocabulary
      {5, 0, {}, 0},                                        // no tokens
      {5, -1, good, 0},                                     // before position 0
      {5, model_->config().max_context_length(), good, 0},  // past the context
      {5, 0, good, 1},                                      // more state rows than the step had
  };
  for (const Engine::DraftWork& w : cases) {
    const Status s = engine_->draft_step(0, Engine::DraftInput::step_hidden, {&w, 1});
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.message();
  }
  const Status depth = engine_->draft_step(1, Engine::DraftInput::step_hidden, {});
  EXPECT_EQ(depth.code(), StatusCode::invalid_argument) << depth.message();
  EXPECT_EQ(engine_->length(5), static_cast<std::int64_t>(prompt.size()));
  engine_->release(5);
  EXPECT_EQ(engine_->cache().blocks().free_blocks(), engine_->cache().blocks().num_blocks());
}

// A server's rank drafts (a collective) at its first step too, before any step gave hidden states: with no
// work it is an empty step. The server's first request once ended in "gather_rows: 0 rows of [] ...".
TEST_P(MtpFixture, DraftingBeforeAnyStepIsAnEmptyStep) {
  for (const Engine::DraftInput input : {Engine::DraftInput::step_hidden, Engine::DraftInput::draft_hidden}) {
    const Status s = engine_->draft_step(0, input, {});
    EXPECT_TRUE(s.ok()) << s.message();
  }
  std::vector<std::int64_t> counts;
  MtpDrafter(*engine_, 3).propose({}, counts);
  engine_->end_drafts();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpFixture, ::testing::Values("deepseek_v3", "deepseek_v3_fp8"),
                         [](const auto& info) { return info.param; });

// The refusals: a model without MTP layers, a checkpoint that lacks the declared one, an engine of a model
// loaded without them.
TEST(MtpLoad, RefusalsNameTheCause) {
  kernels::cpu::CpuBackend backend(1);
  try {
    Model::load(testing::fixture_models_dir() / "mixtral_sharded", backend, with_mtp());
    ADD_FAILURE() << "mixtral_sharded loaded with MTP";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("num_nextn_predict_layers"), std::string::npos) << e.what();
  }
  const auto plain = Model::load(testing::fixture_models_dir() / "deepseek_v3", backend);
  Engine engine(*plain, EngineOptions{});
  SpeculationConfig config;
  config.method = SpeculationConfig::Method::mtp;
  EXPECT_THROW(make_drafter(config, engine), std::invalid_argument);
  const Status s = engine.draft_step(0, Engine::DraftInput::step_hidden, {});
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.message();
  EXPECT_NE(s.message().find("without multi-token-prediction layers"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace capserve::runtime
