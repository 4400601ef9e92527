#include "tools/planner/routing_model.h"

#include <numeric>
#include <stdexcept>

namespace capserve::tools {

RoutingModel::RoutingModel(const ExpertCounts& counts, std::int64_t moe_layers, std::int64_t top_k,
                           std::vector<std::pair<std::string, std::string>> aliases)
    : experts_(counts.num_experts),
      top_k_(top_k > 0 ? top_k : counts.top_k.value_or(0)),
      moe_layers_(moe_layers),
      aliases_(std::move(aliases)) {
  if (counts.groups.empty() || counts.groups.front().layers.empty())
    throw std::invalid_argument("routing counts: no domain or no layer");
  if (top_k_ <= 0)
    throw std::invalid_argument("routing counts: the file does not tell top-k; give it (--top-k)");
  if (moe_layers_ <= 0 || experts_ <= 0) throw std::invalid_argument("routing model: no MoE layer or expert");
  share_.reserve(counts.groups.size() * static_cast<std::size_t>(moe_layers_ * experts_));
  for (const CountsGroup& g : counts.groups) {
    domains_.push_back(g.name);
    for (std::int64_t l = 0; l < moe_layers_; ++l) {
      const CountsLayer& measured = g.layers[static_cast<std::size_t>(l) % g.layers.size()];
      const double total = std::accumulate(measured.counts.begin(), measured.counts.end(), 0.0);
      if (static_cast<std::int64_t>(measured.counts.size()) != experts_ || total <= 0)
        throw std::invalid_argument("routing counts: domain " + g.name + " layer " +
                                    std::to_string(measured.layer) + " has no assignments to " +
                                    std::to_string(experts_) + " experts");
      for (const double c : measured.counts) share_.push_back(c / total);
    }
  }
}

int RoutingModel::domain(const std::string& name) const {
  std::string group = name;
  for (const auto& [from, to] : aliases_) {
    if (from == name) group = to;
  }
  for (std::size_t d = 0; d < domains_.size(); ++d) {
    if (domains_[d] == group || domains_[d] == name) return static_cast<int>(d);
  }
  std::string known;
  for (const std::string& d : domains_) known += (known.empty() ? "" : ", ") + d;
  throw std::invalid_argument("routing counts have no domain " + name + " (they have " + known +
                              "; map it with --domain-alias " + name + "=GROUP)");
}

std::span<const double> RoutingModel::share(int domain, std::int64_t layer) const {
  const auto at = (static_cast<std::size_t>(domain) * static_cast<std::size_t>(moe_layers_) +
                   static_cast<std::size_t>(layer)) *
                  static_cast<std::size_t>(experts_);
  return std::span(share_).subspan(at, static_cast<std::size_t>(experts_));
}

void RoutingModel::draw(int domain, std::int64_t layer, std::int64_t tokens, std::mt19937_64& rng,
                        std::span<std::int64_t> counts) const {
  // A multinomial as a chain of binomials: each expert takes its share of the draws still left.
  std::int64_t left = tokens * top_k_;
  double rest = 1;
  const std::span<const double> p = share(domain, layer);
  for (std::size_t e = 0; e < p.size() && left > 0; ++e) {
    if (rest <= 0) break;
    const double q = std::min(1.0, p[e] / rest);
    const std::int64_t n = e + 1 == p.size() ? left : std::binomial_distribution<std::int64_t>(left, q)(rng);
    counts[e] += n;
    left -= n;
    rest -= p[e];
  }
}

std::vector<std::vector<double>> RoutingModel::pooled() const {
  std::vector<std::vector<double>> out(static_cast<std::size_t>(moe_layers_),
                                       std::vector<double>(static_cast<std::size_t>(experts_), 0.0));
  for (std::size_t d = 0; d < domains_.size(); ++d) {
    for (std::int64_t l = 0; l < moe_layers_; ++l) {
      const std::span<const double> p = share(static_cast<int>(d), l);
      for (std::size_t e = 0; e < p.size(); ++e) out[static_cast<std::size_t>(l)][e] += p[e];
    }
  }
  return out;
}

}  // namespace capserve::tools
