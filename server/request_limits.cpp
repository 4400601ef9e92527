#include "server/request_limits.h"

#include <algorithm>
#include <string>

#include "runtime/kv_block_manager.h"

namespace capserve::server {

std::int64_t RequestLimits::context_tokens(const Request& request) const {
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  return std::min(config_.max_context, prompt + request.params().max_new_tokens);
}

bool RequestLimits::prefilled_whole(const Request& request) const {
  return config_.whole_prefill_above > 0 &&
         static_cast<std::int64_t>(request.prompt().size()) > config_.whole_prefill_above;
}

runtime::Status RequestLimits::check_prompt_length(std::int64_t tokens) const {
  if (config_.whole_prefill_above <= 0 || tokens <= config_.whole_prefill_above ||
      tokens <= config_.max_batched_tokens)
    return {};
  return runtime::Status::invalid_argument(
      std::to_string(tokens) + " tokens exceed the " + std::to_string(config_.max_batched_tokens) +
      " batched tokens of a step (--max-batched-tokens); the model's dynamic rope scaling needs a prompt "
      "longer "
      "than its max_position_embeddings (" +
      std::to_string(config_.whole_prefill_above) + ") prefilled in one step");
}

runtime::Status RequestLimits::check_fits(const Request& request) const {
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  if (runtime::Status s = check_prompt_length(prompt); !s.ok())
    return runtime::Status::invalid_argument("prompt: " + s.message(), "prompt");
  const std::int64_t blocks =
      runtime::KvBlockManager::blocks_for(context_tokens(request), config_.kv_block_size);
  if (blocks <= config_.kv_blocks_per_rank) return {};
  return runtime::Status::invalid_argument(
      "prompt + sampling.max_tokens: " + std::to_string(prompt + request.params().max_new_tokens) +
          " tokens need " + std::to_string(blocks) + " KV blocks of " +
          std::to_string(config_.kv_block_size) + " tokens, more than the " +
          std::to_string(config_.kv_blocks_per_rank) +
          " blocks of a rank (--kv-blocks); lower max_tokens or shorten the prompt",
      "max_tokens");
}

}  // namespace capserve::server
