// The CAPS batch selector against brute force and its contract: FCFS below the trigger, budgets respected, no
// request waiting past the bound behind younger ones.
#include "server/batch_selector.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <numeric>
#include <random>

namespace capserve::server {
namespace {

using Clock = std::chrono::steady_clock;

struct Queue {
  std::vector<std::vector<float>> loads;
  std::vector<Candidate> candidates;
  void add(std::vector<float> load, std::int64_t tokens = 10, double waited = 0) {
    loads.push_back(std::move(load));
    candidates.push_back({tokens, 1, waited, {}});
    for (std::size_t i = 0; i < loads.size(); ++i) candidates[i].load = loads[i];
  }
};

double variance_score(std::vector<double> agg) {
  const double n = static_cast<double>(agg.size());
  double sum = 0;
  double sq = 0;
  for (const double a : agg) {
    sum += a;
    sq += a * a;
  }
  return n * sq - sum * sum;
}

TEST(BatchSelector, FcfsBelowTheQueueDepthTrigger) {
  SelectorConfig config;
  config.strategy = SelectionStrategy::greedy;
  config.min_queue_depth = 4;
  BatchSelector selector(config, 2);
  Queue q;
  q.add({10, 0});
  q.add({10, 0});
  q.add({0, 10});  // greedy would take this one first
  const std::vector<float> running = {0, 0};
  const Selection s = selector.select(q.candidates, running, {2, 1000, 1000}, Clock::now());
  EXPECT_FALSE(s.selected);
  EXPECT_EQ(s.admitted, (std::vector<std::int64_t>{0, 1}));
}

TEST(BatchSelector, GreedyPicksTheComplementaryRequests) {
  SelectorConfig config;
  config.strategy = SelectionStrategy::greedy;
  config.min_queue_depth = 1;
  BatchSelector selector(config, 2);
  Queue q;
  for (int i = 0; i < 4; ++i) q.add({8, 1});
  q.add({1, 8});
  q.add({1, 8});
  const std::vector<float> running = {20, 4};  // rank 0 already hot
  const Selection s = selector.select(q.candidates, running, {2, 1000, 1000}, Clock::now());
  EXPECT_TRUE(s.selected);
  EXPECT_EQ(s.admitted, (std::vector<std::int64_t>{4, 5}));
  EXPECT_NEAR(s.predicted_imbalance, 22.0 / 21.0, 1e-9);
}

// With one slot the greedy choice is the exact optimum: compare with brute force on random queues.
TEST(BatchSelector, GreedyEqualsBruteForceForOneAdmission) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    const std::int64_t dims = 1 + static_cast<std::int64_t>(rng() % 8);
    SelectorConfig config;
    config.strategy = SelectionStrategy::greedy;
    config.min_queue_depth = 1;
    BatchSelector selector(config, dims);
    Queue q;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      std::vector<float> load(static_cast<std::size_t>(dims));
      for (float& v : load) v = static_cast<float>(rng() % 6);
      q.add(load);
    }
    std::vector<float> running(static_cast<std::size_t>(dims));
    for (float& v : running) v = static_cast<float>(rng() % 20);
    const Selection s = selector.select(q.candidates, running, {1, 1000, 1000}, Clock::now());
    ASSERT_EQ(s.admitted.size(), 1U);
    double best = 1e300;
    std::int64_t best_i = -1;
    for (int i = 0; i < n; ++i) {
      std::vector<double> agg(running.begin(), running.end());
      for (std::size_t d = 0; d < agg.size(); ++d) agg[d] += q.loads[static_cast<std::size_t>(i)][d];
      const double v = variance_score(agg);
      if (v < best - 1e-9) {
        best = v;
        best_i = i;
      }
    }
    EXPECT_EQ(s.admitted[0], best_i) << "trial " << trial;
  }
}

