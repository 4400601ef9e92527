// Speculative decoding through the expert-parallel path (mpirun -np 1 and 2, and as a singleton), every
// committed fixture architecture, gamma = inf: n-gram speculation gives each rank's sequences the same greedy
// tokens as plain decoding, with the prompts spread over the ranks or all on rank 0 (the other ranks then
// join every verifying step's collectives with zero tokens). Every test is collective: all ranks run the same
// steps; failures use EXPECT_* so that no rank leaves a collective early. MTP drafting too, on the two
// DeepSeek-V3 fixtures.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_communicator.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/model.h"
#include "runtime/speculative/mtp_drafter.h"
#include "runtime/speculative/ngram_drafter.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

using Tokens = std::vector<std::int32_t>;

class MpiSpeculative : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const nlohmann::json reference = testing::fixture_reference(GetParam());
    for (const auto& p : reference["prompts"]) {
      Tokens ids = p["input_ids"].get<Tokens>();
      prompts_.push_back(ids);
      ids.insert(ids.end(), prompts_.back().begin(), prompts_.back().end());  // n-grams from the first step
      prompts_.push_back(ids);
    }
  }

  // This rank's prompts: every ranks-th from its rank on, or all on rank 0.
  [[nodiscard]] std::vector<Tokens> mine(bool all_on_rank0) const {
    std::vector<Tokens> out;
    for (std::size_t i = 0; i < prompts_.size(); ++i) {
      const int owner = all_on_rank0 ? 0 : static_cast<int>(i % static_cast<std::size_t>(comm_.size()));
      if (owner == comm_.rank()) out.push_back(prompts_[i]);
    }
    return out;
  }

  // With the fixture's model (its MTP layer loaded when `mtp`) and the drafter `make` builds on its engine:
  // each rank's greedy tokens with the prompts spread over the ranks and with all on rank 0 equal plain
  // decoding's, and every rank with prompts verified drafts.
  void expect_greedy_kept(bool mtp,
                          const std::function<std::unique_ptr<runtime::Drafter>(runtime::Engine&)>& make) {
    runtime::ParallelOptions options;
    options.capacity.gamma = {std::numeric_limits<double>::infinity()};
    options.mtp = mtp;
    const auto model =
        runtime::Model::load(testing::fixture_models_dir() / GetParam(), backend_, comm_, options);
    runtime::Engine engine(*model, {});
    const std::unique_ptr<runtime::Drafter> drafter = make(engine);
    runtime::SamplingParams greedy;
    greedy.max_new_tokens = 24;
    for (const bool all_on_rank0 : {false, true}) {
      const std::string where = GetParam() + (all_on_rank0 ? ", all prompts on rank 0" : ", prompts spread") +
                                ", rank " + std::to_string(comm_.rank()) + " of " +
                                std::to_string(comm_.size());
      const std::vector<Tokens> prompts = mine(all_on_rank0);
      std::vector<runtime::SamplingParams> params(prompts.size(), greedy);
      // Within the context (the dynamic-rope fixture's is 64 tokens).
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        params[i].max_new_tokens =
            std::min(greedy.max_new_tokens,
                     model->config().max_context_length() - static_cast<std::int64_t>(prompts[i].size()));
      }
      std::vector<runtime::Generation> plain;
      std::vector<runtime::Generation> spec;
      runtime::SpeculationStats stats;
      const runtime::Status a = runtime::generate(engine, prompts, params, false, plain);
      const runtime::Status b =
          runtime::generate(engine, prompts, params, false, spec, drafter.get(), &stats);
      EXPECT_TRUE(a.ok()) << where << ": " << a.message();
      EXPECT_TRUE(b.ok()) << where << ": " << b.message();
      EXPECT_EQ(spec.size(), plain.size()) << where;
      for (std::size_t i = 0; i < std::min(spec.size(), plain.size()); ++i)
        EXPECT_EQ(spec[i].tokens, plain[i].tokens) << where << ", prompt " << i;
      if (!prompts.empty()) {
        EXPECT_GT(stats.total_proposed(), 0) << where;
      }
    }
  }

  std::vector<Tokens> prompts_;
  kernels::cpu::CpuBackend backend_{1};
  parallel::MpiCommunicator comm_;  // collective: every rank constructs it in every test
};

// The continuations of the doubled prompts repeat earlier n-grams: drafts from the first decode on.
TEST_P(MpiSpeculative, NgramGreedyEqualsPlainGreedy) {
  expect_greedy_kept(false,
                     [](runtime::Engine&) { return std::make_unique<runtime::NgramDrafter>(4, 1, 3); });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MpiSpeculative, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

// MTP drafting is itself a collective (the MTP layer's MoE): every rank runs the draft steps after every
// step, those without decodes (all prompts on rank 0) with zero rows.
class MpiMtpSpeculative : public MpiSpeculative {};

TEST_P(MpiMtpSpeculative, MtpGreedyEqualsPlainGreedy) {
  expect_greedy_kept(
      true, [](runtime::Engine& engine) { return std::make_unique<runtime::MtpDrafter>(engine, 3); });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MpiMtpSpeculative, ::testing::Values("deepseek_v3", "deepseek_v3_fp8"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace capserve
