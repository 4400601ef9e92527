#pragma once
// The reference the token_logprobs tests hold every backend to: log_softmax of a logits row in double, and
// the row's ids in the documented order (larger logit first, ties to the lower id).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace capserve::testing {

inline std::vector<double> log_softmax(std::span<const float> row) {
  const double top = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (const float l : row) sum += std::exp(static_cast<double>(l) - top);
  std::vector<double> out(row.size());
  for (std::size_t i = 0; i < row.size(); ++i) out[i] = static_cast<double>(row[i]) - top - std::log(sum);
  return out;
}

inline std::vector<std::int32_t> ranked_ids(std::span<const float> row) {
  std::vector<std::int32_t> ids(row.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
    return row[static_cast<std::size_t>(a)] > row[static_cast<std::size_t>(b)];
  });
  return ids;
}

}  // namespace capserve::testing
