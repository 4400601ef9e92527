#pragma once
// reasoning_content for models that think in `<think>...</think>` before they answer (vLLM's
// --reasoning-parser names):
// - deepseek_r1: the output starts inside the thinking (R1's template opens `<think>` in the prompt; an
//   opening `<think>` the model writes itself is dropped) unless the prompt closed it (V3.1's non-thinking
//   mode ends the prompt in `</think>`); everything before `</think>` is reasoning, the rest content; no
//   `</think>`: all of it is reasoning.
// - qwen3: thinking only where the output opens `<think>` or the prompt did (Qwen3-Thinking-2507's template
//   ends the prompt in `<think>\n`); otherwise all content (enable_thinking false).
// Text in, deltas out, as ToolCallParser: any split of a text gives the deltas of the whole.
#include <optional>
#include <string>
#include <string_view>

#include "server/chat_output/chat_delta.h"

namespace capserve::server::chat_output {

enum class ReasoningFormat { deepseek_r1, qwen3 };

std::string_view format_name(ReasoningFormat format);
std::optional<ReasoningFormat> reasoning_format_named(std::string_view name);
// From the template's source: R1's `<｜Assistant｜>` with `</think>` is deepseek_r1, any other `</think>`
// qwen3; nullopt: the template knows no thinking.
std::optional<ReasoningFormat> detect_reasoning_format(std::string_view template_source);
// Where a rendered prompt (its end) leaves the model: inside `<think>` (it ends in `<think>` and spaces),
// after a closed one (`</think>`: thinking off), or neither.
enum class PromptThinking { neither, opened, closed };
PromptThinking prompt_thinking(std::string_view prompt_end);

class ReasoningParser {
 public:
  ReasoningParser(ReasoningFormat format, PromptThinking prompt);

  // The reasoning goes to out.reasoning, the answer's text to `content` (for the tool-call parser).
  void feed(std::string_view text, ChatDelta& out, std::string& content);
  void finish(ChatDelta& out, std::string& content);

 private:
  enum class State { start, reasoning, content };
  void scan(bool at_end, ChatDelta& out, std::string& content);

  State state_ = State::start;
  bool starts_inside_;
  std::string buffer_;
};

}  // namespace capserve::server::chat_output
