#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace capserve::runtime {

std::string validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0F) || !std::isfinite(p.temperature))
    return "temperature must be a finite number >= 0";
  if (p.top_k < 0) return "top_k must be >= 0 (0 disables it)";
  if (!(p.top_p > 0.0F && p.top_p <= 1.0F)) return "top_p must be in (0, 1]";
  if (p.max_new_tokens < 0) return "max_new_tokens must be >= 0";
  return {};
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

bool Sampler::is_stop(std::int32_t token) const {
  return std::find(params_.stop_token_ids.begin(), params_.stop_token_ids.end(), token) !=
         params_.stop_token_ids.end();
}

std::int32_t Sampler::sample(std::span<const float> logits) {
  const auto vocab = static_cast<std::int32_t>(logits.size());
  if (params_.temperature == 0.0F) {
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  order_.resize(static_cast<std::size_t>(vocab));
  std::iota(order_.begin(), order_.end(), 0);
  // Descending by logit, ties by id, so the candidate order never depends on the sort's stability.
  const auto better = [&](std::int32_t a, std::int32_t b) {
    const float la = logits[static_cast<std::size_t>(a)];
    const float lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::int32_t keep = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    keep = params_.top_k;
    std::nth_element(order_.begin(), order_.begin() + keep, order_.end(), better);
  }
  std::sort(order_.begin(), order_.begin() + keep, better);

  probs_.resize(static_cast<std::size_t>(keep));
  const float inv_t = 1.0F / params_.temperature;
  const float top = logits[static_cast<std::size_t>(order_[0])] * inv_t;
  double sum = 0.0;
  for (std::int32_t i = 0; i < keep; ++i) {
    const auto p = static_cast<float>(
        std::exp(logits[static_cast<std::size_t>(order_[static_cast<std::size_t>(i)])] * inv_t - top));
    probs_[static_cast<std::size_t>(i)] = p;
    sum += p;
  }
  if (params_.top_p < 1.0F) {
    // Smallest prefix whose mass reaches top_p (always at least one token).
    double mass = 0.0;
    std::int32_t cut = 0;
    while (cut < keep) {
      mass += probs_[static_cast<std::size_t>(cut)] / sum;
      ++cut;
      if (mass >= params_.top_p) break;
    }
    keep = cut;
    sum = 0.0;
    for (std::int32_t i = 0; i < keep; ++i) sum += probs_[static_cast<std::size_t>(i)];
  }
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0.0;
  for (std::int32_t i = 0; i < keep; ++i) {
    acc += probs_[static_cast<std::size_t>(i)];
    if (u < acc) return order_[static_cast<std::size_t>(i)];
  }
  return order_[static_cast<std::size_t>(keep - 1)];
}

}  // namespace capserve::runtime
