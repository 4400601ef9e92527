// RouterLoadPredictor, the batch selector's load predictor: the engine's router dry run folded through an
// expert placement into per-rank loads. Checked against the dry run's counts summed by hand over each rank's
// experts, on a fixture whose MoE layers are not its first layers (qwen2_moe_sparse_step: layers 1 and 3),
// under two placements of the same two ranks, one of which differs between the layers.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/router_load_predictor.h"
#include "tests/unit/runtime/fixture_models.h"

namespace {

// Heap allocations by any thread while counting.
std::atomic<bool> g_counting{false};
std::atomic<std::int64_t> g_allocations{0};

}  // namespace

// The replacement pair allocates with malloc and frees with free; GCC, seeing both inlined anywhere in this
// file, takes the free for a mismatch with new.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
// Every other form of operator new in libstdc++ ends here.
void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t /*size*/) noexcept {
  std::free(p);
}

namespace capserve::runtime {
namespace {

class RouterLoadPredictorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::fixture_models_dir() / "qwen2_moe_sparse_step", backend_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{});
    ASSERT_EQ(model_->moe_layers().size(), 2U);
    ASSERT_EQ(model_->moe_layers()[0], 1);  // so that a MoE position read as a layer index shows
  }

  [[nodiscard]] std::int64_t experts() const { return model_->config().num_experts; }

  // The dry run's counts of the first `layers` MoE layers, summed over each rank's experts (local_experts,
  // not the owners table the predictor reads).
  std::vector<float> by_hand(const parallel::ExpertPlacement& placement, std::int64_t layers) {
    std::vector<std::int64_t> counts(static_cast<std::size_t>(layers * experts()), 0);
    engine_->router_dry_run(prompt_, layers, counts);
    std::vector<float> load(static_cast<std::size_t>(placement.num_ranks()), 0.0F);
    for (int r = 0; r < placement.num_ranks(); ++r) {
      for (std::int64_t l = 0; l < layers; ++l) {
        for (const std::int32_t e :
             placement.local_experts(model_->moe_layers()[static_cast<std::size_t>(l)], r))
          load[static_cast<std::size_t>(r)] +=
              static_cast<float>(counts[static_cast<std::size_t>(l * experts() + e)]);
      }
    }
    return load;
  }

  kernels::cpu::CpuBackend backend_{1};
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  const std::vector<std::int32_t> prompt_{5, 77, 300, 12, 9, 41, 8, 150, 3, 64, 99, 2, 17, 230, 7, 1};
};

TEST_F(RouterLoadPredictorTest, LoadsAreTheDryRunCountsFoldedThroughThePlacement) {
  const std::int64_t layers = model_->config().num_layers;
  // MoE layer 1 heavy on the low experts, layer 3 on the high ones: the balanced placement differs per layer.
  std::vector<std::vector<double>> expert_loads(static_cast<std::size_t>(layers));
  expert_loads[1] = {16, 8, 4, 2, 1, 1, 1, 1};
  expert_loads[3] = {1, 1, 1, 1, 2, 4, 8, 16};
  const auto contiguous = parallel::ExpertPlacement::contiguous(layers, experts(), 2);
  const auto balanced = parallel::ExpertPlacement::balanced(expert_loads, experts(), 2);
  ASSERT_NE(std::vector<std::int32_t>(balanced.owners(1).begin(), balanced.owners(1).end()),
            std::vector<std::int32_t>(balanced.owners(3).begin(), balanced.owners(3).end()));

  std::vector<std::vector<float>> loads;
  for (const parallel::ExpertPlacement* placement : {&contiguous, &balanced}) {
    for (const std::int64_t covered : {1, 2}) {
      RouterLoadPredictor predictor(*engine_, *placement, covered);
      std::vector<float> load(2, -1.0F);  // overwritten, not added to
      predictor.predict(prompt_, load);
      EXPECT_EQ(load, by_hand(*placement, covered)) << placement->kind() << ", " << covered << " MoE layers";
      EXPECT_EQ(load[0] + load[1], static_cast<float>(prompt_.size() * 2 * static_cast<std::size_t>(covered)))
          << "every token's top-2 assignments of every covered layer, once";
      loads.push_back(load);
    }
  }
  EXPECT_NE(loads[1], loads[3]) << "the placement changes the per-rank loads";
}

TEST_F(RouterLoadPredictorTest, CoversAtMostTheModelsMoeLayers) {
  const auto placement = parallel::ExpertPlacement::round_robin(model_->config().num_layers, experts(), 2);
  EXPECT_EQ(RouterLoadPredictor(*engine_, placement, 1).layers(), 1);
  EXPECT_EQ(RouterLoadPredictor(*engine_, placement, 64).layers(), 2);
}

// The predictor's own buffers are sized once: a call allocates what the dry run it wraps allocates, nothing
// more (the CPU backend's router, kernels::moe::route_on_host, allocates its own scratch on every call).
TEST_F(RouterLoadPredictorTest, RepeatedCallsGiveTheSameLoadAndAllocateNoMoreThanTheDryRun) {
  const auto placement = parallel::ExpertPlacement::round_robin(model_->config().num_layers, experts(), 2);
  RouterLoadPredictor predictor(*engine_, placement, 2);
  std::vector<float> first(2), again(2);
  predictor.predict(prompt_, first);  // warms the dry run's buffers
  std::vector<std::int64_t> counts(static_cast<std::size_t>(2 * experts()), 0);
  const auto allocations = [&](const auto& call) {
    g_allocations.store(0);
    g_counting.store(true);
    call();
    g_counting.store(false);
    return g_allocations.load();
  };
  const std::int64_t dry_run = allocations([&] { engine_->router_dry_run(prompt_, 2, counts); });
  EXPECT_EQ(allocations([&] { predictor.predict(prompt_, again); }), dry_run);
  EXPECT_EQ(again, first) << "its counts start from zero on every call";
}

TEST_F(RouterLoadPredictorTest, RefusesAPlacementOfAnotherExpertCount) {
  const auto placement = parallel::ExpertPlacement::contiguous(model_->config().num_layers, 2 * experts(), 2);
  EXPECT_THROW(RouterLoadPredictor(*engine_, placement, 1), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::runtime
