#include "tools/placement/placement_plan.h"

#include <algorithm>
#include <numeric>

#include "parallel/expert_placement.h"

namespace capserve::tools {
namespace {

double max_over_mean(const std::vector<double>& per_rank) {
  const double mean =
      std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / static_cast<double>(per_rank.size());
  return mean > 0 ? *std::max_element(per_rank.begin(), per_rank.end()) / mean : 1.0;
}

}  // namespace

nlohmann::json placement_document(const ExpertCounts& counts, std::span<const std::string> domains,
                                  int ranks) {
  const std::vector<std::vector<double>> loads = summed_layer_counts(counts, domains);
  const auto num_layers = static_cast<std::int64_t>(loads.size());
  const auto balanced = parallel::ExpertPlacement::balanced(loads, counts.num_experts, ranks);
  const auto contiguous = parallel::ExpertPlacement::contiguous(num_layers, counts.num_experts, ranks);
  nlohmann::json layers = nlohmann::json::array();
  double sum_max = 0;
  double contiguous_sum_max = 0;
  for (std::int64_t l = 0; l < num_layers; ++l) {
    const std::vector<double>& load = loads[static_cast<std::size_t>(l)];
    if (load.empty()) continue;
    const std::vector<double> per_rank = balanced.rank_loads(l, load);
    const std::vector<double> contiguous_per_rank = contiguous.rank_loads(l, load);
    sum_max += *std::max_element(per_rank.begin(), per_rank.end());
    contiguous_sum_max += *std::max_element(contiguous_per_rank.begin(), contiguous_per_rank.end());
    layers.push_back({{"layer", l},
                      {"routed_load", load},
                      {"owners", balanced.owners(l)},
                      {"rank_load", per_rank},
                      {"contiguous_rank_load", contiguous_per_rank},
                      {"max_over_mean", max_over_mean(per_rank)},
                      {"contiguous_max_over_mean", max_over_mean(contiguous_per_rank)}});
  }
  std::vector<std::string> used(domains.begin(), domains.end());
  if (used.empty()) {
    for (const CountsGroup& g : counts.groups) used.push_back(g.name);
  }
  nlohmann::json doc = {{"placement", "balanced"},
                        {"ranks", ranks},
                        {"num_experts", counts.num_experts},
                        {"format", counts.format},
                        {"domains", used},
                        {"layers", layers},
                        {"sum_max_rank_load", sum_max},
                        {"contiguous_sum_max_rank_load", contiguous_sum_max}};
  if (counts.top_k) doc["top_k"] = *counts.top_k;
  return doc;
}

}  // namespace capserve::tools
