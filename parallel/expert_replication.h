#pragma once
// EPLB-style expert replication (DeepSeek's EPLB, the baseline capacity-aware inference argues against):
// redundant copies of the hottest experts, an expert's tokens split evenly over its copies. The copies
// ("slots") are placed over the ranks by ExpertPlacement::replicated; every slot holds a whole expert's
// weights, so replication buys balance with memory.
#include <cstdint>
#include <span>
#include <vector>

namespace capserve::parallel {

struct ExpertReplication {
  std::vector<std::int32_t> copies;       // [experts]: how many slots hold each expert (at least 1)
  std::vector<std::int32_t> slot_expert;  // [slots]: the expert a slot holds, experts ascending
  std::vector<double> slot_load;          // [slots]: its share of that expert's load
};

// EPLB's replication step: each of the `redundant` extra slots goes, one at a time, to the expert with the
// highest load per copy among those with fewer than `max_copies` (ties to the lower id). loads: one per
// expert, non-negative. std::invalid_argument when the slots cannot all be given out (redundant >
// experts x (max_copies - 1)).
ExpertReplication replicate_hot_experts(std::span<const double> loads, std::int64_t redundant,
                                        std::int64_t max_copies);

}  // namespace capserve::parallel
