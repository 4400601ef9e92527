#include "parallel/capacity_config.h"

#include <cmath>
#include <sstream>

namespace capserve::parallel {
namespace {

template <typename E, std::size_t N>
std::optional<E> lookup(const std::string& text, const std::pair<const char*, E> (&table)[N]) {
  for (const auto& [name, value] : table) {
    if (text == name) return value;
  }
  return std::nullopt;
}

template <typename E, std::size_t N>
std::string name_of(E value, const std::pair<const char*, E> (&table)[N]) {
  for (const auto& [name, v] : table) {
    if (v == value) return name;
  }
  return "?";
}

constexpr std::pair<const char*, CapacityPolicy> kPolicies[] = {{"none", CapacityPolicy::none},
                                                                {"drop", CapacityPolicy::drop},
                                                                {"reroute", CapacityPolicy::reroute},
                                                                {"expanded", CapacityPolicy::expanded}};
constexpr std::pair<const char*, CapacityGranularity> kGranularities[] = {
    {"expert", CapacityGranularity::expert}, {"device", CapacityGranularity::device}};
constexpr std::pair<const char*, CapacityScope> kScopes[] = {{"local", CapacityScope::local},
                                                             {"global", CapacityScope::global}};
constexpr std::pair<const char*, DropScore> kScores[] = {{"gate", DropScore::gate},
                                                         {"order", DropScore::order},
                                                         {"reverse-order", DropScore::reverse_order},
                                                         {"random", DropScore::random}};
constexpr std::pair<const char*, CapacityPhase> kPhases[] = {
    {"prefill", CapacityPhase::prefill}, {"decode", CapacityPhase::decode}, {"both", CapacityPhase::both}};

}  // namespace

bool CapacityConfig::active(std::int64_t layer) const {
  return policy != CapacityPolicy::none && std::isfinite(gamma_for(layer));
}

std::string CapacityConfig::validate(std::int64_t num_layers) const {
  if (gamma.empty()) return "capacity factor: no value given";
  if (gamma.size() != 1 && static_cast<std::int64_t>(gamma.size()) != num_layers) {
    return "capacity factor: " + std::to_string(gamma.size()) + " values given, need 1 or one per layer (" +
           std::to_string(num_layers) + ")";
  }
  for (const double g : gamma) {
    if (std::isnan(g) || g <= 0) return "capacity factor: every value must be positive (or inf)";
  }
  if (rounds < 1) return "capacity rounds: must be at least 1";
  if (local_experts < 1) return "capacity local experts (m): must be at least 1";
  return {};
}

std::optional<std::vector<double>> parse_gamma(const std::string& text) {
  std::vector<double> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item == "inf") {
      values.push_back(std::numeric_limits<double>::infinity());
      continue;
    }
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (used != item.size() || std::isnan(v) || v <= 0) return std::nullopt;
    values.push_back(v);
  }
  if (values.empty()) return std::nullopt;
  return values;
}

std::optional<CapacityPolicy> parse_policy(const std::string& t) {
  return lookup(t, kPolicies);
}
std::optional<CapacityGranularity> parse_granularity(const std::string& t) {
  return lookup(t, kGranularities);
}
std::optional<CapacityScope> parse_scope(const std::string& t) {
  return lookup(t, kScopes);
}
std::optional<DropScore> parse_drop_score(const std::string& t) {
  return lookup(t, kScores);
}
std::optional<CapacityPhase> parse_phase(const std::string& t) {
  return lookup(t, kPhases);
}

std::string to_string(CapacityPolicy v) {
  return name_of(v, kPolicies);
}
std::string to_string(CapacityGranularity v) {
  return name_of(v, kGranularities);
}
std::string to_string(CapacityScope v) {
  return name_of(v, kScopes);
}
std::string to_string(DropScore v) {
  return name_of(v, kScores);
}
std::string to_string(CapacityPhase v) {
  return name_of(v, kPhases);
}

std::string describe(const CapacityConfig& c) {
  std::ostringstream out;
  out << "gamma=";
  for (std::size_t i = 0; i < c.gamma.size(); ++i) out << (i ? "," : "") << c.gamma[i];
  out << " policy=" << to_string(c.policy) << " granularity=" << to_string(c.granularity)
      << " scope=" << to_string(c.scope) << " score=" << to_string(c.score) << " rounds=" << c.rounds
      << " m=" << c.local_experts << " renormalize=" << (c.renormalize_after_drop ? "on" : "off")
      << " apply-to=" << to_string(c.apply_to) << " seed=" << c.seed;
  return out.str();
}

}  // namespace capserve::parallel
