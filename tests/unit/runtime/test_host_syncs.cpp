// The host synchronisations of a step, as runtime/README.md lists them: a serving step (forward, then sample)
// makes two per MoE layer (the dispatch report, the expert group sizes) and one per step (the sampled
// tokens); the logits reach the host only when someone asks for them, once per step however often they are
// read.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

using kernels::HostSync;

TEST(HostSyncs, AServingStepSynchronisesTwicePerMoeLayerAndOnceForTheSampledTokens) {
  kernels::cpu::CpuBackend backend(2);
  const auto model = runtime::Model::load(testing::fixture_models_dir() / "olmoe_bf16", backend);
  runtime::Engine engine(*model, {});
  const std::vector<std::int32_t> prompt_a = {1, 5, 9, 13};
  const std::vector<std::int32_t> prompt_b = {2, 4};
  std::vector<runtime::Engine::Work> work = {{1, prompt_a, false}, {2, prompt_b, false}};
  std::vector<std::int32_t> next(2);
  runtime::SamplingParams greedy;
  runtime::SamplingParams hot;
  hot.temperature = 0.8F;
  hot.seed = 5;
  for (std::uint64_t step = 0; step < 4; ++step) {
    ASSERT_TRUE(engine.step(work).ok());
    const std::vector<kernels::SampleControls> controls = {runtime::sample_controls(greedy, step),
                                                           runtime::sample_controls(hot, step)};
    engine.sample(controls, next);
    EXPECT_EQ(backend.host_syncs(HostSync::sampled_tokens), static_cast<std::int64_t>(step + 1));
    EXPECT_EQ(backend.host_syncs(HostSync::logits), 0);
    const auto moe_layers = static_cast<std::int64_t>(model->moe_layers().size());
    ASSERT_GT(moe_layers, 0);
    EXPECT_EQ(backend.host_syncs(HostSync::moe_dispatch), moe_layers * static_cast<std::int64_t>(step + 1));
    EXPECT_EQ(backend.host_syncs(HostSync::moe_groups), moe_layers * static_cast<std::int64_t>(step + 1));
    std::int64_t all = 0;
    for (int why = 0; why < static_cast<int>(HostSync::count_); ++why)
      all += backend.host_syncs(static_cast<HostSync>(why));
    EXPECT_EQ(all, (2 * moe_layers + 1) * static_cast<std::int64_t>(step + 1))
        << "a synchronisation not listed";
    work = {{1, std::span(&next[0], 1), false}, {2, std::span(&next[1], 1), false}};
  }

  // Reading the logits is one more synchronisation per step, not per read, and they are what was sampled.
  ASSERT_TRUE(engine.step(work).ok());
  const auto vocab = static_cast<std::size_t>(model->config().vocab_size);
  const std::span<const float> logits = engine.logits();
  (void)engine.logits();
  EXPECT_EQ(backend.host_syncs(HostSync::logits), 1);
  const std::vector<kernels::SampleControls> both_greedy = {runtime::sample_controls(greedy, 4),
                                                            runtime::sample_controls(greedy, 4)};
  engine.sample(both_greedy, next);
  for (std::size_t r = 0; r < 2; ++r) {
    const std::span<const float> row = logits.subspan(r * vocab, vocab);
    EXPECT_EQ(next[r], std::max_element(row.begin(), row.end()) - row.begin()) << "row " << r;
  }
}

// With a capacity factor the MoE layers exchange in fixed-size blocks: a serving step synchronises once, for
// the sampled tokens, and its statistics are those of the counted exchange.
TEST(HostSyncs, WithACapacityFactorAServingStepSynchronisesOnceAndCountsAsTheCountedExchange) {
  kernels::cpu::CpuBackend backend(2);
  runtime::ParallelOptions parallel;
  parallel.capacity.gamma = {1.0};
  const auto model = runtime::Model::load(testing::fixture_models_dir() / "olmoe_bf16", backend, parallel);
  runtime::EngineOptions blocks_options;
  runtime::EngineOptions counted_options;
  counted_options.fixed_exchange_tokens = 0;
  runtime::Engine blocks(*model, blocks_options);
  runtime::Engine counted(*model, counted_options);
  const std::vector<std::int32_t> prompt_a = {1, 5, 9, 13};
  const std::vector<std::int32_t> prompt_b = {2, 4};
  std::vector<std::int32_t> next(2);
  std::vector<std::int32_t> next_counted(2);
  std::vector<runtime::Engine::Work> work = {{1, prompt_a, false}, {2, prompt_b, false}};
  std::vector<runtime::Engine::Work> work_counted = work;
  const std::vector<kernels::SampleControls> greedy(2);
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::array<std::int64_t, static_cast<std::size_t>(HostSync::count_)> before{};
    for (int why = 0; why < static_cast<int>(HostSync::count_); ++why)
      before[static_cast<std::size_t>(why)] = backend.host_syncs(static_cast<HostSync>(why));
    ASSERT_TRUE(blocks.step(work).ok());
    blocks.sample(greedy, next);
    for (int why = 0; why < static_cast<int>(HostSync::count_); ++why) {
      const auto w = static_cast<HostSync>(why);
      EXPECT_EQ(backend.host_syncs(w) - before[static_cast<std::size_t>(why)],
                w == HostSync::sampled_tokens ? 1 : 0)
          << kernels::host_sync_name(w);
    }
    ASSERT_TRUE(counted.step(work_counted).ok());
    counted.sample(greedy, next_counted);
    EXPECT_EQ(next, next_counted);
    const auto& a = blocks.last_moe_stats().layers;
    const auto& b = counted.last_moe_stats().layers;
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t l = 0; l < a.size(); ++l) {
      EXPECT_EQ(a[l].dropped, b[l].dropped);
      EXPECT_EQ(a[l].routed_load, b[l].routed_load);
      EXPECT_EQ(a[l].expert_load, b[l].expert_load);
      EXPECT_EQ(a[l].rows_dispatched, b[l].rows_dispatched);
    }
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(blocks.moe_counts()[i].dropped, counted.moe_counts()[i].dropped);
    }
    if (step == 0) {
      std::int64_t dropped = 0;
      for (const auto& layer : a) dropped += layer.dropped;
      EXPECT_GT(dropped, 0) << "a capacity factor of 1 over six tokens drops some slots";
    }
    work = {{1, std::span(&next[0], 1), false, true}, {2, std::span(&next[1], 1), false, true}};
    work_counted = {{1, std::span(&next_counted[0], 1), false, true},
                    {2, std::span(&next_counted[1], 1), false, true}};
  }
}

}  // namespace
}  // namespace capserve
