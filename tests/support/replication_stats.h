#pragma once
// A --moe-stats file for loading a model with EPLB replication (--redundant-experts) in tests: expert 0 the
// hottest of every MoE layer, expert 1 the next, the rest falling off, so that the extra copies go to known
// experts.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace capserve::testing {

inline std::filesystem::path write_hot_expert_stats(const std::filesystem::path& path,
                                                    std::span<const std::int64_t> moe_layers,
                                                    std::int64_t experts) {
  nlohmann::json stats;
  stats["layers"] = nlohmann::json::array();
  for (const std::int64_t layer : moe_layers) {
    nlohmann::json load = nlohmann::json::array();
    for (std::int64_t e = 0; e < experts; ++e)
      load.push_back(e == 0 ? 100 * experts : (e == 1 ? 10 * experts : experts - e));
    stats["layers"].push_back({{"layer", layer}, {"routed_load", load}});
  }
  std::ofstream out(path);
  out << stats.dump();
  if (!out) throw std::runtime_error("cannot write " + path.string());
  return path;
}

}  // namespace capserve::testing
