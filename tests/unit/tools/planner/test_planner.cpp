// The trace-driven planner's parts: the step cost (each phase waits for its slowest rank, or on shared cores
// for the total over the cores; capacity's extra collectives; the cost file's refusals), the routing model
// (per-domain shares, layers reused in turn, draws that keep the shares), and the simulation driving the
// server's own scheduler (a lone request's latencies worked by hand, capacity and replication moving the
// imbalance the way they must, the same seed giving the same run).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tools/planner/routing_model.h"
#include "tools/planner/simulation.h"
#include "tools/planner/step_cost.h"

namespace capserve::tools {
namespace {

StepCost cost_for(std::int64_t layers, std::int64_t experts, std::int64_t top_k) {
  StepCost c;
  c.name = "test";
  c.moe_layers = layers;
  c.experts = experts;
  c.top_k = top_k;
  c.row_bytes = 8;
  return c;
}

TEST(StepCost, EachPhaseWaitsForItsSlowestRankOrTheSharedCores) {
  StepCost c = cost_for(1, 4, 2);
  c.step = 1;
  c.token = 1;
  c.assignment = 0.5;
  c.active_expert = 2;
  c.layer = 0.25;
  c.wire_byte = 0.125;
  const std::vector<server::RankWork> ranks{{.tokens = 4}, {.tokens = 2}};
  const std::vector<std::int64_t> load{8, 2}, active{1, 1}, wire{16}, dropped{0};
  // One device per rank: dense 4 (rank 0), experts max(0.5*8 + 2, 0.5*2 + 2) = 6, wire 0.125 * 16 / 2 = 1.
  StepSeconds s = step_seconds(c, {ranks, load, active, wire, dropped, false});
  EXPECT_DOUBLE_EQ(s.total, 1 + 4 + 0.25 + 6 + 1);
  EXPECT_DOUBLE_EQ(s.moe, 0.25 + 6 + 1);
  // Both ranks on one core: each phase takes its total (dense 6, experts 9).
  c.cores = 1;
  s = step_seconds(c, {ranks, load, active, wire, dropped, false});
  EXPECT_DOUBLE_EQ(s.total, 1 + 6 + 0.25 + 9 + 1);
  // On two cores the slowest rank is longer than half the total.
  c.cores = 2;
  EXPECT_DOUBLE_EQ(step_seconds(c, {ranks, load, active, wire, dropped, false}).total, 1 + 4 + 0.25 + 6 + 1);
  // A GPU's expert is the slower of compute and reading its weights.
  c.cores = 0;
  c.expert_time = ExpertTime::roofline;
  EXPECT_DOUBLE_EQ(step_seconds(c, {ranks, load, active, wire, dropped, false}).moe, 0.25 + 4 + 1);
  // Capacity: its fixed collectives per layer, and the threshold's rounds only where something dropped.
  c.capacity_layer = 10;
  c.capacity_refine = 100;
  EXPECT_DOUBLE_EQ(step_seconds(c, {ranks, load, active, wire, dropped, true}).moe, 10 + 0.25 + 4 + 1);
  const std::vector<std::int64_t> some_dropped{3};
  EXPECT_DOUBLE_EQ(step_seconds(c, {ranks, load, active, wire, some_dropped, true}).moe, 110 + 0.25 + 4 + 1);
  EXPECT_DOUBLE_EQ(step_seconds(c, {ranks, load, active, wire, some_dropped, false}).moe, 0.25 + 4 + 1);
}

TEST(StepCost, AFileRoundTripsAndAFaultIsNamed) {
  StepCost c = cost_for(3, 8, 2);
  c.cores = 2;
  c.expert_time = ExpertTime::roofline;
  c.token = 1e-5;
  c.capacity_refine = 2e-3;
  c.assumptions = {"made up"};
  const auto path = std::filesystem::temp_directory_path() / "capserve_test_step_cost.json";
  std::ofstream(path) << to_json(c).dump();
  const StepCost back = read_step_cost(path);
  EXPECT_EQ(back.moe_layers, 3);
  EXPECT_EQ(back.cores, 2);
  EXPECT_EQ(back.expert_time, ExpertTime::roofline);
  EXPECT_DOUBLE_EQ(back.token, 1e-5);
  EXPECT_DOUBLE_EQ(back.capacity_refine, 2e-3);
  EXPECT_EQ(back.assumptions, c.assumptions);

  nlohmann::json broken = to_json(c);
  broken["seconds"]["assignment"] = -1;
  std::ofstream(path) << broken.dump();
  try {
    (void)read_step_cost(path);
    FAIL() << "a negative coefficient was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("\"assignment\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  broken = to_json(c);
  broken["model"]["top_k"] = 9;  // more than the 8 experts
  std::ofstream(path) << broken.dump();
  EXPECT_THROW((void)read_step_cost(path), std::runtime_error);
  std::filesystem::remove(path);
}

// Two domains over 4 experts, two measured layers: "hot" sends 70% of layer 0's assignments to expert 0.
ExpertCounts two_domains() {
  ExpertCounts counts;
  counts.format = "counts";
  counts.num_experts = 4;
  counts.top_k = 2;
  counts.groups = {{"hot", {{0, {70, 10, 10, 10}}, {7, {25, 25, 25, 25}}}},
                   {"flat", {{0, {25, 25, 25, 25}}, {7, {10, 10, 10, 70}}}}};
  return counts;
}

TEST(RoutingModel, SharesPerDomainWithTheMeasuredLayersTakenInTurn) {
  const RoutingModel routing(two_domains(), 3, 0, {{"books", "hot"}});
  EXPECT_EQ(routing.top_k(), 2);
  EXPECT_EQ(routing.domain("books"), routing.domain("hot"));
  EXPECT_DOUBLE_EQ(routing.share(routing.domain("hot"), 0)[0], 0.7);
  EXPECT_DOUBLE_EQ(routing.share(routing.domain("flat"), 1)[3], 0.7);
  EXPECT_DOUBLE_EQ(routing.share(routing.domain("hot"), 2)[0], 0.7);  // layer 2 is measured layer 0 again
  const auto pooled = routing.pooled();
  EXPECT_DOUBLE_EQ(pooled[0][0], 0.95);

  std::mt19937_64 rng(5);
  std::vector<std::int64_t> counts(4, 0);
  routing.draw(routing.domain("hot"), 0, 10000, rng, counts);
  EXPECT_EQ(counts[0] + counts[1] + counts[2] + counts[3], 20000);  // tokens * top_k
  EXPECT_NEAR(static_cast<double>(counts[0]) / 20000, 0.7, 0.02);

  try {
    (void)routing.domain("code");
    FAIL() << "an unknown domain was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hot, flat"), std::string::npos) << e.what();
  }
  ExpertCounts no_k = two_domains();
  no_k.top_k.reset();
  EXPECT_THROW(RoutingModel(no_k, 2, 0, {}), std::invalid_argument);
}

TEST(Simulation, ALoneRequestTakesItsPrefillThenOneStepPerToken) {
  const RoutingModel routing(two_domains(), 2, 0, {});
  StepCost c = cost_for(2, 4, 2);
  c.step = 0.01;
  c.token = 0.001;
  SimConfig config;
  config.ranks = 2;
  config.scheduler.max_batched_tokens = 64;
  // 40 prompt tokens in one step (0.01 + 0.04 s), then 4 decodes of one token (0.011 s each).
  const SimResult r =
      simulate(config, routing, c, {{.at_s = 2.0, .domain = 0, .prompt_tokens = 40, .output_tokens = 5}});
  ASSERT_EQ(r.requests.size(), 1U);
  EXPECT_TRUE(r.requests[0].ok);
  EXPECT_NEAR(r.requests[0].ttft_s, 0.05, 1e-9);
  EXPECT_NEAR(r.requests[0].e2e_s, 0.05 + 4 * 0.011, 1e-9);
  EXPECT_EQ(r.steps, 5);
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_DOUBLE_EQ(r.assignments, 44 * 2 * 2);  // tokens * top_k * layers
  EXPECT_DOUBLE_EQ(r.dropped, 0);
}

std::vector<SimRequest> burst(int domain, int n) {
  std::vector<SimRequest> out;
  for (int i = 0; i < n; ++i)
    out.push_back({.at_s = 0.01 * i, .domain = domain, .prompt_tokens = 64, .output_tokens = 8});
  return out;
}

TEST(Simulation, CapacityAndReplicationLowerTheImbalanceAtTheirCosts) {
  const RoutingModel routing(two_domains(), 2, 0, {});
  StepCost c = cost_for(2, 4, 2);
  c.step = 0.001;
  c.assignment = 1e-5;
  SimConfig config;
  config.ranks = 2;
  const auto requests = burst(0, 40);
  const SimResult plain = simulate(config, routing, c, requests);
  config.gamma = 1.0;
  const SimResult capped = simulate(config, routing, c, requests);
  EXPECT_EQ(plain.dropped, 0);
  EXPECT_GT(capped.dropped, 0.1 * capped.assignments);
  EXPECT_LT(capped.imbalance, plain.imbalance);
  config.gamma = std::numeric_limits<double>::infinity();
  config.redundant_per_rank = 1;
  const SimResult replicated = simulate(config, routing, c, requests);
  EXPECT_EQ(plain.slots_per_rank, 2);
  EXPECT_EQ(replicated.slots_per_rank, 3);
  EXPECT_LT(replicated.imbalance, plain.imbalance);
  EXPECT_EQ(replicated.dropped, 0);

  // The same seed, the same run; every request ends.
  config.redundant_per_rank = 0;
  const SimResult again = simulate(config, routing, c, requests);
  EXPECT_DOUBLE_EQ(again.imbalance, plain.imbalance);
  EXPECT_EQ(again.steps, plain.steps);
  for (const SimRequestOutcome& o : again.requests) EXPECT_TRUE(o.ok);
}

TEST(Simulation, LocalCapacityBoundsEachRankWithoutTheCollectives) {
  const RoutingModel routing(two_domains(), 2, 0, {});
  StepCost c = cost_for(2, 4, 2);
  c.step = 0.001;
  SimConfig config;
  config.gamma = 1.0;
  const auto requests = burst(0, 40);
  // One rank: its tokens are the step's, so both scopes make the same draws and drops.
  const SimResult global = simulate(config, routing, c, requests);
  config.local_capacity = true;
  const SimResult local = simulate(config, routing, c, requests);
  EXPECT_GT(global.dropped, 0);
  EXPECT_DOUBLE_EQ(local.dropped, global.dropped);
  EXPECT_EQ(local.steps, global.steps);
  EXPECT_DOUBLE_EQ(local.imbalance, global.imbalance);
  // Priced collectives (the only MoE cost here): every global step pays them per MoE layer, no local one.
  c.capacity_layer = 0.01;
  c.capacity_refine = 0.02;
  for (const int ranks : {1, 2}) {
    config.ranks = ranks;
    config.local_capacity = false;
    const SimResult with = simulate(config, routing, c, requests);
    config.local_capacity = true;
    const SimResult without = simulate(config, routing, c, requests);
    EXPECT_GE(with.moe_s, static_cast<double>(with.steps) * 2 * c.capacity_layer) << ranks;
    EXPECT_DOUBLE_EQ(without.moe_s, 0.0) << ranks;
    EXPECT_GT(without.dropped, 0) << ranks;
    EXPECT_LT(without.dropped, without.assignments) << ranks;
  }
}

TEST(Simulation, ACostForAnotherModelIsRefused) {
  const RoutingModel routing(two_domains(), 2, 0, {});
  EXPECT_THROW((void)simulate(SimConfig{}, routing, cost_for(3, 4, 2), burst(0, 1)), std::invalid_argument);
  SimConfig bad;
  bad.placement = "random";
  EXPECT_THROW((void)simulate(bad, routing, cost_for(2, 4, 2), burst(0, 1)), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::tools
