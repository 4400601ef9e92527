#pragma once
// A sequence's sampling parameters and what the runtime derives from them. The draw itself is the backend's
// (Backend::sample): temperature, top-k, top-p in the order transformers applies them; temperature == 0 is
// greedy (first maximal id), and so is a temperature so small that the logits divided by it overflow; a given
// seed always yields the same tokens.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/sampling.h"
#include "runtime/status.h"

namespace capserve::runtime {

// The most alternatives a request may ask per token (SamplingParams::top_logprobs; OpenAI's limit).
inline constexpr std::int32_t kMaxTopLogprobs = 20;

struct SamplingParams {
  float temperature = 0.0F;
  std::int32_t top_k = 0;  // 0: no top-k filter
  float top_p = 1.0F;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;
  std::int64_t max_new_tokens = 16;
  // Log-probabilities to report: of each sampled token (logprobs) and of every prompt token after the first
  // given its prefix (prompt_logprobs), each with its top_logprobs most likely alternatives.
  bool logprobs = false;
  bool prompt_logprobs = false;
  std::int32_t top_logprobs = 0;
};

// Returns an empty string when the parameters are usable, else a message naming the field and its valid
// range.
std::string validate_sampling(const SamplingParams& params);

// The backend's controls (kernels/sampling.h) for draw number `step` of a sequence sampled under `params`.
kernels::SampleControls sample_controls(const SamplingParams& params, std::uint64_t step);

[[nodiscard]] bool is_stop_token(const SamplingParams& params, std::int32_t token);

// The error of a sequence whose logits had no distribution to sample from (`token` as the backend's sample
// wrote it: kernels::non_finite_token).
Status non_finite_logits_error(std::int32_t token);

}  // namespace capserve::runtime
