#include "server/chat_output/chat_output_parser.h"

#include <utility>

namespace capserve::server::chat_output {

std::optional<ToolCallFormat> tool_call_format_for(std::string_view flag, std::string_view template_source) {
  if (flag == "auto") return detect_tool_call_format(template_source);
  return tool_call_format_named(flag);  // "none": nullopt
}

std::optional<ReasoningFormat> reasoning_format_for(std::string_view flag, std::string_view template_source) {
  if (flag == "auto") return detect_reasoning_format(template_source);
  return reasoning_format_named(flag);
}

ChatOutputParser::ChatOutputParser(std::optional<ReasoningParser> reasoning,
                                   std::unique_ptr<ToolCallParser> tool_calls)
    : reasoning_(std::move(reasoning)), tool_calls_(std::move(tool_calls)) {}

ChatDelta ChatOutputParser::feed(std::string_view text) {
  ChatDelta out;
  if (!reasoning_) {
    answer(text, out);
    return out;
  }
  answer_.clear();
  reasoning_->feed(text, out, answer_);
  answer(answer_, out);
  return out;
}

ChatDelta ChatOutputParser::finish() {
  ChatDelta out;
  if (reasoning_) {
    answer_.clear();
    reasoning_->finish(out, answer_);
    answer(answer_, out);
  }
  if (tool_calls_) tool_calls_->finish(out);
  return out;
}

void ChatOutputParser::answer(std::string_view text, ChatDelta& out) {
  if (tool_calls_) {
    tool_calls_->feed(text, out);
  } else {
    out.content.append(text);
  }
}

}  // namespace capserve::server::chat_output
