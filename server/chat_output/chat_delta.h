#pragma once
// What a chat choice's output parsers make of the model's text: content, reasoning_content and tool calls, as
// the deltas OpenAI's (and vLLM's) chat stream sends, and the whole message they add up to.
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace capserve::server::chat_output {

// One step of one tool call. The first delta of a call carries its id and function name; each later one a
// fragment of its arguments (JSON text). The fragments of a call, in order, make its arguments.
struct ToolCallDelta {
  std::size_t index = 0;  // the call's position in the message's tool_calls
  std::string id;         // first delta only
  std::string name;       // first delta only
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;

  [[nodiscard]] bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  // `more` after this: what both deltas say, in order.
  void append(ChatDelta&& more) {
    reasoning += more.reasoning;
    content += more.content;
    for (ToolCallDelta& call : more.tool_calls) tool_calls.push_back(std::move(call));
  }
};

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;

  bool operator==(const ToolCall&) const = default;
};

// The whole message: every delta of a choice added up.
struct ChatMessageOut {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;

  void add(const ChatDelta& delta) {
    reasoning += delta.reasoning;
    content += delta.content;
    for (const ToolCallDelta& d : delta.tool_calls) {
      if (d.index >= tool_calls.size()) tool_calls.resize(d.index + 1);
      ToolCall& call = tool_calls[d.index];
      call.id += d.id;
      call.name += d.name;
      call.arguments += d.arguments;
    }
  }
  bool operator==(const ChatMessageOut&) const = default;
};

}  // namespace capserve::server::chat_output
