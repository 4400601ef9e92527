// EPLB-style replication: the redundant slots go to the hottest experts by load per copy, as DeepSeek's EPLB
// assigns them (checked against its rule worked by hand), every slot is placed, each rank hosts the same
// number of slots, and an expert's load is split evenly over its copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "parallel/expert_replication.h"

namespace capserve::parallel {
namespace {

TEST(ExpertReplication, RedundantSlotsGoToTheHighestLoadPerCopy) {
  // By hand: loads 12, 1, 6, 1. Slot 1: expert 0 (12 > 6) -> 6 per copy; slot 2: tie 6 / 6, the lower id,
  // expert 0 -> 4; slot 3: expert 2 (6 > 4) -> 3; slot 4: expert 0 (4 > 3).
  const std::vector<double> loads{12, 1, 6, 1};
  const ExpertReplication r = replicate_hot_experts(loads, 4);
  EXPECT_EQ(r.copies, (std::vector<std::int32_t>{4, 1, 2, 1}));
  EXPECT_EQ(r.slot_expert, (std::vector<std::int32_t>{0, 0, 0, 0, 1, 2, 2, 3}));
  EXPECT_EQ(r.slot_load, (std::vector<double>{3, 3, 3, 3, 1, 3, 3, 1}));
  EXPECT_DOUBLE_EQ(std::accumulate(r.slot_load.begin(), r.slot_load.end(), 0.0), 20.0)
      << "the load is split, not multiplied";

  const ExpertReplication none = replicate_hot_experts(loads, 0);
  EXPECT_EQ(none.copies, (std::vector<std::int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(none.slot_load, loads);
}

TEST(ExpertReplication, ReplicationLowersTheMostLoadedRankBelowWhatPlacementAloneReaches) {
  // One expert carries nearly half the load: no placement of whole experts gets the busiest rank below it and
  // the expert it shares its rank with (11 experts over 4 ranks: a rank hosts 2 or 3).
  const std::vector<double> loads{40, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5};
  const std::vector<std::vector<double>> layer{loads};
  const auto balanced = ExpertPlacement::balanced(layer, 11, 4);
  const std::vector<double> whole = balanced.rank_loads(0, loads);
  EXPECT_DOUBLE_EQ(*std::max_element(whole.begin(), whole.end()), 45.0);

  const std::vector<ExpertReplication> r{replicate_hot_experts(loads, 5)};
  EXPECT_EQ(r[0].copies[0], 6) << "every redundant slot: 40 / 5 = 8 per copy is still above the others' 5";
  const ExpertPlacement slots = place_slots(r, 4);
  EXPECT_EQ(slots.num_experts(), 16);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(slots.local_experts(0, rank).size(), 4U) << rank;
  const std::vector<double> replicated = replicated_rank_loads(r[0], slots, 0, loads);
  EXPECT_DOUBLE_EQ(std::accumulate(replicated.begin(), replicated.end(), 0.0), 90.0);
  EXPECT_LE(*std::max_element(replicated.begin(), replicated.end()), 25.0) << "90 / 4 = 22.5 is the floor";

  // Evaluated on another workload (the planning loads are history): the same split rule.
  const std::vector<double> other{8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4};
  const std::vector<double> by_rank = replicated_rank_loads(r[0], slots, 0, other);
  EXPECT_DOUBLE_EQ(std::accumulate(by_rank.begin(), by_rank.end(), 0.0), 12.0);
  EXPECT_LT(*std::max_element(by_rank.begin(), by_rank.end()), 8.0) << "expert 0's 8 is spread over 6 copies";
}

TEST(ExpertReplication, RefusesWhatCannotBeReplicatedOrPlaced) {
  const std::vector<double> loads{1, 2};
  EXPECT_THROW((void)replicate_hot_experts({}, 1), std::invalid_argument);
  EXPECT_THROW((void)replicate_hot_experts(loads, -1), std::invalid_argument);
  EXPECT_THROW((void)replicate_hot_experts(std::vector<double>{1, -2}, 1), std::invalid_argument);
  const std::vector<ExpertReplication> uneven{replicate_hot_experts(loads, 1),
                                              replicate_hot_experts(loads, 2)};
  EXPECT_THROW((void)place_slots(uneven, 2), std::invalid_argument);
  const std::vector<ExpertReplication> one{replicate_hot_experts(loads, 0)};
  const ExpertPlacement slots = place_slots(one, 2);
  EXPECT_THROW((void)replicated_rank_loads(one[0], slots, 0, std::vector<double>{1, 2, 3}),
               std::invalid_argument);
}

}  // namespace
}  // namespace capserve::parallel
