#pragma once
// How a workload's tokens route, for the trace-driven planner: each domain's share of assignments per expert
// in each MoE layer, from measured routing counts (tools/placement/expert_counts.h: the real OLMoE and
// Mixtral counts in ../shared/data/routing, or a model measurement such as
// tools/results/fine_model_eval.json). A step's assignments are drawn per layer as a multinomial over the
// domain's shares (tokens * top_k draws): the measured means with sampling noise; a prompt's own deviation
// from its domain's mean is not modelled.
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tools/placement/expert_counts.h"

namespace capserve::tools {

class RoutingModel {
 public:
  // The counts' groups are the domains; `aliases` name a workload domain by a group ({"books", "book"}: the
  // corpus's books are the counts' "book"). The served model has `moe_layers` MoE layers: layer i routes as
  // the counts' layer i mod (layers measured) (the shared file holds layers 0, 7 and 15 of OLMoE's 16).
  // Throws std::invalid_argument when the counts have no group or layer, or top-k is unknown and `top_k` is
  // 0 (a given `top_k` wins).
  RoutingModel(const ExpertCounts& counts, std::int64_t moe_layers, std::int64_t top_k,
               std::vector<std::pair<std::string, std::string>> aliases);

  [[nodiscard]] std::int64_t experts() const { return experts_; }
  [[nodiscard]] std::int64_t top_k() const { return top_k_; }
  [[nodiscard]] std::int64_t moe_layers() const { return moe_layers_; }
  [[nodiscard]] const std::vector<std::string>& domains() const { return domains_; }

  // The index of a workload domain (its own name or its alias); std::invalid_argument naming the groups.
  [[nodiscard]] int domain(const std::string& name) const;
  // The domain's share of assignments per expert in MoE layer `layer` (sums to 1).
  [[nodiscard]] std::span<const double> share(int domain, std::int64_t layer) const;
  // Adds `tokens` tokens' assignments (tokens * top_k draws) to counts[expert].
  void draw(int domain, std::int64_t layer, std::int64_t tokens, std::mt19937_64& rng,
            std::span<std::int64_t> counts) const;
  // Every domain's shares summed per layer ([moe_layers][experts]): the history a balanced placement is
  // planned from.
  [[nodiscard]] std::vector<std::vector<double>> pooled() const;

 private:
  std::int64_t experts_ = 0;
  std::int64_t top_k_ = 0;
  std::int64_t moe_layers_ = 0;
  std::vector<std::string> domains_;
  std::vector<std::pair<std::string, std::string>> aliases_;
  std::vector<double> share_;  // [domains, moe_layers, experts]
};

}  // namespace capserve::tools