// Several admissions from small queues: one-at-a-time greedy would take the most balanced single request
// first and miss the perfect pair; on small windows the selector searches exactly and equals brute force.
TEST(BatchSelector, GreedyEqualsBruteForceOnSmallQueues) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    SelectorConfig config;
    config.strategy = SelectionStrategy::greedy;
    config.min_queue_depth = 1;
    BatchSelector selector(config, 2);
    Queue q;
    const float a = static_cast<float>(1 + rng() % 9);
    q.add({a, 0});
    q.add({0, a});
    for (int i = 0; i < 5; ++i) q.add({static_cast<float>(3 + rng() % 5), static_cast<float>(rng() % 2)});
    std::shuffle(q.loads.begin(), q.loads.end(), rng);
    for (std::size_t i = 0; i < q.loads.size(); ++i) q.candidates[i].load = q.loads[i];
    const std::vector<float> running = {0, 0};
    const Selection s = selector.select(q.candidates, running, {2, 1000, 1000}, Clock::now());
    ASSERT_EQ(s.admitted.size(), 2U);
    std::vector<double> agg = {0, 0};
    for (const auto i : s.admitted) {
      agg[0] += q.loads[static_cast<std::size_t>(i)][0];
      agg[1] += q.loads[static_cast<std::size_t>(i)][1];
    }
    EXPECT_EQ(variance_score(agg), 0.0) << "trial " << trial;
  }
}

TEST(BatchSelector, GreedyEqualsBruteForceOnRandomSmallQueues) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t dims = 2 + static_cast<std::int64_t>(rng() % 4);
    SelectorConfig config;
    config.strategy = SelectionStrategy::greedy;
    config.min_queue_depth = 1;
    BatchSelector selector(config, dims);
    Queue q;
    const int n = 4 + static_cast<int>(rng() % 7);
    for (int i = 0; i < n; ++i) {
      std::vector<float> load(static_cast<std::size_t>(dims));
      for (float& v : load) v = static_cast<float>(rng() % 10);
      q.add(load);
    }
    std::vector<float> running(static_cast<std::size_t>(dims));
    for (float& v : running) v = static_cast<float>(rng() % 10);
    const std::int64_t slots = 2 + static_cast<std::int64_t>(rng() % 2);
    const Selection s = selector.select(q.candidates, running, {slots, 1000, 1000}, Clock::now());
    ASSERT_EQ(static_cast<std::int64_t>(s.admitted.size()), slots);
    const auto score = [&](const std::vector<std::int64_t>& picks) {
      std::vector<double> agg(running.begin(), running.end());
      for (const auto i : picks)
        for (std::size_t d = 0; d < agg.size(); ++d) agg[d] += q.loads[static_cast<std::size_t>(i)][d];
      return variance_score(agg);
    };
    double best = 1e300;
    for (std::uint32_t mask = 0; mask < (1U << n); ++mask) {
      if (std::popcount(mask) != slots) continue;
      std::vector<std::int64_t> picks;
      for (int i = 0; i < n; ++i)
        if ((mask >> i & 1U) != 0) picks.push_back(i);
      best = std::min(best, score(picks));
    }
    EXPECT_DOUBLE_EQ(score(s.admitted), best) << "trial " << trial;
  }
}

TEST(BatchSelector, BudgetsAreRespected) {
  std::mt19937 rng(3);
  for (const SelectionStrategy strategy :
       {SelectionStrategy::fcfs, SelectionStrategy::greedy, SelectionStrategy::power_of_d,
        SelectionStrategy::lpt_balanced, SelectionStrategy::random}) {
    SelectorConfig config;
    config.strategy = strategy;
    config.min_queue_depth = 1;
    BatchSelector selector(config, 4);
    Queue q;
    for (int i = 0; i < 40; ++i) {
      q.add({static_cast<float>(rng() % 9), static_cast<float>(rng() % 9), static_cast<float>(rng() % 9), 1},
            1 + static_cast<std::int64_t>(rng() % 50));
      q.candidates.back().kv_blocks = 1 + static_cast<std::int64_t>(rng() % 4);
    }
    const AdmissionBudget budget{8, 120, 12};
    const Selection s = selector.select(q.candidates, {}, budget, Clock::now());
    std::int64_t tokens = 0;
    std::int64_t blocks = 0;
    for (const auto i : s.admitted) {
      tokens += q.candidates[static_cast<std::size_t>(i)].tokens;
      blocks += q.candidates[static_cast<std::size_t>(i)].kv_blocks;
    }
    EXPECT_LE(static_cast<std::int64_t>(s.admitted.size()), budget.sequences) << to_string(strategy);
    EXPECT_LE(tokens, budget.tokens) << to_string(strategy);
    EXPECT_LE(blocks, budget.kv_blocks) << to_string(strategy);
    EXPECT_FALSE(s.admitted.empty()) << to_string(strategy);
    std::vector<std::int64_t> sorted = s.admitted;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "admitted twice";
  }
}

