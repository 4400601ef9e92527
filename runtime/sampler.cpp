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

Status Sampler::sample(std::span<const float> logits, std::int32_t& token) {
  const auto vocab = static_cast<std::int32_t>(logits.size());
  std::int32_t best = 0;
  for (std::int32_t i = 0; i < vocab; ++i) {
    const float l = logits[static_cast<std::size_t>(i)];
    if (!std::isfinite(l))
      return Status::internal("the model's logits are not finite (" + std::to_string(l) + " at token id " +
                              std::to_string(i) + "); there is no distribution to sample from");
    if (l > logits[static_cast<std::size_t>(best)]) best = i;
  }
  const float inv_t = 1.0F / params_.temperature;
  // A temperature whose inverse overflows is the limit T -> 0: greedy.
  if (params_.temperature == 0.0F || !std::isfinite(inv_t) || vocab == 0) {
    token = best;
    return {};
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
  // (l - max) / T, not l / T - max / T: the difference is exact for the best token (0, probability weight 1),
  // however small T is, where the two rounded products could differ by more than exp can take.
  const float top = logits[static_cast<std::size_t>(order_[0])];
  double sum = 0.0;
  for (std::int32_t i = 0; i < keep; ++i) {
    const auto p = static_cast<float>(
        std::exp((logits[static_cast<std::size_t>(order_[static_cast<std::size_t>(i)])] - top) * inv_t));
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
  token = order_[static_cast<std::size_t>(keep - 1)];
  for (std::int32_t i = 0; i < keep; ++i) {
    acc += probs_[static_cast<std::size_t>(i)];
    if (u < acc) {
      token = order_[static_cast<std::size_t>(i)];
      break;
    }
  }
  return {};
}

}  // namespace capserve::runtime
