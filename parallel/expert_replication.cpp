#include "parallel/expert_replication.h"

#include <stdexcept>
#include <string>

namespace capserve::parallel {

ExpertReplication replicate_hot_experts(std::span<const double> loads, std::int64_t redundant,
                                        std::int64_t max_copies) {
  if (loads.empty()) throw std::invalid_argument("replicate_hot_experts: no experts");
  if (redundant < 0)
    throw std::invalid_argument("replicate_hot_experts: a negative number of redundant slots");
  if (max_copies < 1) throw std::invalid_argument("replicate_hot_experts: at most 0 copies per expert");
  const auto experts = static_cast<std::int64_t>(loads.size());
  if (redundant > experts * (max_copies - 1))
    throw std::invalid_argument("replicate_hot_experts: " + std::to_string(redundant) +
                                " redundant slots, but " + std::to_string(experts) +
                                " experts with at most " + std::to_string(max_copies) +
                                " copies each take at most " + std::to_string(experts * (max_copies - 1)));
  for (const double l : loads)
    if (!(l >= 0))
      throw std::invalid_argument("replicate_hot_experts: a load that is negative or not a number");
  ExpertReplication r;
  r.copies.assign(loads.size(), 1);
  for (std::int64_t s = 0; s < redundant; ++s) {
    std::size_t hottest = loads.size();
    for (std::size_t e = 0; e < loads.size(); ++e) {
      if (r.copies[e] >= max_copies) continue;
      if (hottest == loads.size() || loads[e] / r.copies[e] > loads[hottest] / r.copies[hottest]) hottest = e;
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

}  // namespace capserve::parallel
