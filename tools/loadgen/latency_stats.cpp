#include "tools/loadgen/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace capserve::loadgen {

double percentile_sorted(const std::vector<double>& sorted, double q) {
  const auto n = static_cast<double>(sorted.size());
  const auto rank = static_cast<std::size_t>(std::max(1.0, std::ceil(std::clamp(q, 0.0, 1.0) * n)));
  return sorted[std::min(rank, sorted.size()) - 1];
}

Distribution summarize(std::vector<double> values) {
  Distribution d;
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  d.count = values.size();
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  d.p50 = percentile_sorted(values, 0.50);
  d.p90 = percentile_sorted(values, 0.90);
  d.p99 = percentile_sorted(values, 0.99);
  d.max = values.back();
  return d;
}

}  // namespace capserve::loadgen
