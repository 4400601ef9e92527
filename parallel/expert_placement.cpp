#include "parallel/expert_placement.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <optional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "parallel/expert_replication.h"

namespace capserve::parallel {
namespace {

std::int64_t quota(std::int64_t num_slots, int num_ranks, int rank) {
  return num_slots / num_ranks + (rank < num_slots % num_ranks ? 1 : 0);
}

std::vector<double> loads_by_owner(std::span<const std::int32_t> owner, std::span<const double> load,
                                   int num_ranks) {
  std::vector<double> per(static_cast<std::size_t>(num_ranks), 0.0);
  for (std::size_t s = 0; s < owner.size(); ++s) per[static_cast<std::size_t>(owner[s])] += load[s];
  return per;
}

double max_load(std::span<const std::int32_t> owner, std::span<const double> load, int num_ranks) {
  const std::vector<double> per = loads_by_owner(owner, load, num_ranks);
  return *std::max_element(per.begin(), per.end());
}

// One layer's slots to place: the load each carries and the expert each holds (no two copies of one expert
// may share a rank; without replication every slot is its own expert and nothing conflicts).
struct SlotSet {
  std::span<const double> load;
  std::span<const std::int32_t> expert;
  std::int64_t num_experts = 0;
  int num_ranks = 1;

  [[nodiscard]] std::size_t size() const { return load.size(); }
  // hosted[r * experts + e]: copies of e on rank r under `owner`.
  [[nodiscard]] std::vector<std::int32_t> hosted(std::span<const std::int32_t> owner) const {
    std::vector<std::int32_t> h(static_cast<std::size_t>(num_ranks * num_experts), 0);
    for (std::size_t s = 0; s < size(); ++s) ++h[cell(owner[s], expert[s])];
    return h;
  }
  [[nodiscard]] std::size_t cell(std::int32_t rank, std::int32_t e) const {
    return static_cast<std::size_t>(rank * num_experts + e);
  }
  [[nodiscard]] bool valid(std::span<const std::int32_t> owner) const {
    const std::vector<std::int32_t> h = hosted(owner);
    return std::all_of(h.begin(), h.end(), [](std::int32_t n) { return n <= 1; });
  }
};

// Swaps that relieve the most loaded rank M (the lowest such rank): slot a on M trades places with a
// lighter slot b on another rank r when r stays below M's current load afterwards and neither rank would
// then host two copies of one expert; of those, the swap with the lowest resulting max(M, r), ties to the
// lowest (a, b). Per-rank counts never change. Each swap strictly lowers the sum of squared rank loads, so
// this ends; the bound only guards against rounding drift.
void refine(std::vector<std::int32_t>& owner, const SlotSet& slots) {
  const std::size_t n = owner.size();
  std::vector<std::int32_t> hosted = slots.hosted(owner);
  for (std::size_t iteration = 0; iteration <= n * n; ++iteration) {
    const std::vector<double> per = loads_by_owner(owner, slots.load, slots.num_ranks);
    const auto m = static_cast<std::int32_t>(std::max_element(per.begin(), per.end()) - per.begin());
    const double top = per[static_cast<std::size_t>(m)];
    double best = top;
    std::size_t best_a = n;
    std::size_t best_b = n;
    for (std::size_t a = 0; a < n; ++a) {
      if (owner[a] != m) continue;
      for (std::size_t b = 0; b < n; ++b) {
        if (owner[b] == m || slots.load[b] >= slots.load[a]) continue;
        if (hosted[slots.cell(owner[b], slots.expert[a])] > 0 || hosted[slots.cell(m, slots.expert[b])] > 0)
          continue;
        const double d = slots.load[a] - slots.load[b];
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
    const std::int32_t r = owner[best_b];
    --hosted[slots.cell(m, slots.expert[best_a])];
    --hosted[slots.cell(r, slots.expert[best_b])];
    ++hosted[slots.cell(r, slots.expert[best_a])];
    ++hosted[slots.cell(m, slots.expert[best_b])];
    std::swap(owner[best_a], owner[best_b]);
  }
}

// Greedy: slots by load (heaviest first, ties by id) to the least loaded rank below its quota that holds no
// copy of the slot's expert, ties to the lower rank; none when some slot finds no such rank.
std::optional<std::vector<std::int32_t>> greedy(const SlotSet& slots) {
  const std::size_t n = slots.size();
  std::vector<std::int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return slots.load[static_cast<std::size_t>(a)] > slots.load[static_cast<std::size_t>(b)];
  });
  std::vector<double> rank_load(static_cast<std::size_t>(slots.num_ranks), 0.0);
  std::vector<std::int64_t> rank_count(static_cast<std::size_t>(slots.num_ranks), 0);
  std::vector<std::int32_t> hosted(static_cast<std::size_t>(slots.num_ranks * slots.num_experts), 0);
  std::vector<std::int32_t> owner(n);
  for (const std::int32_t s : order) {
    const std::int32_t e = slots.expert[static_cast<std::size_t>(s)];
    int best = -1;
    for (int r = 0; r < slots.num_ranks; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      if (rank_count[ru] >= quota(static_cast<std::int64_t>(n), slots.num_ranks, r) ||
          hosted[slots.cell(r, e)] > 0)
        continue;
      if (best < 0 || rank_load[ru] < rank_load[static_cast<std::size_t>(best)]) best = r;
    }
    if (best < 0) return std::nullopt;
    owner[static_cast<std::size_t>(s)] = best;
    rank_load[static_cast<std::size_t>(best)] += slots.load[static_cast<std::size_t>(s)];
    ++rank_count[static_cast<std::size_t>(best)];
    ++hosted[slots.cell(best, e)];
  }
  return owner;
}

std::vector<std::int32_t> contiguous_owners(std::int64_t num_slots, int num_ranks) {
  std::vector<std::int32_t> owner;
  for (int r = 0; r < num_ranks; ++r)
    owner.insert(owner.end(), static_cast<std::size_t>(quota(num_slots, num_ranks, r)), r);
  return owner;
}

std::vector<std::int32_t> round_robin_owners(std::int64_t num_slots, int num_ranks) {
  std::vector<std::int32_t> owner(static_cast<std::size_t>(num_slots));
  for (std::int64_t s = 0; s < num_slots; ++s)
    owner[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s % num_ranks);
  return owner;
}

// Greedy, contiguous and round-robin starts (those that keep copies apart), each refined by swaps; the
// lowest maximum wins, the earlier start on ties. Greedy alone can lose to the fixed placements (9 experts on
// 8 ranks, one dominant: it goes to rank 0, the one rank with room for a second expert). Round-robin always
// keeps copies apart (an expert's copies are consecutive slots, at most one per rank).
std::vector<std::int32_t> place(const SlotSet& slots) {
  const auto n = static_cast<std::int64_t>(slots.size());
  std::vector<std::vector<std::int32_t>> starts;
  if (std::optional<std::vector<std::int32_t>> g = greedy(slots)) starts.push_back(std::move(*g));
  for (std::vector<std::int32_t> fixed :
       {contiguous_owners(n, slots.num_ranks), round_robin_owners(n, slots.num_ranks)})
    if (slots.valid(fixed)) starts.push_back(std::move(fixed));
  std::vector<std::int32_t> chosen;
  double chosen_max = 0.0;
  for (std::vector<std::int32_t>& start : starts) {
    refine(start, slots);
    const double m = max_load(start, slots.load, slots.num_ranks);
    if (chosen.empty() || m < chosen_max) {
      chosen = std::move(start);
      chosen_max = m;
    }
  }
  return chosen;
}

std::vector<std::int32_t> identity(std::int64_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

ExpertPlacement::ExpertPlacement(std::string kind, std::int64_t num_layers, std::int64_t num_experts,
                                 int num_ranks, std::int64_t num_slots)
    : kind_(std::move(kind)),
      num_layers_(num_layers),
      num_experts_(num_experts),
      num_ranks_(num_ranks),
      num_slots_(num_slots) {
  // Checked before sizing anything: a negative count would otherwise become a huge size_t.
  if (num_ranks < 1) throw std::invalid_argument("expert placement: the rank count must be at least 1");
  if (num_experts < 1) throw std::invalid_argument("expert placement: the expert count must be at least 1");
  if (num_layers < 0) throw std::invalid_argument("expert placement: negative layer count");
  if (num_slots < num_experts) throw std::invalid_argument("expert placement: fewer slots than experts");
  const auto cells = static_cast<std::size_t>(num_layers * num_slots);
  owner_.resize(cells);
  local_index_.resize(cells);
  by_rank_.resize(cells);
  slot_expert_.resize(cells);
  rank_start_.resize(static_cast<std::size_t>(num_layers * (num_ranks + 1)));
  first_slot_.resize(static_cast<std::size_t>(num_layers * (num_experts + 1)));
}

void ExpertPlacement::set_layer(std::int64_t layer, std::span<const std::int32_t> owner,
                                std::span<const std::int32_t> slot_expert) {
  const std::int64_t base = layer * num_slots_;
  std::copy(owner.begin(), owner.end(), owner_.begin() + base);
  std::copy(slot_expert.begin(), slot_expert.end(), slot_expert_.begin() + base);
  std::int32_t* first = first_slot_.data() + layer * (num_experts_ + 1);
  std::fill(first, first + num_experts_ + 1, 0);
  for (const std::int32_t e : slot_expert) ++first[e + 1];
  for (std::int64_t e = 0; e < num_experts_; ++e) first[e + 1] += first[e];
  std::int64_t* start = rank_start_.data() + layer * (num_ranks_ + 1);
  std::fill(start, start + num_ranks_ + 1, 0);
  for (const std::int32_t r : owner) ++start[r + 1];
  for (int r = 0; r < num_ranks_; ++r) start[r + 1] += start[r];
  std::vector<std::int64_t> cursor(start, start + num_ranks_);
  for (std::int64_t s = 0; s < num_slots_; ++s) {
    const auto r = owner[static_cast<std::size_t>(s)];
    const std::int64_t pos = cursor[static_cast<std::size_t>(r)]++;
    by_rank_[static_cast<std::size_t>(base + pos)] = static_cast<std::int32_t>(s);
    local_index_[static_cast<std::size_t>(base + s)] = static_cast<std::int32_t>(pos - start[r]);
  }
}

ExpertPlacement ExpertPlacement::contiguous(std::int64_t num_layers, std::int64_t num_experts,
                                            int num_ranks) {
  ExpertPlacement p("contiguous", num_layers, num_experts, num_ranks, num_experts);
  const std::vector<std::int32_t> owner = contiguous_owners(num_experts, num_ranks);
  const std::vector<std::int32_t> slots = identity(num_experts);
  for (std::int64_t l = 0; l < num_layers; ++l) p.set_layer(l, owner, slots);
  return p;
}

ExpertPlacement ExpertPlacement::round_robin(std::int64_t num_layers, std::int64_t num_experts,
                                             int num_ranks) {
  ExpertPlacement p("round-robin", num_layers, num_experts, num_ranks, num_experts);
  const std::vector<std::int32_t> owner = round_robin_owners(num_experts, num_ranks);
  const std::vector<std::int32_t> slots = identity(num_experts);
  for (std::int64_t l = 0; l < num_layers; ++l) p.set_layer(l, owner, slots);
  return p;
}

ExpertPlacement ExpertPlacement::balanced(std::span<const std::vector<double>> loads,
                                          std::int64_t num_experts, int num_ranks) {
  return replicated(loads, num_experts, num_ranks, 0);
}

ExpertPlacement ExpertPlacement::replicated(std::span<const std::vector<double>> loads,
                                            std::int64_t num_experts, int num_ranks, std::int64_t redundant) {
  const auto num_layers = static_cast<std::int64_t>(loads.size());
  if (redundant < 0) throw std::invalid_argument("expert placement: a negative number of redundant slots");
  ExpertPlacement p(redundant > 0 ? "replicated" : "balanced", num_layers, num_experts, num_ranks,
                    num_experts + redundant);
  const std::vector<double> even(static_cast<std::size_t>(num_experts), 1.0);
  for (std::int64_t l = 0; l < num_layers; ++l) {
    const std::vector<double>& load = loads[static_cast<std::size_t>(l)];
    if (!load.empty() && static_cast<std::int64_t>(load.size()) != num_experts) {
      throw std::invalid_argument("expert placement: layer " + std::to_string(l) + " has " +
                                  std::to_string(load.size()) + " expert loads, the model has " +
                                  std::to_string(num_experts) + " experts");
    }
    if (load.empty() && redundant == 0) {
      p.set_layer(l, contiguous_owners(num_experts, num_ranks), identity(num_experts));
      continue;
    }
    ExpertReplication r;
    try {
      r = replicate_hot_experts(load.empty() ? even : load, redundant, num_ranks);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("expert placement over " + std::to_string(num_ranks) +
                                  " ranks (at most one copy of an expert per rank): " + e.what());
    }
    const SlotSet slots{r.slot_load, r.slot_expert, num_experts, num_ranks};
    p.set_layer(l, place(slots), r.slot_expert);
  }
  return p;
}

ExpertPlacement ExpertPlacement::from_stats_file(const std::filesystem::path& path, std::int64_t num_layers,
                                                 std::int64_t num_experts, int num_ranks,
                                                 std::int64_t redundant) {
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
  try {
    return replicated(loads, num_experts, num_ranks, redundant);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(where + ": " + e.what());
  }
}

ExpertPlacement ExpertPlacement::from_spec(const std::string& spec, std::int64_t num_layers,
                                           std::int64_t num_experts, int num_ranks, std::int64_t redundant) {
  if (spec == "contiguous" || spec == "round-robin") {
    if (redundant != 0)
      throw std::runtime_error("expert placement " + spec +
                               ": redundant expert slots are chosen from measured " +
                               "loads; give --expert-placement a --moe-stats file");
    return spec == "contiguous" ? contiguous(num_layers, num_experts, num_ranks)
                                : round_robin(num_layers, num_experts, num_ranks);
  }
  return from_stats_file(spec, num_layers, num_experts, num_ranks, redundant);
}

std::span<const std::int32_t> ExpertPlacement::owners(std::int64_t layer) const {
  return {owner_.data() + layer * num_slots_, static_cast<std::size_t>(num_slots_)};
}

std::span<const std::int32_t> ExpertPlacement::local_index(std::int64_t layer) const {
  return {local_index_.data() + layer * num_slots_, static_cast<std::size_t>(num_slots_)};
}

std::span<const std::int32_t> ExpertPlacement::slot_experts(std::int64_t layer) const {
  return {slot_expert_.data() + layer * num_slots_, static_cast<std::size_t>(num_slots_)};
}

std::span<const std::int32_t> ExpertPlacement::first_slots(std::int64_t layer) const {
  return {first_slot_.data() + layer * (num_experts_ + 1), static_cast<std::size_t>(num_experts_ + 1)};
}

std::span<const std::int32_t> ExpertPlacement::local_experts(std::int64_t layer, int rank) const {
  const std::int64_t* start = rank_start_.data() + layer * (num_ranks_ + 1);
  return {by_rank_.data() + layer * num_slots_ + start[rank],
          static_cast<std::size_t>(start[rank + 1] - start[rank])};
}

std::vector<std::int32_t> ExpertPlacement::hosted_experts(std::int64_t layer, int rank) const {
  std::vector<std::int32_t> experts;
  const std::span<const std::int32_t> held = slot_experts(layer);
  for (const std::int32_t s : local_experts(layer, rank))
    experts.push_back(held[static_cast<std::size_t>(s)]);
  return experts;
}

void ExpertPlacement::add_rank_loads(std::int64_t layer, std::span<const double> expert_loads,
                                     std::span<double> rank_loads) const {
  if (static_cast<std::int64_t>(expert_loads.size()) != num_experts_ ||
      static_cast<std::int64_t>(rank_loads.size()) != num_ranks_)
    throw std::invalid_argument("expert placement: " + std::to_string(expert_loads.size()) +
                                " expert loads and " + std::to_string(rank_loads.size()) +
                                " rank loads for " + std::to_string(num_experts_) + " experts on " +
                                std::to_string(num_ranks_) + " ranks");
  const std::span<const std::int32_t> owner = owners(layer);
  const std::span<const std::int32_t> held = slot_experts(layer);
  const std::span<const std::int32_t> first = first_slots(layer);
  for (std::size_t s = 0; s < owner.size(); ++s) {
    const auto e = static_cast<std::size_t>(held[s]);
    rank_loads[static_cast<std::size_t>(owner[s])] += expert_loads[e] / (first[e + 1] - first[e]);
  }
}

std::vector<double> ExpertPlacement::rank_loads(std::int64_t layer,
                                                std::span<const double> expert_loads) const {
  std::vector<double> per(static_cast<std::size_t>(num_ranks_), 0.0);
  add_rank_loads(layer, expert_loads, per);
  return per;
}

}  // namespace capserve::parallel
