// Every committed fixture against Hugging Face transformers' own outputs: per-position prompt logits,
// 16-token greedy continuations with their logits, and a left-padded HF batch of different lengths run here
// as one ragged batch.
#include <gtest/gtest.h>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/model.h"
#include "runtime/npy.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

constexpr double kTolerance = 1e-4;  // max|diff| <= 1e-4 * max|logit|

class HfParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = testing::fixture_models_dir() / GetParam();
    ref_ = testing::fixture_reference(GetParam());
    model_ = runtime::Model::load(dir_, backend_);
    engine_ = std::make_unique<runtime::Engine>(*model_, runtime::EngineOptions{});
  }

  runtime::NpyArray npy(const nlohmann::json& file) const {
    return runtime::read_npy(dir_ / file.get<std::string>());
  }

  std::filesystem::path dir_;
  nlohmann::json ref_;
  kernels::cpu::CpuBackend backend_{2};
  std::unique_ptr<runtime::Model> model_;
  std::unique_ptr<runtime::Engine> engine_;
};

runtime::SamplingParams greedy(std::int64_t n) {
  runtime::SamplingParams p;
  p.max_new_tokens = n;
  return p;
}

TEST_P(HfParity, PromptLogitsAtEveryPosition) {
  for (const auto& prompt : ref_["prompts"]) {
    const auto ids = prompt["input_ids"].get<std::vector<std::int32_t>>();
    const runtime::NpyArray expected = npy(prompt["prompt_logits"]);
    const runtime::Engine::Work work{42, ids, true};
    ASSERT_TRUE(engine_->step(std::span(&work, 1)).ok());
    ASSERT_EQ(engine_->logits().size(), expected.data.size());
    EXPECT_LE(testing::relative_max_diff(engine_->logits(), expected.data), kTolerance)
        << "prompt length " << ids.size();
    engine_->release(42);
  }
}

TEST_P(HfParity, GreedyContinuationAndItsLogits) {
  for (const auto& prompt : ref_["prompts"]) {
    const std::vector<std::vector<std::int32_t>> ids{prompt["input_ids"].get<std::vector<std::int32_t>>()};
    const auto expected_ids = prompt["greedy_ids"].get<std::vector<std::int32_t>>();
    const std::vector<runtime::SamplingParams> params{greedy(static_cast<std::int64_t>(expected_ids.size()))};
    std::vector<runtime::Generation> out;
    ASSERT_TRUE(runtime::generate(*engine_, ids, params, true, out).ok());
    EXPECT_EQ(out[0].tokens, expected_ids);
    EXPECT_LE(testing::relative_max_diff(out[0].logits, npy(prompt["greedy_logits"]).data), kTolerance);
  }
}

TEST_P(HfParity, BatchOfDifferentLengthsAsOneRaggedBatch) {
  const auto& batch = ref_["batch"];
  const auto prompts = batch["input_ids"].get<std::vector<std::vector<std::int32_t>>>();
  const auto expected_ids = batch["greedy_ids"].get<std::vector<std::vector<std::int32_t>>>();
  const runtime::NpyArray last = npy(batch["last_logits"]);
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  std::vector<runtime::SamplingParams> params;
  for (const auto& e : expected_ids) params.push_back(greedy(static_cast<std::int64_t>(e.size())));
  std::vector<runtime::Generation> out;
  ASSERT_TRUE(runtime::generate(*engine_, prompts, params, true, out).ok());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(out[i].tokens, expected_ids[i]) << "sequence " << i;
    const std::span<const float> first_step(out[i].logits.data(), vocab);
    EXPECT_LE(
        testing::relative_max_diff(first_step, std::span<const float>(last.data).subspan(i * vocab, vocab)),
        kTolerance)
        << "sequence " << i;
  }
}

TEST_P(HfParity, ExpertLoadCountsEveryAssignmentOfTheStep) {
  const auto ids = ref_["prompts"][3]["input_ids"].get<std::vector<std::int32_t>>();
  const runtime::Engine::Work work{1, ids, false};
  ASSERT_TRUE(engine_->step(std::span(&work, 1)).ok());
  const runtime::ModelConfig& c = model_->config();
  const auto& layers = engine_->last_moe_stats().layers;
  std::int64_t moe_layers = 0;
  for (std::int64_t layer = 0; layer < c.num_layers; ++layer)
    moe_layers += c.layer_is_moe[static_cast<std::size_t>(layer)] ? 1 : 0;
  ASSERT_EQ(static_cast<std::int64_t>(layers.size()), moe_layers);
  for (const auto& s : layers) {
    EXPECT_TRUE(c.layer_is_moe[static_cast<std::size_t>(s.layer)]);
    ASSERT_EQ(static_cast<std::int64_t>(s.routed_load.size()), c.num_experts);
    std::int64_t total = 0;
    for (const std::int64_t v : s.routed_load) total += v;
    EXPECT_EQ(total, static_cast<std::int64_t>(ids.size()) * c.top_k) << "layer " << s.layer;
    EXPECT_EQ(s.expert_load, s.routed_load) << "gamma = inf changes nothing";
    EXPECT_EQ(s.tokens, static_cast<std::int64_t>(ids.size()));
  }
}

// The batch selector's predictor runs every architecture's router (DeepSeek-V3's correction bias and groups
// included): each token adds its top_k experts to each MoE layer's counts, and repeating the tokens doubles
// them.
TEST_P(HfParity, RouterDryRunCountsTopKExpertsPerTokenAndLayer) {
  const auto ids = ref_["prompts"][3]["input_ids"].get<std::vector<std::int32_t>>();
  const runtime::ModelConfig& c = model_->config();
  const auto layers = static_cast<std::int64_t>(model_->moe_layers().size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(layers * c.num_experts), 0);
  engine_->router_dry_run(ids, layers, counts);
  for (std::int64_t l = 0; l < layers; ++l) {
    std::int64_t total = 0;
    for (std::int64_t e = 0; e < c.num_experts; ++e)
      total += counts[static_cast<std::size_t>(l * c.num_experts + e)];
    EXPECT_EQ(total, static_cast<std::int64_t>(ids.size()) * c.top_k) << "MoE layer " << l;
  }
  std::vector<std::int64_t> twice = counts;
  engine_->router_dry_run(ids, layers, twice);
  for (std::size_t i = 0; i < counts.size(); ++i) EXPECT_EQ(twice[i], 2 * counts[i]);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParity, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace capserve
