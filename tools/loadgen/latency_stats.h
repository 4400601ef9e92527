#pragma once
// Order statistics of a sample of latencies (or any values): count, mean, p50/p90/p99 (nearest rank), max.
#include <cstddef>
#include <vector>

namespace capserve::loadgen {

struct Distribution {
  std::size_t count = 0;
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

// The nearest-rank percentile (the smallest value with at least q of the sample at or below it) of a sorted,
// non-empty sample; q in [0, 1].
double percentile_sorted(const std::vector<double>& sorted, double q);

// All zero for an empty sample.
Distribution summarize(std::vector<double> values);

}  // namespace capserve::loadgen
