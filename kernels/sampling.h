#pragma once
// Next-token sampling controls, one per row of a batch's logits, as every backend's `sample` takes them.
//
// Each row's logits are first adjusted, in vLLM's order: the allowed-token bitmask (disallowed ids -inf), the
// banned ids (-inf: min_tokens's stop ids), logit_bias (added), then the penalties (repetition over the
// prompt and generated tokens, HF's definition: positive logits divided by it, negative ones multiplied;
// frequency and presence over the generated tokens, OpenAI's: minus frequency * count, minus presence once
// the token occurred). Then temperature, min_p, top-k, top-p, and the draw. Log-probabilities are of the raw
// logits, as vLLM's default.
#include <cstdint>
#include <limits>
#include <span>

#include "kernels/host_device.h"

namespace capserve::kernels {

// [begin, end) of one of SampleInputs's arrays.
struct IndexRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

struct LogitBias {
  std::int32_t token = 0;
  float bias = 0.0F;
};

struct SampleControls {
  float temperature = 0.0F;  // 0 (or so small that logits / temperature overflow): greedy
  std::int32_t top_k = 0;    // 0: no top-k filter
  float top_p = 1.0F;        // 1: no top-p filter
  std::uint64_t seed = 0;
  std::uint64_t step = 0;  // numbers the draws of one seed: (seed, step) always draws the same token
  // 0: off; else keeps the tokens whose probability (after temperature) is at least min_p times the most
  // likely token's. Greedy ignores it (it never removes the most likely token).
  float min_p = 0.0F;
  float presence_penalty = 0.0F;
  float frequency_penalty = 0.0F;
  float repetition_penalty = 1.0F;  // 1: off
  IndexRange banned = {};           // of SampleInputs::banned
  IndexRange bias = {};             // of SampleInputs::biases (each token at most once)
  IndexRange history = {};          // of SampleInputs::history: the prompt's tokens, then the generated ones
  std::int64_t prompt_tokens = 0;   // the first of `history` that are the prompt's

  [[nodiscard]] CAPSERVE_HD bool penalized() const {
    return history.end > history.begin &&
           (presence_penalty != 0.0F || frequency_penalty != 0.0F || repetition_penalty != 1.0F);
  }
};

// A logit after the penalties of a token generated `generated` times before (and in the prompt or not), given
// it had no penalty yet; the identity for a token never seen.
CAPSERVE_HD inline float penalize(float logit, std::int32_t generated, bool in_prompt,
                                  const SampleControls& c) {
  if (generated == 0 && !in_prompt) return logit;
  logit = logit > 0.0F ? logit / c.repetition_penalty : logit * c.repetition_penalty;
  if (generated == 0) return logit;
  return logit - c.frequency_penalty * static_cast<float>(generated) - c.presence_penalty;
}

// A step's sampling inputs, host values. `allowed` is empty (every token allowed) or one bitmask row per
// logits row in xgrammar's layout: int32 words, bit (id % 32) of word (id / 32) set = allowed,
// allowed_words(vocab) words a row.
struct SampleInputs {
  std::span<const SampleControls> controls = {};
  std::span<const std::int32_t> history = {};
  std::span<const std::int32_t> banned = {};
  std::span<const LogitBias> biases = {};
  std::span<const std::int32_t> allowed = {};
};

CAPSERVE_HD constexpr std::int64_t allowed_words(std::int64_t vocab) {
  return (vocab + 31) / 32;
}
CAPSERVE_HD constexpr bool allowed_bit(const std::int32_t* row, std::int64_t id) {
  return ((static_cast<std::uint32_t>(row[id / 32]) >> (id % 32)) & 1U) != 0;
}

// What `sample` writes for a row with a NaN or infinite logit at id i: no distribution to sample from.
CAPSERVE_HD constexpr std::int32_t non_finite_token(std::int32_t first_bad_id) {
  return -1 - first_bad_id;
}
// What `sample` writes for a row whose controls leave no token (the bitmask, banned ids and -inf biases rule
// out every id).
inline constexpr std::int32_t kNoAllowedToken = std::numeric_limits<std::int32_t>::min();
CAPSERVE_HD constexpr bool is_non_finite_token(std::int32_t token) {
  return token < 0 && token != kNoAllowedToken;
}
// Either failure: no token was drawn.
CAPSERVE_HD constexpr bool is_failed_draw(std::int32_t token) {
  return token < 0;
}
CAPSERVE_HD constexpr std::int32_t first_non_finite_id(std::int32_t token) {
  return -1 - token;
}

}  // namespace capserve::kernels