// A request that unbalances every batch (all its load on the hot rank) would wait forever under greedy; the
// bound admits it once it has waited max_wait_ms, and nothing younger overtakes it while it does not fit.
TEST(BatchSelector, NoRequestWaitsPastTheBound) {
  SelectorConfig config;
  config.strategy = SelectionStrategy::greedy;
  config.min_queue_depth = 1;
  config.max_wait_ms = 50;
  BatchSelector selector(config, 2);
  struct Waiting {
    std::vector<float> load;
    double arrived_ms;
  };
  std::vector<Waiting> waiting;
  waiting.push_back({{100, 0}, 0});  // the outcast
  double max_wait_seen = 0;
  const std::vector<float> running = {50, 0};
  for (int step = 0; step < 200; ++step) {
    const double now_ms = step * 5.0;
    waiting.push_back({{0, 1}, now_ms});  // a stream of well-balanced newcomers
    std::vector<Candidate> candidates;
    for (const Waiting& w : waiting) candidates.push_back({1, 1, now_ms - w.arrived_ms, w.load});
    const Selection s = selector.select(candidates, running, {1, 100, 100}, Clock::now());
    for (const auto i : s.admitted)
      max_wait_seen = std::max(max_wait_seen, now_ms - waiting[static_cast<std::size_t>(i)].arrived_ms);
    std::vector<std::int64_t> gone = s.admitted;
    std::sort(gone.rbegin(), gone.rend());
    for (const auto i : gone) waiting.erase(waiting.begin() + i);
    for (const Waiting& w : waiting)
      ASSERT_LE(now_ms - w.arrived_ms, config.max_wait_ms + 5.0) << "step " << step;
  }
  EXPECT_LE(max_wait_seen, config.max_wait_ms + 5.0);
}

TEST(BatchSelector, OverdueRequestThatDoesNotFitBlocksYoungerOnes) {
  SelectorConfig config;
  config.strategy = SelectionStrategy::greedy;
  config.min_queue_depth = 1;
  config.max_wait_ms = 10;
  BatchSelector selector(config, 1);
  Queue q;
  q.add({1}, 500, 20);  // overdue, needs 500 tokens
  q.add({1}, 5, 0);
  const Selection s = selector.select(q.candidates, {}, {4, 100, 100}, Clock::now());
  EXPECT_TRUE(s.admitted.empty());
}

TEST(BatchSelector, IntervalFallsBackToFcfsBetweenSelections) {
  SelectorConfig config;
  config.strategy = SelectionStrategy::greedy;
  config.min_queue_depth = 1;
  config.interval_ms = 100;
  BatchSelector selector(config, 2);
  Queue q;
  q.add({5, 0});
  q.add({0, 5});
  const std::vector<float> running = {10, 0};
  const auto t0 = Clock::now();
  EXPECT_TRUE(selector.select(q.candidates, running, {1, 100, 100}, t0).selected);
  const Selection soon =
      selector.select(q.candidates, running, {1, 100, 100}, t0 + std::chrono::milliseconds(10));
  EXPECT_FALSE(soon.selected);
  EXPECT_EQ(soon.admitted, (std::vector<std::int64_t>{0}));
  EXPECT_TRUE(
      selector.select(q.candidates, running, {1, 100, 100}, t0 + std::chrono::milliseconds(150)).selected);
}

TEST(BatchSelector, SeededStrategiesAreReproducible) {
  for (const SelectionStrategy strategy : {SelectionStrategy::power_of_d, SelectionStrategy::random}) {
    Queue q;
    std::mt19937 rng(5);
    for (int i = 0; i < 30; ++i) q.add({static_cast<float>(rng() % 9), static_cast<float>(rng() % 9)});
    SelectorConfig config;
    config.strategy = strategy;
    config.min_queue_depth = 1;
    config.seed = 42;
    BatchSelector a(config, 2);
    BatchSelector b(config, 2);
    const auto now = Clock::now();
    EXPECT_EQ(a.select(q.candidates, {}, {6, 1000, 1000}, now).admitted,
              b.select(q.candidates, {}, {6, 1000, 1000}, now).admitted);
  }
}

TEST(BatchSelector, ParsesStrategyNames) {
  SelectionStrategy s{};
  for (const char* name : {"fcfs", "greedy", "power_of_d", "lpt_balanced", "random"}) {
    ASSERT_TRUE(parse_strategy(name, s)) << name;
    EXPECT_EQ(to_string(s), name);
  }
  EXPECT_FALSE(parse_strategy("best", s));
}

}  // namespace
}  // namespace capserve::server
