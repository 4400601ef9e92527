#pragma once
// What a request asks of the server and whether it can ever fit: the context its admission reserves, whether
// its prompt must be prefilled whole, and the refusals of requests that would wait forever at the head of the
// queue. Pure functions of the scheduler's limits.
#include <cstdint>

#include "runtime/status.h"
#include "server/request.h"

namespace capserve::server {

struct RequestLimitsConfig {
  std::int64_t max_context = 4096;         // prompt + generated tokens
  std::int64_t max_batched_tokens = 2048;  // tokens per step, all ranks together
  std::int64_t kv_blocks_per_rank = 1024;
  std::int64_t kv_block_size = 16;
  std::int64_t whole_prefill_above = 0;  // prompts longer than this are prefilled in one step (0: none)
};

class RequestLimits {
 public:
  explicit RequestLimits(RequestLimitsConfig config) : config_(config) {}

  // The tokens its admission reserves KV blocks for: prompt + max tokens, within the context.
  [[nodiscard]] std::int64_t context_tokens(const Request& request) const;
  // Its prompt is prefilled in one step (a dynamic-rope model past its max_position_embeddings).
  [[nodiscard]] bool prefilled_whole(const Request& request) const;
  // OK when the request fits an idle server, else INVALID_ARGUMENT naming the limit it exceeds: prompt + max
  // tokens needing more KV blocks than a rank has (field max_tokens), or a prompt that must be prefilled
  // whole longer than a step's tokens (field prompt). (Any other prompt longer than a step's token budget
  // fits: it is prefilled in chunks.)
  [[nodiscard]] runtime::Status check_fits(const Request& request) const;
  // OK when a prompt of `tokens` tokens can be prefilled, else INVALID_ARGUMENT whose message starts
  // "N tokens exceed ..." (the caller names the field that holds the prompt).
  [[nodiscard]] runtime::Status check_prompt_length(std::int64_t tokens) const;

 private:
  RequestLimitsConfig config_;
};

}  // namespace capserve::server
