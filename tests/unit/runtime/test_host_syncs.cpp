// The host synchronisations of a step, as runtime/README.md lists them: a serving step (forward, then sample)
// makes two per MoE layer (the dispatch report, the expert group sizes) and one per step (the sampled
// tokens); the logits reach the host only when someone asks for them, once per step however often they are
// read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace
}  // namespace capserve
