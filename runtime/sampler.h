#pragma once
// Next-token sampling with the usual controls, applied in the order transformers applies them: temperature,
// top-k, top-p. temperature == 0 is greedy (first maximal id), and so is a temperature so small that the
// logits divided by it overflow. A given seed always yields the same tokens.
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "runtime/status.h"

namespace capserve::runtime {

struct SamplingParams {
  float temperature = 0.0F;
  std::int32_t top_k = 0;  // 0: no top-k filter
  float top_p = 1.0F;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;
  std::int64_t max_new_tokens = 16;
};

// Returns an empty string when the parameters are usable, else a message naming the field and its valid
// range.
std::string validate_sampling(const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // Sets `token` to the next token. Fails (internal) when a logit is NaN or infinite: the model produced no
  // distribution to sample from.
  Status sample(std::span<const float> logits, std::int32_t& token);
  [[nodiscard]] bool is_stop(std::int32_t token) const;

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::int32_t> order_;  // grow-only scratch
  std::vector<float> probs_;
};

}  // namespace capserve::runtime
