#include "parallel/expert_replication.h"

#include <stdexcept>
#include <string>

namespace capserve::parallel {

ExpertReplication replicate_hot_experts(std::span<const double> loads, std::int64_t redundant) {
  if (loads.empty()) throw std::invalid_argument("replicate_hot_experts: no experts");
  if (redundant < 0)
    throw std::invalid_argument("replicate_hot_experts: a negative number of redundant slots");
  for (const double l : loads)
    if (!(l >= 0))
      throw std::invalid_argument("replicate_hot_experts: a load that is negative or not a number");
  ExpertReplication r;
  r.copies.assign(loads.size(), 1);
  for (std::int64_t s = 0; s < redundant; ++s) {
    std::size_t hottest = 0;
    for (std::size_t e = 1; e < loads.size(); ++e) {
      if (loads[e] / r.copies[e] > loads[hottest] / r.copies[hottest]) hottest = e;
    }
    ++r.copies[hottest];
  }
  for (std::size_t e = 0; e < loads.size(); ++e) {
    for (std::int32_t c = 0; c < r.copies[e]; ++c) {
      r.slot_expert.push_back(static_cast<std::int32_t>(e));
      r.slot_load.push_back(loads[e] / r.copies[e]);
    }
  }
  return r;
}

ExpertPlacement place_slots(std::span<const ExpertReplication> replication, int num_ranks) {
  if (replication.empty()) throw std::invalid_argument("place_slots: no layers");
  const std::size_t slots = replication.front().slot_load.size();
  std::vector<std::vector<double>> loads;
  for (const ExpertReplication& r : replication) {
    if (r.slot_load.size() != slots)
      throw std::invalid_argument("place_slots: layers with " + std::to_string(slots) + " and " +
                                  std::to_string(r.slot_load.size()) + " slots");
    loads.push_back(r.slot_load);
  }
  return ExpertPlacement::balanced(loads, static_cast<std::int64_t>(slots), num_ranks);
}

std::vector<double> replicated_rank_loads(const ExpertReplication& replication, const ExpertPlacement& slots,
                                          std::int64_t layer, std::span<const double> expert_loads) {
  if (expert_loads.size() != replication.copies.size())
    throw std::invalid_argument("replicated_rank_loads: " + std::to_string(expert_loads.size()) +
                                " loads for " + std::to_string(replication.copies.size()) + " experts");
  std::vector<double> per_slot(replication.slot_expert.size());
  for (std::size_t s = 0; s < per_slot.size(); ++s) {
    const auto e = static_cast<std::size_t>(replication.slot_expert[s]);
    per_slot[s] = expert_loads[e] / replication.copies[e];
  }
  return slots.rank_loads(layer, per_slot);
}

}  // namespace capserve::parallel
