#pragma once
// Parsed chat output in OpenAI's chat shapes, as vLLM sends them: a stream chunk's `delta` and a response's
// `message` (content null when the message is only tool calls; reasoning_content beside content where the
// server splits reasoning).
#include <nlohmann/json.hpp>

#include "server/chat_output/chat_delta.h"

namespace capserve::server::chat_output {

// {"content"?, "reasoning_content"?, "tool_calls"?: [{"index", "id"?, "type"?, "function": {"name"?,
// "arguments"}}]}: only what the delta carries.
nlohmann::json delta_json(const ChatDelta& delta);

// {"role": "assistant", "content", "tool_calls"? , "reasoning_content"? (with_reasoning)}.
nlohmann::json message_json(const ChatMessageOut& message, bool with_reasoning);

}  // namespace capserve::server::chat_output
