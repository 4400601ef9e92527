#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace capserve::runtime {
namespace {

Status bad(const std::string& field, const std::string& message) {
  return Status::invalid_argument(field + ": " + message, field);
}

bool in_range(float v, float lo, float hi) {
  return std::isfinite(v) && v >= lo && v <= hi;
}

}  // namespace

Status validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0F) || !std::isfinite(p.temperature))
    return bad("temperature", "must be a finite number >= 0");
  if (p.top_k < 0) return bad("top_k", "must be >= 0 (0 disables it)");
  if (!(p.top_p > 0.0F && p.top_p <= 1.0F)) return bad("top_p", "must be in (0, 1]");
  if (!in_range(p.min_p, 0.0F, 1.0F)) return bad("min_p", "must be in [0, 1] (0 disables it)");
  if (p.max_new_tokens < 0) return bad("max_new_tokens", "must be >= 0");
  if (p.min_tokens < 0 || p.min_tokens > p.max_new_tokens)
    return bad("min_tokens", "must be in [0, max_new_tokens " + std::to_string(p.max_new_tokens) + "]");
  if (!in_range(p.presence_penalty, -kMaxPenalty, kMaxPenalty))
    return bad("presence_penalty", "must be in [-2, 2]");
  if (!in_range(p.frequency_penalty, -kMaxPenalty, kMaxPenalty))
    return bad("frequency_penalty", "must be in [-2, 2]");
  if (!(p.repetition_penalty > 0.0F) || !std::isfinite(p.repetition_penalty))
    return bad("repetition_penalty", "must be a finite number > 0 (1 disables it)");
  for (std::size_t i = 0; i < p.logit_bias.size(); ++i) {
    const kernels::LogitBias& b = p.logit_bias[i];
    if (b.token < 0) return bad("logit_bias", "token id " + std::to_string(b.token) + " is negative");
    if (!in_range(b.bias, -kMaxLogitBias, kMaxLogitBias))
      return bad("logit_bias", "the bias of token " + std::to_string(b.token) + " must be in [-100, 100]");
    for (std::size_t j = 0; j < i; ++j) {
      if (p.logit_bias[j].token == b.token)
        return bad("logit_bias", "token " + std::to_string(b.token) + " appears twice");
    }
  }
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs)
    return bad("top_logprobs", "must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
  if (p.top_logprobs > 0 && !p.logprobs && !p.prompt_logprobs)
    return bad("top_logprobs", "needs logprobs or prompt_logprobs");
  return Status();
}

kernels::SampleControls sample_controls(const SamplingParams& params, std::uint64_t step) {
  return {.temperature = params.temperature,
          .top_k = params.top_k,
          .top_p = params.top_p,
          .seed = params.seed,
          .step = step,
          .min_p = params.min_p,
          .presence_penalty = params.presence_penalty,
          .frequency_penalty = params.frequency_penalty,
          .repetition_penalty = params.repetition_penalty,
          .banned = {},
          .bias = {},
          .history = {},
          .prompt_tokens = 0};
}

void SampleBatch::clear() {
  controls_.clear();
  history_.clear();
  banned_.clear();
  biases_.clear();
  allowed_.clear();
}

void SampleBatch::add_unread() {
  controls_.emplace_back();
}

void SampleBatch::add(const SamplingParams& params, std::uint64_t step, std::span<const std::int32_t> prompt,
                      std::span<const std::int32_t> generated, std::span<const std::int32_t> drafts,
                      std::size_t rows) {
  if (rows == 0) return;
  const auto size = [](const auto& v) { return static_cast<std::int64_t>(v.size()); };
  const kernels::IndexRange banned{size(banned_), size(banned_) + size(params.stop_token_ids)};
  if (static_cast<std::int64_t>(step) < params.min_tokens)
    banned_.insert(banned_.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  const kernels::IndexRange bias{size(biases_), size(biases_) + size(params.logit_bias)};
  biases_.insert(biases_.end(), params.logit_bias.begin(), params.logit_bias.end());
  const std::int64_t history = size(history_);
  if (params.penalized()) {
    history_.insert(history_.end(), prompt.begin(), prompt.end());
    history_.insert(history_.end(), generated.begin(), generated.end());
    history_.insert(history_.end(), drafts.begin(), drafts.begin() + static_cast<std::ptrdiff_t>(rows - 1));
  }
  for (std::size_t j = 0; j < rows; ++j) {
    kernels::SampleControls& c = controls_.emplace_back(sample_controls(params, step + j));
    if (static_cast<std::int64_t>(step + j) < params.min_tokens) c.banned = banned;
    c.bias = bias;
    if (params.penalized()) {
      c.history = {history, history + size(prompt) + size(generated) + static_cast<std::int64_t>(j)};
      c.prompt_tokens = size(prompt);
    }
  }
}

std::span<std::int32_t> SampleBatch::allowed_row(std::size_t row, std::int64_t words) {
  const auto width = static_cast<std::size_t>(words);
  // Every bit set: a row nobody constrains allows every id.
  if (allowed_.empty()) allowed_.assign(controls_.size() * width, -1);
  return std::span<std::int32_t>(allowed_).subspan(row * width, width);
}

kernels::SampleInputs SampleBatch::inputs() const {
  return {
      .controls = controls_, .history = history_, .banned = banned_, .biases = biases_, .allowed = allowed_};
}

bool is_stop_token(const SamplingParams& params, std::int32_t token) {
  return std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) !=
         params.stop_token_ids.end();
}

Status failed_draw_error(std::int32_t token) {
  if (token == kernels::kNoAllowedToken)
    return Status::invalid_argument(
        "the request's sampling controls (allowed tokens, min_tokens, logit_bias) rule out every token");
  return Status::internal("the model's logits are not finite (at token id " +
                          std::to_string(kernels::first_non_finite_id(token)) +
                          "); there is no distribution to sample from");
}

}  // namespace capserve::runtime
