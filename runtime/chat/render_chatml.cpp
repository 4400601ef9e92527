// Qwen3's template (tokenizer_config.json of the Qwen3 models), for system/user/assistant messages.
#include <algorithm>

#include "runtime/chat/python_str.h"
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {
namespace {

// A user message that only carries tool output does not start a new query.
bool is_tool_response(std::string_view content) {
  return content.starts_with("<tool_response>") && content.ends_with("</tool_response>");
}

// ns.last_query_index: the last user message that is a real query, or the last message when there is none.
std::size_t last_query_index(std::span<const Turn> turns) {
  const auto it = std::find_if(turns.rbegin(), turns.rend(), [](const Turn& t) {
    return t.role == Role::user && !is_tool_response(t.content);
  });
  return it == turns.rend() ? turns.size() - 1 : static_cast<std::size_t>(turns.rend() - it - 1);
}

void append_turn(std::string_view role, std::string_view content, RenderedPrompt& out) {
  out.append("<|im_start|>").append(role).append("\n").append_content(content).append("<|im_end|>\n");
}

// Reasoning is kept only for assistant turns after the last query (the turn being continued or a tool-calling
// chain), and the final assistant turn always gets a <think> block, empty if need be. Earlier turns keep just
// their answer, the text after the last </think>.
void append_assistant(const Turn& turn, bool after_last_query, bool is_last, RenderedPrompt& out) {
  std::string_view content = turn.content;
  std::string_view reasoning;
  if (content.find("</think>") != std::string_view::npos) {
    content = lstrip_newlines(after_last(content, "</think>"));
    reasoning =
        lstrip_newlines(after_last(rstrip_newlines(before_first(turn.content, "</think>")), "<think>"));
  }
  out.append("<|im_start|>assistant\n");
  if (after_last_query && (is_last || !reasoning.empty())) {
    out.append("<think>\n").append_content(strip_newlines(reasoning)).append("\n</think>\n\n");
    out.append_content(lstrip_newlines(content));
  } else {
    out.append_content(content);
  }
  out.append("<|im_end|>\n");
}

}  // namespace

Status render_chatml(const Conversation& c, RenderedPrompt& out) {
  const std::span<const Turn> turns = c.turns;
  if (turns.front().role == Role::system) append_turn("system", turns.front().content, out);
  const std::size_t last_query = last_query_index(turns);
  for (std::size_t i = 0; i < turns.size(); ++i) {
    const Turn& t = turns[i];
    switch (t.role) {
      case Role::system:
        if (i > 0) append_turn("system", t.content, out);
        break;
      case Role::user:
        append_turn("user", t.content, out);
        break;
      case Role::assistant:
        append_assistant(t, i > last_query, i + 1 == turns.size(), out);
        break;
    }
  }
  if (c.add_generation_prompt) out.append("<|im_start|>assistant\n");
  return {};
}

}  // namespace capserve::runtime::chat
