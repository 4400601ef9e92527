#pragma once
// EPLB-style expert replication (DeepSeek's EPLB, the baseline capacity-aware inference argues against):
// redundant copies of the hottest experts, an expert's tokens split evenly over its copies, and the copies
// ("slots") placed over the ranks as evenly as their loads allow (ExpertPlacement::balanced over the slots).
// It buys balance with memory: every slot holds a whole expert's weights.
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/expert_placement.h"

namespace capserve::parallel {

struct ExpertReplication {
  std::vector<std::int32_t> copies;       // [experts]: how many slots hold each expert (at least 1)
  std::vector<std::int32_t> slot_expert;  // [slots]: the expert a slot holds, experts ascending
  std::vector<double> slot_load;          // [slots]: its share of that expert's load
};

// EPLB's replication step: each of the `redundant` extra slots goes, one at a time, to the expert with the
// highest load per copy (ties to the lower id). loads: one per expert, non-negative.
ExpertReplication replicate_hot_experts(std::span<const double> loads, std::int64_t redundant);

// Per layer, the slots of `replication[layer]` placed over `num_ranks` (the same layer count and slot count
// in every layer; ExpertPlacement's experts are the slots here).
ExpertPlacement place_slots(std::span<const ExpertReplication> replication, int num_ranks);

// Per rank, the load `expert_loads` (one per expert) puts on the slots it hosts in `layer`, each expert's
// load split evenly over its copies.
std::vector<double> replicated_rank_loads(const ExpertReplication& replication, const ExpertPlacement& slots,
                                          std::int64_t layer, std::span<const double> expert_loads);

}  // namespace capserve::parallel
