#pragma once
// The balance levers side by side on routing counts: contiguous placement (the baseline), balanced placement,
// EPLB-style replication (parallel/expert_replication.h), capacity factors (per-expert capacity, drop) and
// their combinations, each with what it costs (expert copies per rank, assignments dropped). The plan
// (placement, replicas) is made from the counts of all groups pooled, as a server plans from its traffic's
// history; each group (a domain: the steps of domain-clustered traffic) is then a workload. An MoE layer is
// as slow as its most loaded rank, so the figure of merit is the most loaded rank's assignments over the
// mean.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/placement/expert_counts.h"

namespace capserve::tools {

struct Lever {
  std::string name;
  bool balanced = false;                // balanced placement (else contiguous)
  std::int64_t redundant_per_rank = 0;  // EPLB replication: this many extra slots per rank (balanced slots)
  std::optional<double> gamma;          // capacity factor: each expert keeps at most gamma x the mean load
};

// contiguous; balanced; replication +1 and +2 slots per rank; capacity 1.5, 1.25 and 1.0; balanced and
// replication +1 each with capacity 1.25.
std::vector<Lever> standard_levers();

struct LeverResult {
  std::string lever;
  double mean_max_over_mean = 0;  // over groups and layers: the most loaded rank's load / the mean rank load
  double worst_max_over_mean = 0;
  double speedup = 0;  // contiguous's most loaded rank / this lever's, mean over groups and layers
  double dropped = 0;  // fraction of all assignments
  std::int64_t slots_per_rank = 0;  // expert weights a rank holds (the most any rank holds)
  double memory_vs_contiguous = 0;  // slots_per_rank / contiguous's, minus one
};

// One row per lever for `counts` on `ranks` ranks. Throws std::invalid_argument for ranks < 1.
std::vector<LeverResult> lever_table(const ExpertCounts& counts, int ranks, std::span<const Lever> levers);

nlohmann::json to_json(const LeverResult& r);

}  // namespace capserve::tools
