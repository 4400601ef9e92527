#include "parallel/expert_placement.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace capserve::parallel {
namespace {

std::int64_t quota(std::int64_t num_experts, int num_ranks, int rank) {
  return num_experts / num_ranks + (rank < num_experts % num_ranks ? 1 : 0);
}

std::vector<double> rank_loads(std::span<const std::int32_t> owner, const std::vector<double>& load,
                               int num_ranks) {
  std::vector<double> per(static_cast<std::size_t>(num_ranks), 0.0);
  for (std::size_t e = 0; e < owner.size(); ++e) per[static_cast<std::size_t>(owner[e])] += load[e];
  return per;
}

double max_load(std::span<const std::int32_t> owner, const std::vector<double>& load, int num_ranks) {
  const std::vector<double> per = rank_loads(owner, load, num_ranks);
  return *std::max_element(per.begin(), per.end());
}

// Swaps that relieve the most loaded rank M (the lowest such rank): expert a on M trades places with a
// lighter expert b on another rank r when r stays below M's current load afterwards; of those, the swap with
// the lowest resulting max(M, r), ties to the lowest (a, b). Per-rank counts never change. Each swap strictly
// lowers the sum of squared rank loads, so this ends; the bound only guards against rounding drift.
void refine(std::vector<std::int32_t>& owner, const std::vector<double>& load, int num_ranks) {
  const std::size_t n = owner.size();
  for (std::size_t iteration = 0; iteration <= n * n; ++iteration) {
    const std::vector<double> per = rank_loads(owner, load, num_ranks);
    const auto m = static_cast<std::int32_t>(std::max_element(per.begin(), per.end()) - per.begin());
    const double top = per[static_cast<std::size_t>(m)];
    double best = top;
    std::size_t best_a = n;
    std::size_t best_b = n;
    for (std::size_t a = 0; a < n; ++a) {
      if (owner[a] != m) continue;
      for (std::size_t b = 0; b < n; ++b) {
        if (owner[b] == m || load[b] >= load[a]) continue;
        const double d = load[a] - load[b];
        const double other = per[static_cast<std::size_t>(owner[b])] + d;
        if (other >= top) continue;
        const double worst = std::max(top - d, other);
        if (worst < best) {
          best = worst;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_a == n) return;
    std::swap(owner[best_a], owner[best_b]);
  }
}

}  // namespace

ExpertPlacement::ExpertPlacement(std::string kind, std::int64_t num_layers, std::int64_t num_experts,
                                 int num_ranks)
    : kind_(std::move(kind)), num_layers_(num_layers), num_experts_(num_experts), num_ranks_(num_ranks) {
  // Checked before sizing anything: a negative count would otherwise become a huge size_t.
  if (num_ranks < 1) throw std::invalid_argument("expert placement: the rank count must be at least 1");
  if (num_experts < 1) throw std::invalid_argument("expert placement: the expert count must be at least 1");
  if (num_layers < 0) throw std::invalid_argument("expert placement: negative layer count");
  owner_.resize(static_cast<std::size_t>(num_layers * num_experts));
  local_index_.resize(static_cast<std::size_t>(num_layers * num_experts));
  by_rank_.resize(static_cast<std::size_t>(num_layers * num_experts));
  rank_start_.resize(static_cast<std::size_t>(num_layers * (num_ranks + 1)));
}

void ExpertPlacement::finish_layer(std::int64_t layer) {
  const std::int64_t base = layer * num_experts_;
  std::int64_t* start = rank_start_.data() + layer * (num_ranks_ + 1);
  std::fill(start, start + num_ranks_ + 1, 0);
  for (std::int64_t e = 0; e < num_experts_; ++e) ++start[owner_[static_cast<std::size_t>(base + e)] + 1];
  for (int r = 0; r < num_ranks_; ++r) start[r + 1] += start[r];
  std::vector<std::int64_t> cursor(start, start + num_ranks_);
  for (std::int64_t e = 0; e < num_experts_; ++e) {
    const auto r = owner_[static_cast<std::size_t>(base + e)];
    const std::int64_t pos = cursor[static_cast<std::size_t>(r)]++;
    by_rank_[static_cast<std::size_t>(base + pos)] = static_cast<std::int32_t>(e);
    local_index_[static_cast<std::size_t>(base + e)] = static_cast<std::int32_t>(pos - start[r]);
  }
}

ExpertPlacement ExpertPlacement::contiguous(std::int64_t num_layers, std::int64_t num_experts,
                                            int num_ranks) {
  ExpertPlacement p("contiguous", num_layers, num_experts, num_ranks);
  for (std::int64_t l = 0; l < num_layers; ++l) {
    std::int64_t e = 0;
    for (int r = 0; r < num_ranks; ++r) {
      for (std::int64_t i = 0; i < quota(num_experts, num_ranks, r); ++i, ++e)
        p.owner_[static_cast<std::size_t>(l * num_experts + e)] = r;
    }
    p.finish_layer(l);
  }
  return p;
}

ExpertPlacement ExpertPlacement::round_robin(std::int64_t num_layers, std::int64_t num_experts,
                                             int num_ranks) {
  ExpertPlacement p("round-robin", num_layers, num_experts, num_ranks);
  for (std::int64_t l = 0; l < num_layers; ++l) {
    for (std::int64_t e = 0; e < num_experts; ++e)
      p.owner_[static_cast<std::size_t>(l * num_experts + e)] = static_cast<std::int32_t>(e % num_ranks);
    p.finish_layer(l);
  }
  return p;
}

ExpertPlacement ExpertPlacement::balanced(std::span<const std::vector<double>> loads,
                                          std::int64_t num_experts, int num_ranks) {
  const auto num_layers = static_cast<std::int64_t>(loads.size());
  ExpertPlacement p = contiguous(num_layers, num_experts, num_ranks);
  p.kind_ = "balanced";
  std::vector<std::int32_t> order(static_cast<std::size_t>(num_experts));
  std::vector<double> rank_load(static_cast<std::size_t>(num_ranks));
  std::vector<std::int64_t> rank_count(static_cast<std::size_t>(num_ranks));
  for (std::int64_t l = 0; l < num_layers; ++l) {
    const std::vector<double>& load = loads[static_cast<std::size_t>(l)];
    if (load.empty()) continue;
    if (static_cast<std::int64_t>(load.size()) != num_experts) {
      throw std::invalid_argument("expert placement: layer " + std::to_string(l) + " has " +
                                  std::to_string(load.size()) + " expert loads, the model has " +
                                  std::to_string(num_experts) + " experts");
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return load[static_cast<std::size_t>(a)] > load[static_cast<std::size_t>(b)];
    });
    std::fill(rank_load.begin(), rank_load.end(), 0.0);
    std::fill(rank_count.begin(), rank_count.end(), 0);
    std::vector<std::int32_t> greedy(static_cast<std::size_t>(num_experts));
    for (const std::int32_t e : order) {
      int best = -1;
      for (int r = 0; r < num_ranks; ++r) {
        if (rank_count[static_cast<std::size_t>(r)] >= quota(num_experts, num_ranks, r)) continue;
        if (best < 0 || rank_load[static_cast<std::size_t>(r)] < rank_load[static_cast<std::size_t>(best)])
          best = r;
      }
      greedy[static_cast<std::size_t>(e)] = best;
      rank_load[static_cast<std::size_t>(best)] += load[static_cast<std::size_t>(e)];
      ++rank_count[static_cast<std::size_t>(best)];
    }
    // Greedy alone can lose to the fixed placements (9 experts on 8 ranks, one dominant: it goes to rank 0,
    // the one rank with room for a second expert). Refine it, and the contiguous and round-robin placements
    // (same per-rank counts), by swaps; keep the lowest maximum, greedy's on ties.
    std::vector<std::int32_t> chosen;
    double chosen_max = 0.0;
    const std::span<const std::int32_t> fixed = p.owners(l);  // still contiguous
    std::vector<std::int32_t> robin(static_cast<std::size_t>(num_experts));
    for (std::int64_t e = 0; e < num_experts; ++e)
      robin[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(e % num_ranks);
    for (std::vector<std::int32_t> start :
         {greedy, std::vector<std::int32_t>(fixed.begin(), fixed.end()), robin}) {
      refine(start, load, num_ranks);
      const double m = max_load(start, load, num_ranks);
      if (chosen.empty() || m < chosen_max) {
        chosen = std::move(start);
        chosen_max = m;
      }
    }
    std::copy(chosen.begin(), chosen.end(), p.owner_.begin() + l * num_experts);
    p.finish_layer(l);
  }
  return p;
}

ExpertPlacement ExpertPlacement::from_stats_file(const std::filesystem::path& path, std::int64_t num_layers,
                                                 std::int64_t num_experts, int num_ranks) {
  const std::string where = "expert placement file " + path.string();
  std::ifstream in(path);
  if (!in) throw std::runtime_error(where + ": cannot open");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + ": not valid JSON (" + e.what() + ")");
  }
  if (!json.is_object() || !json.contains("layers") || !json["layers"].is_array())
    throw std::runtime_error(where + ": needs a \"layers\" array, as --moe-stats writes");
  std::vector<std::vector<double>> loads(static_cast<std::size_t>(num_layers));
  for (const nlohmann::json& entry : json["layers"]) {
    if (!entry.is_object() || !entry.contains("layer") || !entry["layer"].is_number_integer() ||
        !entry.contains("routed_load") || !entry["routed_load"].is_array())
      throw std::runtime_error(where + ": each layer needs an integer \"layer\" and a \"routed_load\" array");
    const auto layer = entry["layer"].get<std::int64_t>();
    if (layer < 0 || layer >= num_layers)
      throw std::runtime_error(where + ": layer " + std::to_string(layer) + " is outside the model's " +
                               std::to_string(num_layers) + " layers");
    std::vector<double>& load = loads[static_cast<std::size_t>(layer)];
    if (!load.empty())
      throw std::runtime_error(where + ": layer " + std::to_string(layer) + " appears twice");
    for (const nlohmann::json& v : entry["routed_load"]) {
      if (!v.is_number() || v.get<double>() < 0)
        throw std::runtime_error(where + ": layer " + std::to_string(layer) +
                                 ": loads must be non-negative numbers");
      load.push_back(v.get<double>());
    }
    if (static_cast<std::int64_t>(load.size()) != num_experts)
      throw std::runtime_error(where + ": layer " + std::to_string(layer) + " has " +
                               std::to_string(load.size()) + " loads, the model has " +
                               std::to_string(num_experts) + " experts");
  }
  return balanced(loads, num_experts, num_ranks);
}

