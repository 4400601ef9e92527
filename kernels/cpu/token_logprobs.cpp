// CpuBackend::token_logprobs: log_softmax of the chosen tokens and each row's top-k, as kernels/backend.h
// defines them; the sums in double, so that this is the reference the device kernel is held to.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/cpu/cpu_backend.h"

namespace capserve::kernels::cpu {

void CpuBackend::token_logprobs(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                                const Tensor& top_ids) {
  const LogprobShape shape = logprob_shape(logits, tokens, values, top_ids);
  const std::span<const float> all = logits.host_span<const float>();
  const std::span<const std::int32_t> chosen = tokens.host_span<const std::int32_t>();
  const std::span<float> out = values.host_span<float>();
  const std::span<std::int32_t> ids = top_ids.host_span<std::int32_t>();
  const auto vocab = static_cast<std::size_t>(shape.vocab);
  const auto k = static_cast<std::size_t>(shape.top_k);
  for (std::size_t r = 0; r < static_cast<std::size_t>(shape.rows); ++r) {
    const std::span<const float> row = all.subspan(r * vocab, vocab);
    // The largest number (NaN skipped, as the device's ordering puts it last); a NaN still reaches the sum.
    float top = -std::numeric_limits<float>::infinity();
    for (const float l : row) top = l > top ? l : top;
    double sum = 0.0;
    for (const float l : row) sum += std::exp(static_cast<double>(l) - static_cast<double>(top));
    const double log_sum = std::log(sum);
    const auto logprob = [&](std::int32_t id) {
      return static_cast<float>(static_cast<double>(row[static_cast<std::size_t>(id)]) -
                                static_cast<double>(top) - log_sum);
    };
    const std::int32_t token = chosen[r];
    out[r * (1 + k)] = token >= 0 && static_cast<std::size_t>(token) < vocab
                           ? logprob(token)
                           : std::numeric_limits<float>::quiet_NaN();
    if (k == 0) continue;
    logprob_order_.resize(vocab);
    std::iota(logprob_order_.begin(), logprob_order_.end(), 0);
    const auto better = [&](std::int32_t a, std::int32_t b) {
      const float la = row[static_cast<std::size_t>(a)];
      const float lb = row[static_cast<std::size_t>(b)];
      if (std::isnan(la) || std::isnan(lb)) return std::isnan(la) == std::isnan(lb) ? a < b : !std::isnan(la);
      return la > lb || (la == lb && a < b);
    };
    std::partial_sort(logprob_order_.begin(), logprob_order_.begin() + static_cast<std::ptrdiff_t>(k),
                      logprob_order_.end(), better);
    for (std::size_t j = 0; j < k; ++j) {
      ids[r * k + j] = logprob_order_[j];
      out[r * (1 + k) + 1 + j] = logprob(logprob_order_[j]);
    }
  }
}

}  // namespace capserve::kernels::cpu
