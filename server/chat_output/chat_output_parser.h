#pragma once
// One chat choice's output text into reasoning_content, content and tool_calls: the reasoning parser first
// (when the server has one), then the tool-call parser on the answer (when the request offers tools), each a
// unit of its own (reasoning_parser.h, tool_call_parser.h). Streamed deltas add up to the whole message.
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "server/chat_output/chat_delta.h"
#include "server/chat_output/reasoning_parser.h"
#include "server/chat_output/tool_call_parser.h"

namespace capserve::server::chat_output {

// The server's parsers (capserve --tool-call-parser, --reasoning-parser).
struct ChatOutputFormats {
  std::optional<ToolCallFormat> tool_calls;
  std::optional<ReasoningFormat> reasoning;
};

// A flag's value (a format's name, "auto": what the chat template teaches, "none") into the format; the names
// are checked by the flag parser (kToolCallParserNames, kReasoningParserNames).
std::optional<ToolCallFormat> tool_call_format_for(std::string_view flag, std::string_view template_source);
std::optional<ReasoningFormat> reasoning_format_for(std::string_view flag, std::string_view template_source);
inline constexpr std::string_view kToolCallParserNames[] = {"auto",    "none",        "hermes",
                                                            "mistral", "llama3_json", "deepseek_v3"};
inline constexpr std::string_view kReasoningParserNames[] = {"auto", "none", "deepseek_r1", "qwen3"};

class ChatOutputParser {
 public:
  // Either may be absent: its part of the text passes through as content.
  ChatOutputParser(std::optional<ReasoningParser> reasoning, std::unique_ptr<ToolCallParser> tool_calls);

  [[nodiscard]] ChatDelta feed(std::string_view text);
  [[nodiscard]] ChatDelta finish();
  // The choice's finish_reason is "tool_calls" (ToolCallParser::ends_in_tool_calls).
  [[nodiscard]] bool ends_in_tool_calls() const { return tool_calls_ && tool_calls_->ends_in_tool_calls(); }

 private:
  void answer(std::string_view text, ChatDelta& out);

  std::optional<ReasoningParser> reasoning_;
  std::unique_ptr<ToolCallParser> tool_calls_;
  std::string answer_;  // the reasoning parser's content, reused
};

}  // namespace capserve::server::chat_output
