#pragma once
// Token log-probabilities on their way from the ranks to the client: what each rank reports per step
// (LogprobRecord, plain values that travel in the StepResult byte string) and what a request's events carry
// (LogprobEntries: flat arrays aligned with the event's tokens, a few buffers per event rather than one
// allocation per token).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace capserve::server {

// One alternative: a token and its log-probability at that position.
struct TopLogprob {
  std::int32_t token = 0;
  float logprob = 0.0F;
};

// One scored token of a sequence in a step: a prompt token given its prefix (prompt, at the prefill of a
// request with prompt_logprobs) or the sampled token; its `top_count` alternatives follow, in order, in the
// StepResult's `top` list.
struct LogprobRecord {
  std::uint64_t id = 0;
  std::int32_t token = 0;
  float logprob = 0.0F;
  std::int32_t top_count = 0;
  std::uint8_t prompt = 0;
};

// Entries of consecutive tokens of one request, each with the same number of alternatives (the request's
// top_logprobs): tokens[i] scored logprobs[i], its alternatives are top[i * per_token, (i + 1) * per_token).
struct LogprobEntries {
  std::vector<std::int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<TopLogprob> top;

  [[nodiscard]] std::size_t size() const { return tokens.size(); }
  [[nodiscard]] bool empty() const { return tokens.empty(); }
  void append(std::int32_t token, float logprob, std::span<const TopLogprob> alternatives) {
    tokens.push_back(token);
    logprobs.push_back(logprob);
    top.insert(top.end(), alternatives.begin(), alternatives.end());
  }
  // Moves the first n entries to the end of `out`.
  void move_front(std::size_t n, LogprobEntries& out) {
    const std::size_t per = tokens.empty() ? 0 : top.size() / tokens.size();
    const auto cut = static_cast<std::ptrdiff_t>(n);
    const auto top_cut = static_cast<std::ptrdiff_t>(n * per);
    out.tokens.insert(out.tokens.end(), tokens.begin(), tokens.begin() + cut);
    out.logprobs.insert(out.logprobs.end(), logprobs.begin(), logprobs.begin() + cut);
    out.top.insert(out.top.end(), top.begin(), top.begin() + top_cut);
    tokens.erase(tokens.begin(), tokens.begin() + cut);
    logprobs.erase(logprobs.begin(), logprobs.begin() + cut);
    top.erase(top.begin(), top.begin() + top_cut);
  }
  // Entry i's alternatives.
  [[nodiscard]] std::span<const TopLogprob> alternatives(std::size_t i) const {
    const std::size_t per = tokens.empty() ? 0 : top.size() / tokens.size();
    return std::span(top).subspan(i * per, per);
  }
};

}  // namespace capserve::server
