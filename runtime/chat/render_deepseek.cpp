// DeepSeek-V3's template (tokenizer_config.json of deepseek-ai/DeepSeek-V3), for system/user/assistant
// messages.
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {

Status render_deepseek(const Conversation& c, RenderedPrompt& out) {
  // Every system message, wherever it stands, is hoisted to the front, joined by blank lines.
  out.append(c.bos_token);
  bool first_system = true;
  for (const Turn& t : c.turns) {
    if (t.role != Role::system) continue;
    if (!first_system) out.append("\n\n");
    out.append_content(t.content);
    first_system = false;
  }
  for (const Turn& t : c.turns) {
    if (t.role == Role::user) out.append("<｜User｜>").append_content(t.content);
    // The template writes the end-of-sentence token literally rather than through eos_token.
    if (t.role == Role::assistant)
      out.append("<｜Assistant｜>").append_content(t.content).append("<｜end▁of▁sentence｜>");
  }
  if (c.add_generation_prompt) out.append("<｜Assistant｜>");
  return {};
}

}  // namespace capserve::runtime::chat
