#pragma once
// Every option of capacity-aware scheduling (parallel/README.md), with the string forms the command-line
// flags and config files use.
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace capserve::parallel {

enum class CapacityPolicy { none, drop, reroute, expanded };
enum class CapacityGranularity { expert, device };
enum class CapacityScope { local, global };
// Which tokens win a full expert: highest gate weight (the paper's rule), or ablations by position or at
// random (seeded).
enum class DropScore { gate, order, reverse_order, random };
enum class CapacityPhase { prefill, decode, both };

struct CapacityConfig {
  // One value for every layer, or one per model layer; infinity switches scheduling off (the exact model).
  std::vector<double> gamma{std::numeric_limits<double>::infinity()};
  CapacityPolicy policy = CapacityPolicy::drop;
  CapacityGranularity granularity = CapacityGranularity::expert;
  CapacityScope scope = CapacityScope::global;
  DropScore score = DropScore::gate;
  std::int64_t rounds = 1;         // reroute / expanded rounds R
  std::int64_t local_experts = 1;  // expanded: m experts on the token's own rank it may fall back to
  bool renormalize_after_drop = false;
  CapacityPhase apply_to = CapacityPhase::both;
  std::uint64_t seed = 0;  // DropScore::random

  [[nodiscard]] double gamma_for(std::int64_t layer) const {
    return gamma.size() == 1 ? gamma.front() : gamma[static_cast<std::size_t>(layer)];
  }
  // True when this layer's assignments can change at all.
  [[nodiscard]] bool active(std::int64_t layer) const;

  // An empty string when the config is usable with a model of `num_layers` layers, else what is wrong.
  [[nodiscard]] std::string validate(std::int64_t num_layers) const;
};

// "inf" or a positive number, or a comma-separated list of them (one per layer).
std::optional<std::vector<double>> parse_gamma(const std::string& text);
std::optional<CapacityPolicy> parse_policy(const std::string& text);
std::optional<CapacityGranularity> parse_granularity(const std::string& text);
std::optional<CapacityScope> parse_scope(const std::string& text);
std::optional<DropScore> parse_drop_score(const std::string& text);
std::optional<CapacityPhase> parse_phase(const std::string& text);

std::string to_string(CapacityPolicy v);
std::string to_string(CapacityGranularity v);
std::string to_string(CapacityScope v);
std::string to_string(DropScore v);
std::string to_string(CapacityPhase v);
// A one-line summary, e.g. for logs and GetServerInfo.
std::string describe(const CapacityConfig& config);

}  // namespace capserve::parallel
