#pragma once
// A reader of the Prometheus text exposition format (version 0.0.4), as served on /metrics: comments and
// blank lines skipped, label values unescaped, NaN/+Inf/-Inf understood, optional timestamps ignored. Lines
// it cannot read are counted, not fatal, so that one odd series never hides the rest.
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace capserve::loadgen {

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Scrape {
  std::vector<Sample> samples;
  std::size_t unreadable_lines = 0;

  // Sum of every series called `name` whose labels include all of `match`; nullopt when there is none.
  [[nodiscard]] std::optional<double> sum(
      std::string_view name, const std::vector<std::pair<std::string, std::string>>& match = {}) const;
  // The value of each series called `name`, keyed by the value of its label `label` (summed over the other
  // labels).
  [[nodiscard]] std::map<std::string, double> by_label(std::string_view name, const std::string& label) const;
};

Scrape parse_prometheus_text(std::string_view text);

}  // namespace capserve::loadgen
