#pragma once
// A sequence's sampling parameters and what the runtime derives from them. The draw itself is the backend's
// (Backend::sample): the logits adjusted (allowed-token bitmask, min_tokens, logit_bias, penalties; the order
// and definitions: kernels/sampling.h), then temperature, min_p, top-k, top-p; temperature == 0 is greedy
// (first maximal id), and so is a temperature so small that the logits divided by it overflow; a given seed
// always yields the same tokens.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/sampling.h"
#include "runtime/status.h"

namespace capserve::runtime {

// The most alternatives a request may ask per token (SamplingParams::top_logprobs; OpenAI's limit).
inline constexpr std::int32_t kMaxTopLogprobs = 20;
// OpenAI's ranges: presence and frequency penalties, a logit_bias value.
inline constexpr float kMaxPenalty = 2.0F;
inline constexpr float kMaxLogitBias = 100.0F;

struct SamplingParams {
  float temperature = 0.0F;
  std::int32_t top_k = 0;  // 0: no top-k filter
  float top_p = 1.0F;
  float min_p = 0.0F;  // 0: off
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;  // with the EOS ids unless ignore_eos
  std::int64_t max_new_tokens = 16;
  // stop_token_ids cannot be drawn before this many tokens were generated (vLLM's min_tokens).
  std::int64_t min_tokens = 0;
  float presence_penalty = 0.0F;               // [-2, 2], over the generated tokens
  float frequency_penalty = 0.0F;              // [-2, 2], over the generated tokens
  float repetition_penalty = 1.0F;             // > 0, over the prompt and generated tokens; 1: off
  std::vector<kernels::LogitBias> logit_bias;  // each token at most once, bias in [-100, 100]
  // Log-probabilities to report: of each sampled token (logprobs) and of every prompt token after the first
  // given its prefix (prompt_logprobs), each with its top_logprobs most likely alternatives.
  bool logprobs = false;
  bool prompt_logprobs = false;
  std::int32_t top_logprobs = 0;
  // Structured output: what the generated text must be, as runtime/grammar's parse_constraint reads it (JSON
  // text, e.g. {"json_schema": {...}, "whitespace": "compact"}); empty: unconstrained. Each draw takes only
  // tokens the constraint allows, and a stop token only once the text is complete.
  std::string constraint;
  // A protected request's sequence (server/README.md, "Capacity classes"): the capacity scheduler never drops
  // its tokens' expert assignments. Not a sampling control, but it travels with the sequence as they do.
  bool protect = false;

  // Whether a draw needs the sequence's prompt and generated tokens (a penalty is set).
  [[nodiscard]] bool penalized() const {
    return presence_penalty != 0.0F || frequency_penalty != 0.0F || repetition_penalty != 1.0F;
  }
};

// OK when the parameters are usable, else invalid_argument naming the field and its valid range (token ids
// against the vocabulary are the server's check, which knows it).
Status validate_sampling(const SamplingParams& params);

// The backend's controls (kernels/sampling.h) for draw number `step` of a sequence sampled under `params`,
// without the adjustments that need a step's arrays (SampleBatch adds those).
kernels::SampleControls sample_controls(const SamplingParams& params, std::uint64_t step);

// One step's sampling inputs (kernels::SampleInputs), a row at a time; its arrays are reused from step to
// step.
class SampleBatch {
 public:
  void clear();
  // A row nobody reads the draw of (a prompt position before the last): greedy, nothing adjusted.
  void add_unread();
  // `rows` rows of a sequence under `params`: row j draws draw number step + j (step: the tokens generated
  // so far) after the first j of `drafts` (a decode verifying them; otherwise one row and no drafts). Row j's
  // penalties see `prompt`, `generated`, then those drafts; the rows share one copy of them.
  void add(const SamplingParams& params, std::uint64_t step, std::span<const std::int32_t> prompt,
           std::span<const std::int32_t> generated, std::span<const std::int32_t> drafts, std::size_t rows);
  // Row `row`'s allowed-token bitmask (kernels::SampleInputs::allowed), for a grammar to fill, once every row
  // was added. `words` is kernels::allowed_words of the logits' width, the same for every call of a step. The
  // first call gives every row a mask allowing every token; a step that never calls it has no masks.
  [[nodiscard]] std::span<std::int32_t> allowed_row(std::size_t row, std::int64_t words);
  [[nodiscard]] kernels::SampleInputs inputs() const;
  [[nodiscard]] std::size_t rows() const { return controls_.size(); }

 private:
  std::vector<kernels::SampleControls> controls_;
  std::vector<std::int32_t> history_;
  std::vector<std::int32_t> banned_;
  std::vector<kernels::LogitBias> biases_;
  std::vector<std::int32_t> allowed_;  // empty, or rows() masks
};

[[nodiscard]] bool is_stop_token(const SamplingParams& params, std::int32_t token);

// The error of a sequence whose draw failed (`token` as the backend's sample wrote it: a non-finite logit,
// kernels::non_finite_token, or kernels::kNoAllowedToken).
Status failed_draw_error(std::int32_t token);

}  // namespace capserve::runtime
