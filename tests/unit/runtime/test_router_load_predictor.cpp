// RouterLoadPredictor, the batch selector's load predictor: the engine's router dry run, optionally through a
// learned load map, folded through an expert placement into per-layer per-rank loads. Checked against the dry
// run's counts (or the map's prediction) summed by hand over each rank's experts, on a fixture whose MoE
// layers are not its first layers (qwen2_moe_sparse_step: layers 1 and 3), under two placements of the same
// two ranks, one of which differs between the layers. LoadMap itself: its fit recovers a linear relation, its
// file round-trips, a bad file or another model's map is refused.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime/load_map.h"
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

  // Per-expert loads of the first `layers` MoE layers ([layers, experts]) summed over each rank's experts
  // (local_experts, not the owners table the predictor reads): [layers, ranks].
  std::vector<float> fold(const parallel::ExpertPlacement& placement, std::int64_t layers,
                          const std::vector<double>& expert_loads) {
    const auto R = static_cast<std::size_t>(placement.num_ranks());
    std::vector<float> load(static_cast<std::size_t>(layers) * R, 0.0F);
    for (std::size_t r = 0; r < R; ++r) {
      for (std::int64_t l = 0; l < layers; ++l) {
        for (const std::int32_t e :
             placement.local_experts(model_->moe_layers()[static_cast<std::size_t>(l)], static_cast<int>(r)))
          load[static_cast<std::size_t>(l) * R + r] +=
              static_cast<float>(expert_loads[static_cast<std::size_t>(l * experts() + e)]);
      }
    }
    return load;
  }

  // The dry run's counts of the first `layers` MoE layers, folded by hand.
  std::vector<float> by_hand(const parallel::ExpertPlacement& placement, std::int64_t layers) {
    std::vector<std::int64_t> counts(static_cast<std::size_t>(layers * experts()), 0);
    engine_->router_dry_run(prompt_, layers, counts);
    return fold(placement, layers, std::vector<double>(counts.begin(), counts.end()));
  }

  // A map fitted to y = A x + b exactly, A and b drawn at random (b large enough that no load is negative).
  LoadMap random_map(std::uint64_t seed) {
    const LoadMapShape shape = load_map_shape(*model_);
    const auto n = static_cast<std::size_t>(shape.moe_layers * shape.experts);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<double> a(n * n), b(n);
    for (double& v : a) v = u(rng) - 0.5;
    for (double& v : b) v = 2 + u(rng);
    std::vector<LoadMap::Sample> samples(4 * n);
    for (LoadMap::Sample& s : samples) {
      s.dry_run.resize(n);
      for (double& v : s.dry_run) v = u(rng);
      s.routed = b;
      for (std::size_t k = 0; k < n; ++k)
        for (std::size_t i = 0; i < n; ++i) s.routed[k] += a[k * n + i] * s.dry_run[i];
    }
    linear_ = {std::move(a), std::move(b)};
    return LoadMap::fit(shape, samples, 1e-12);
  }

  std::pair<std::vector<double>, std::vector<double>> linear_;  // the last random_map's A and b

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
      std::vector<float> load(static_cast<std::size_t>(2 * covered), -1.0F);  // overwritten, not added to
      predictor.predict(prompt_, load);
      EXPECT_EQ(load, by_hand(*placement, covered)) << placement->kind() << ", " << covered << " MoE layers";
      for (std::int64_t l = 0; l < covered; ++l)
        EXPECT_EQ(load[static_cast<std::size_t>(2 * l)] + load[static_cast<std::size_t>(2 * l + 1)],
                  static_cast<float>(prompt_.size() * 2))
            << "every token's top-2 assignments of MoE layer " << l << ", once";
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
  std::vector<float> first(4), again(4);
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

