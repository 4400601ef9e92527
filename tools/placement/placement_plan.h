#pragma once
// A balanced expert placement computed offline from routing counts (parallel::ExpertPlacement::balanced, the
// logic used inside model runs), with the per-rank loads it gives against the contiguous placement.
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "tools/placement/expert_counts.h"

namespace capserve::tools {

// {"placement": "balanced", "ranks", "num_experts", "format", "domains", "top_k" (when known),
//  "layers": [{"layer", "routed_load", "owners", "rank_load", "contiguous_rank_load", "max_over_mean",
//              "contiguous_max_over_mean"}, ...],
//  "sum_max_rank_load", "contiguous_sum_max_rank_load"}
// The "layers" entries carry "layer" and "routed_load" as `--moe-stats` writes them, so the document given to
// `--expert-placement` yields the same placement (balanced is deterministic) on the same rank count.
// `domains` picks the counts' groups to sum (all when empty). Throws std::runtime_error / invalid_argument.
nlohmann::json placement_document(const ExpertCounts& counts, std::span<const std::string> domains,
                                  int ranks);

}  // namespace capserve::tools
