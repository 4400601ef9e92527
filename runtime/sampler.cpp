#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace capserve::runtime {

std::string validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0F) || !std::isfinite(p.temperature))
    return "temperature must be a finite number >= 0";
  if (p.top_k < 0) return "top_k must be >= 0 (0 disables it)";
  if (!(p.top_p > 0.0F && p.top_p <= 1.0F)) return "top_p must be in (0, 1]";
  if (p.max_new_tokens < 0) return "max_new_tokens must be >= 0";
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs)
    return "top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]";
  if (p.top_logprobs > 0 && !p.logprobs && !p.prompt_logprobs)
    return "top_logprobs needs logprobs or prompt_logprobs";
  return {};
}

kernels::SampleControls sample_controls(const SamplingParams& params, std::uint64_t step) {
  return {params.temperature, params.top_k, params.top_p, params.seed, step};
}

bool is_stop_token(const SamplingParams& params, std::int32_t token) {
  return std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) !=
         params.stop_token_ids.end();
}

Status non_finite_logits_error(std::int32_t token) {
  return Status::internal("the model's logits are not finite (at token id " +
                          std::to_string(kernels::first_non_finite_id(token)) +
                          "); there is no distribution to sample from");
}

}  // namespace capserve::runtime
