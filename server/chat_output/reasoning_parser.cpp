#include "server/chat_output/reasoning_parser.h"

#include "server/chat_output/tool_call_parser.h"

namespace capserve::server::chat_output {
namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";
constexpr std::size_t npos = std::string_view::npos;

}  // namespace

std::string_view format_name(ReasoningFormat format) {
  return format == ReasoningFormat::deepseek_r1 ? "deepseek_r1" : "qwen3";
}

std::optional<ReasoningFormat> reasoning_format_named(std::string_view name) {
  if (name == "deepseek_r1") return ReasoningFormat::deepseek_r1;
  if (name == "qwen3") return ReasoningFormat::qwen3;
  return std::nullopt;
}

std::optional<ReasoningFormat> detect_reasoning_format(std::string_view source) {
  if (source.find(kClose) == npos) return std::nullopt;
  if (source.find("<｜Assistant｜>") != npos) return ReasoningFormat::deepseek_r1;
  return ReasoningFormat::qwen3;
}

PromptThinking prompt_thinking(std::string_view prompt) {
  while (!prompt.empty() && (prompt.back() == '\n' || prompt.back() == ' ')) prompt.remove_suffix(1);
  if (prompt.ends_with(kOpen)) return PromptThinking::opened;
  if (prompt.ends_with(kClose)) return PromptThinking::closed;
  return PromptThinking::neither;
}

ReasoningParser::ReasoningParser(ReasoningFormat format, PromptThinking prompt)
    : starts_inside_(prompt == PromptThinking::opened ||
                     (format == ReasoningFormat::deepseek_r1 && prompt == PromptThinking::neither)) {}

void ReasoningParser::feed(std::string_view text, ChatDelta& out, std::string& content) {
  buffer_.append(text);
  scan(false, out, content);
}

void ReasoningParser::finish(ChatDelta& out, std::string& content) {
  scan(true, out, content);
}

void ReasoningParser::scan(bool at_end, ChatDelta& out, std::string& content) {
  if (state_ == State::start) {
    if (!at_end && buffer_.size() < kOpen.size() && kOpen.starts_with(buffer_)) return;
    const bool opens = buffer_.starts_with(kOpen);
    if (opens) buffer_.erase(0, kOpen.size());
    state_ = opens || starts_inside_ ? State::reasoning : State::content;
  }
  if (state_ == State::reasoning) {
    const std::size_t close = buffer_.find(kClose);
    if (close == npos) {
      const std::size_t take = buffer_.size() - (at_end ? 0 : partial_marker(buffer_, kClose));
      out.reasoning.append(buffer_, 0, take);
      buffer_.erase(0, take);
      return;
    }
    out.reasoning.append(buffer_, 0, close);
    buffer_.erase(0, close + kClose.size());
    state_ = State::content;
  }
  content.append(buffer_);
  buffer_.clear();
}

}  // namespace capserve::server::chat_output