TEST_F(RouterLoadPredictorTest, ALoadMapPredictsEveryMoeLayerFromTheDryRun) {
  const std::int64_t layers = model_->config().num_layers;
  const auto placement = parallel::ExpertPlacement::round_robin(layers, experts(), 2);
  const LoadMap map = random_map(7);
  RouterLoadPredictor predictor(*engine_, placement, 1, map);
  EXPECT_TRUE(predictor.learned());
  EXPECT_EQ(predictor.layers(), 2) << "a map covers every MoE layer, whatever --dry-run-layers says";

  // By hand: the dry run's counts of both layers per token, through y = A x + b, times the tokens.
  const auto n = static_cast<std::size_t>(2 * experts());
  std::vector<std::int64_t> counts(n, 0);
  engine_->router_dry_run(prompt_, 2, counts);
  const auto tokens = static_cast<double>(prompt_.size());
  std::vector<double> want = linear_.second;
  for (std::size_t k = 0; k < n; ++k) {
    for (std::size_t i = 0; i < n; ++i)
      want[k] += linear_.first[k * n + i] * static_cast<double>(counts[i]) / tokens;
    want[k] *= tokens;
  }
  std::vector<float> load(4, -1.0F);
  predictor.predict(prompt_, load);
  const std::vector<float> expected = fold(placement, 2, want);
  for (std::size_t i = 0; i < load.size(); ++i)
    EXPECT_NEAR(load[i], expected[i], 1e-3 * std::abs(expected[i])) << "entry " << i;
}

TEST_F(RouterLoadPredictorTest, ALoadMapFileRoundTripsAndABadOneIsRefusedWithItsName) {
  const LoadMap map = random_map(11);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "capserve_load_map_test";
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "capserve_load_map.json";
  map.write(path, "test");
  const LoadMap back = LoadMap::read(path);
  EXPECT_EQ(back.shape(), map.shape());
  std::vector<double> x(static_cast<std::size_t>(map.size()), 0.25), y1(x.size()), y2(x.size());
  map.predict(x, y1);
  back.predict(x, y2);
  EXPECT_EQ(y1, y2) << "the weights are written exactly (JSON doubles round-trip)";

  const auto refused = [&](const std::string& text, const std::string& fault) {
    std::ofstream(path) << text;
    try {
      (void)LoadMap::read(path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(fault), std::string::npos) << e.what();
    }
  };
  refused("{", "parse error");
  refused(R"({"format": "something else"})", "not a map");
  refused(R"({"format": "capserve-load-map/1", "model": {"architecture": "olmoe", "moe_layers": 1,
              "experts": 2, "top_k": 1}, "ridge": 1, "weights": [1, 2, 3]})",
          "3 weights, 6 expected");
  refused(R"({"format": "capserve-load-map/1", "model": {"architecture": "olmoe", "moe_layers": 100000,
              "experts": 64, "top_k": 8}, "ridge": 1, "weights": []})",
          "outside what a map covers");
  EXPECT_THROW((void)LoadMap::read(dir / "absent.json"), std::runtime_error);
  std::filesystem::remove_all(dir);

  // Another model's map: refused by the predictor, naming what it was fitted for.
  const auto other = LoadMap::fit(
      {"mixtral", 2, experts(), 2},
      std::vector<LoadMap::Sample>{{std::vector<double>(static_cast<std::size_t>(map.size()), 1.0),
                                    std::vector<double>(static_cast<std::size_t>(map.size()), 1.0)}},
      1.0);
  const auto placement = parallel::ExpertPlacement::round_robin(model_->config().num_layers, experts(), 2);
  try {
    RouterLoadPredictor predictor(*engine_, placement, 1, other);
    ADD_FAILURE() << "another model's map accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mixtral"), std::string::npos) << e.what();
  }
}

TEST_F(RouterLoadPredictorTest, RefusesAPlacementOfAnotherExpertCount) {
  const auto placement = parallel::ExpertPlacement::contiguous(model_->config().num_layers, 2 * experts(), 2);
  EXPECT_THROW(RouterLoadPredictor(*engine_, placement, 1), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::runtime
