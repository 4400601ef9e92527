// EPLB-style replication: the redundant slots go to the hottest experts by load per copy, as DeepSeek's EPLB
// assigns them (checked against its rule worked by hand), at most one copy per rank; every slot is placed,
// no rank holds two copies of one expert, each rank hosts the same number of slots, and an expert's load is
// split evenly over its copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>
#include <vector>

#include "parallel/expert_placement.h"
#include "parallel/expert_replication.h"

namespace capserve::parallel {
namespace {

TEST(ExpertReplication, RedundantSlotsGoToTheHighestLoadPerCopy) {
  // By hand: loads 12, 1, 6, 1. Slot 1: expert 0 (12 > 6) -> 6 per copy; slot 2: tie 6 / 6, the lower id,
  // expert 0 -> 4; slot 3: expert 2 (6 > 4) -> 3; slot 4: expert 0 (4 > 3).
  const std::vector<double> loads{12, 1, 6, 1};
  const ExpertReplication r = replicate_hot_experts(loads, 4, 8);
  EXPECT_EQ(r.copies, (std::vector<std::int32_t>{4, 1, 2, 1}));
  EXPECT_EQ(r.slot_expert, (std::vector<std::int32_t>{0, 0, 0, 0, 1, 2, 2, 3}));
  EXPECT_EQ(r.slot_load, (std::vector<double>{3, 3, 3, 3, 1, 3, 3, 1}));
  EXPECT_DOUBLE_EQ(std::accumulate(r.slot_load.begin(), r.slot_load.end(), 0.0), 20.0)
      << "the load is split, not multiplied";

  // At most 3 copies: slot 4 goes to the next hottest per copy, expert 2 (3 > 1).
  EXPECT_EQ(replicate_hot_experts(loads, 4, 3).copies, (std::vector<std::int32_t>{3, 1, 3, 1}));

  const ExpertReplication none = replicate_hot_experts(loads, 0, 1);
  EXPECT_EQ(none.copies, (std::vector<std::int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(none.slot_load, loads);
}

// Every placement invariant of a replicated layer.
void expect_valid(const ExpertPlacement& p, std::int64_t layer) {
  const std::span<const std::int32_t> held = p.slot_experts(layer);
  const std::span<const std::int32_t> first = p.first_slots(layer);
  ASSERT_EQ(static_cast<std::int64_t>(held.size()), p.num_slots());
  ASSERT_EQ(static_cast<std::int64_t>(first.size()), p.num_experts() + 1);
  EXPECT_EQ(first.back(), p.num_slots());
  for (std::int64_t e = 0; e < p.num_experts(); ++e) {
    EXPECT_GE(first[e + 1] - first[e], 1) << "expert " << e << " has a copy";
    for (std::int32_t s = first[e]; s < first[e + 1]; ++s) EXPECT_EQ(held[s], e);
  }
  std::int64_t placed = 0;
  for (int r = 0; r < p.num_ranks(); ++r) {
    const std::vector<std::int32_t> hosted = p.hosted_experts(layer, r);
    EXPECT_TRUE(std::is_sorted(hosted.begin(), hosted.end()));
    EXPECT_EQ(std::set<std::int32_t>(hosted.begin(), hosted.end()).size(), hosted.size())
        << "rank " << r << " holds two copies of one expert";
    const auto n = static_cast<std::int64_t>(p.local_experts(layer, r).size());
    EXPECT_LE(std::abs(n - p.num_slots() / p.num_ranks()), 1) << "rank " << r;
    placed += n;
  }
  EXPECT_EQ(placed, p.num_slots());
}

TEST(ExpertReplication, ReplicationLowersTheMostLoadedRankBelowWhatPlacementAloneReaches) {
  // One expert carries nearly half the load: no placement of whole experts gets the busiest rank below it and
  // the expert it shares its rank with (11 experts over 4 ranks: a rank hosts 2 or 3).
  const std::vector<double> loads{40, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5};
  const std::vector<std::vector<double>> layer{loads};
  const auto balanced = ExpertPlacement::balanced(layer, 11, 4);
  EXPECT_FALSE(balanced.replicated());
  const std::vector<double> whole = balanced.rank_loads(0, loads);
  EXPECT_DOUBLE_EQ(*std::max_element(whole.begin(), whole.end()), 45.0);

  const auto slots = ExpertPlacement::replicated(layer, 11, 4, 5);
  EXPECT_TRUE(slots.replicated());
  EXPECT_EQ(slots.kind(), "replicated");
  EXPECT_EQ(slots.num_experts(), 11);
  EXPECT_EQ(slots.num_slots(), 16);
  const std::span<const std::int32_t> first = slots.first_slots(0);
  EXPECT_EQ(first[1] - first[0], 4) << "expert 0 on every rank (at most one copy per rank), 10 per copy";
  expect_valid(slots, 0);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(slots.local_experts(0, rank).size(), 4U) << rank;
  const std::vector<double> replicated = slots.rank_loads(0, loads);
  EXPECT_DOUBLE_EQ(std::accumulate(replicated.begin(), replicated.end(), 0.0), 90.0);
  EXPECT_LE(*std::max_element(replicated.begin(), replicated.end()), 25.0) << "90 / 4 = 22.5 is the floor";

  // Evaluated on another workload (the planning loads are history): the same split rule.
  const std::vector<double> other{8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4};
  const std::vector<double> by_rank = slots.rank_loads(0, other);
  EXPECT_DOUBLE_EQ(std::accumulate(by_rank.begin(), by_rank.end(), 0.0), 12.0);
  EXPECT_LT(*std::max_element(by_rank.begin(), by_rank.end()), 8.0) << "expert 0's 8 is spread over 4 copies";
}

TEST(ExpertReplication, CopiesStayOnDistinctRanksWhateverTheLoads) {
  // Skewed, flat, and empty (a layer without statistics: its extra copies spread evenly) layers, with more
  // copies wanted of the hottest experts than a greedy pass can keep apart.
  std::vector<double> skewed(16, 1.0);
  skewed[3] = 500;
  skewed[7] = 300;
  const std::vector<std::vector<double>> layers{skewed, std::vector<double>(16, 2.0), {}};
  for (const int ranks : {2, 3, 4, 8}) {
    const std::int64_t redundant = ranks == 2 ? 5 : 12;
    const auto p = ExpertPlacement::replicated(layers, 16, ranks, redundant);
    for (std::int64_t l = 0; l < 3; ++l) {
      SCOPED_TRACE("ranks " + std::to_string(ranks) + " layer " + std::to_string(l));
      expect_valid(p, l);
    }
    const std::span<const std::int32_t> first = p.first_slots(2);
    for (std::int64_t e = 0; e < 16; ++e)
      EXPECT_LE(first[e + 1] - first[e], 2) << "even spread, expert " << e;
  }
}

TEST(ExpertReplication, RefusesWhatCannotBeReplicatedOrPlaced) {
  const std::vector<double> loads{1, 2};
  EXPECT_THROW((void)replicate_hot_experts({}, 1, 2), std::invalid_argument);
  EXPECT_THROW((void)replicate_hot_experts(loads, -1, 2), std::invalid_argument);
  EXPECT_THROW((void)replicate_hot_experts(std::vector<double>{1, -2}, 1, 2), std::invalid_argument);
  EXPECT_THROW((void)replicate_hot_experts(loads, 3, 2), std::invalid_argument) << "2 experts x 1 extra copy";
  EXPECT_NO_THROW((void)replicate_hot_experts(loads, 2, 2));
  const std::vector<std::vector<double>> layer{loads};
  EXPECT_THROW((void)ExpertPlacement::replicated(layer, 2, 1, 1), std::invalid_argument)
      << "one rank holds one copy of each expert";
  EXPECT_THROW((void)ExpertPlacement::replicated(layer, 2, 2, -1), std::invalid_argument);
  EXPECT_THROW((void)ExpertPlacement::replicated(layer, 3, 2, 1), std::invalid_argument)
      << "2 loads, 3 experts";
  const auto p = ExpertPlacement::replicated(layer, 2, 2, 1);
  EXPECT_THROW((void)p.rank_loads(0, std::vector<double>{1, 2, 3}), std::invalid_argument);
  EXPECT_THROW((void)ExpertPlacement::from_spec("contiguous", 1, 2, 2, 1), std::runtime_error)
      << "replicas are chosen from measured loads";
}

}  // namespace
}  // namespace capserve::parallel
