#include "tools/placement/lever_table.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "parallel/expert_placement.h"

namespace capserve::tools {
namespace {

double sum(std::span<const double> v) {
  return std::accumulate(v.begin(), v.end(), 0.0);
}

// What one lever does to the counts: its plan, made once from the pooled counts.
class LeverPlan {
 public:
  LeverPlan(const Lever& lever, const std::vector<std::vector<double>>& pooled, std::int64_t experts,
            int ranks)
      : lever_(lever), experts_(experts), ranks_(ranks) {
    const auto layers = static_cast<std::int64_t>(pooled.size());
    if (lever.redundant_per_rank > 0) {
      placement_.emplace(
          parallel::ExpertPlacement::replicated(pooled, experts, ranks, lever.redundant_per_rank * ranks));
    } else if (lever.balanced) {
      placement_.emplace(parallel::ExpertPlacement::balanced(pooled, experts, ranks));
    } else {
      placement_.emplace(parallel::ExpertPlacement::contiguous(layers, experts, ranks));
    }
  }

  [[nodiscard]] std::int64_t slots_per_rank() const {
    std::int64_t most = 0;
    for (int r = 0; r < ranks_; ++r)
      most = std::max(most, static_cast<std::int64_t>(placement_->local_experts(0, r).size()));
    return most;
  }

  // Per rank, the load a workload's layer puts on it after capacity; `dropped` gets the assignments shed.
  std::vector<double> rank_loads(std::size_t layer, std::span<const double> loads, double& dropped) const {
    std::vector<double> kept(loads.begin(), loads.end());
    if (lever_.gamma) {
      const double capacity = *lever_.gamma * sum(loads) / static_cast<double>(experts_);
      for (double& k : kept) {
        dropped += std::max(0.0, k - capacity);
        k = std::min(k, capacity);
      }
    }
    return placement_->rank_loads(static_cast<std::int64_t>(layer), kept);
  }

 private:
  Lever lever_;
  std::int64_t experts_;
  int ranks_;
  std::optional<parallel::ExpertPlacement> placement_;
};

}  // namespace

std::vector<Lever> standard_levers() {
  return {
      {"contiguous placement (baseline)", false, 0, std::nullopt},
      {"balanced placement", true, 0, std::nullopt},
      {"replication +1 slot per rank", true, 1, std::nullopt},
      {"replication +2 slots per rank", true, 2, std::nullopt},
      {"capacity gamma 1.5", false, 0, 1.5},
      {"capacity gamma 1.25", false, 0, 1.25},
      {"capacity gamma 1.0", false, 0, 1.0},
      {"balanced + capacity 1.25", true, 0, 1.25},
      {"replication +1 + capacity 1.25", true, 1, 1.25},
  };
}

std::vector<LeverResult> lever_table(const ExpertCounts& counts, int ranks, std::span<const Lever> levers) {
  if (ranks < 1) throw std::invalid_argument("lever_table: ranks must be at least 1");
  // Layers in file order, packed: the plans index them 0..L-1.
  std::vector<std::vector<double>> pooled;
  for (const CountsLayer& l : counts.groups.front().layers) pooled.emplace_back(l.counts.size(), 0.0);
  for (const CountsGroup& g : counts.groups) {
    for (std::size_t l = 0; l < g.layers.size(); ++l) {
      for (std::size_t e = 0; e < g.layers[l].counts.size(); ++e) pooled[l][e] += g.layers[l].counts[e];
    }
  }
  const std::int64_t experts = counts.num_experts;
  const LeverPlan baseline({"", false, 0, std::nullopt}, pooled, experts, ranks);
  const std::int64_t base_slots = baseline.slots_per_rank();
  std::vector<LeverResult> out;
  for (const Lever& lever : levers) {
    const LeverPlan plan(lever, pooled, experts, ranks);
    LeverResult r{lever.name};
    double assignments = 0, dropped = 0, cells = 0;
    for (const CountsGroup& g : counts.groups) {
      for (std::size_t l = 0; l < g.layers.size(); ++l) {
        const std::vector<double>& loads = g.layers[l].counts;
        const double mean = sum(loads) / ranks;
        if (mean <= 0) continue;
        double ignored = 0;
        const std::vector<double> base = baseline.rank_loads(l, loads, ignored);
        const std::vector<double> mine = plan.rank_loads(l, loads, dropped);
        const double top = *std::max_element(mine.begin(), mine.end());
        r.mean_max_over_mean += top / mean;
        r.worst_max_over_mean = std::max(r.worst_max_over_mean, top / mean);
        r.speedup += *std::max_element(base.begin(), base.end()) / top;
        assignments += sum(loads);
        cells += 1;
      }
    }
    r.mean_max_over_mean /= cells;
    r.speedup /= cells;
    r.dropped = dropped / assignments;
    r.slots_per_rank = plan.slots_per_rank();
    r.memory_vs_contiguous = static_cast<double>(r.slots_per_rank) / static_cast<double>(base_slots) - 1;
    out.push_back(r);
  }
  return out;
}

nlohmann::json to_json(const LeverResult& r) {
  return {{"lever", r.lever},
          {"mean_max_over_mean", r.mean_max_over_mean},
          {"worst_max_over_mean", r.worst_max_over_mean},
          {"speedup_vs_contiguous", r.speedup},
          {"dropped_fraction", r.dropped},
          {"expert_slots_per_rank", r.slots_per_rank},
          {"expert_memory_vs_contiguous", r.memory_vs_contiguous}};
}

}  // namespace capserve::tools