ExpertPlacement ExpertPlacement::from_spec(const std::string& spec, std::int64_t num_layers,
                                           std::int64_t num_experts, int num_ranks) {
  if (spec == "contiguous") return contiguous(num_layers, num_experts, num_ranks);
  if (spec == "round-robin") return round_robin(num_layers, num_experts, num_ranks);
  return from_stats_file(spec, num_layers, num_experts, num_ranks);
}

std::span<const std::int32_t> ExpertPlacement::owners(std::int64_t layer) const {
  return {owner_.data() + layer * num_experts_, static_cast<std::size_t>(num_experts_)};
}

std::span<const std::int32_t> ExpertPlacement::local_index(std::int64_t layer) const {
  return {local_index_.data() + layer * num_experts_, static_cast<std::size_t>(num_experts_)};
}

std::vector<double> ExpertPlacement::rank_loads(std::int64_t layer,
                                                const std::vector<double>& expert_loads) const {
  if (static_cast<std::int64_t>(expert_loads.size()) != num_experts_)
    throw std::invalid_argument("expert placement: " + std::to_string(expert_loads.size()) +
                                " expert loads for " + std::to_string(num_experts_) + " experts");
  return parallel::rank_loads(owners(layer), expert_loads, num_ranks_);
}

std::span<const std::int32_t> ExpertPlacement::local_experts(std::int64_t layer, int rank) const {
  const std::int64_t* start = rank_start_.data() + layer * (num_ranks_ + 1);
  return {by_rank_.data() + layer * num_experts_ + start[rank],
          static_cast<std::size_t>(start[rank + 1] - start[rank])};
}

}  // namespace capserve::parallel
