#include "server/chat_output/openai_json.h"

namespace capserve::server::chat_output {

using json = nlohmann::json;

json delta_json(const ChatDelta& delta) {
  json out = json::object();
  if (!delta.reasoning.empty()) out["reasoning_content"] = delta.reasoning;
  if (!delta.content.empty()) out["content"] = delta.content;
  if (delta.tool_calls.empty()) return out;
  json calls = json::array();
  for (const ToolCallDelta& d : delta.tool_calls) {
    json call{{"index", d.index}};
    json function{{"arguments", d.arguments}};
    if (!d.id.empty()) {  // a call's first delta
      call["id"] = d.id;
      call["type"] = "function";
      function["name"] = d.name;
    }
    call["function"] = std::move(function);
    calls.push_back(std::move(call));
  }
  out["tool_calls"] = std::move(calls);
  return out;
}

json message_json(const ChatMessageOut& message, bool with_reasoning) {
  json out{{"role", "assistant"},
           {"content",
            message.content.empty() && !message.tool_calls.empty() ? json(nullptr) : json(message.content)}};
  if (!message.tool_calls.empty()) {
    json calls = json::array();
    for (const ToolCall& c : message.tool_calls)
      calls.push_back(
          {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    out["tool_calls"] = std::move(calls);
  }
  if (with_reasoning)
    out["reasoning_content"] = message.reasoning.empty() ? json(nullptr) : json(message.reasoning);
  return out;
}

}  // namespace capserve::server::chat_output
