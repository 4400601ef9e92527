// DeepSeek-V2-Chat's template (tokenizer_config.json of deepseek-ai/DeepSeek-V2-Chat and V2-Lite-Chat, the
// same as deepseek-llm-7b-chat's): plain-text "User: " / "Assistant: " turns.
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {

Status render_deepseek_v2(const Conversation& c, RenderedPrompt& out) {
  out.append(c.bos_token);
  for (const Turn& t : c.turns) {
    switch (t.role) {
      case Role::user:
        out.append("User: ").append_content(t.content).append("\n\n");
        break;
      case Role::assistant:
        out.append("Assistant: ").append_content(t.content).append(c.eos_token);
        break;
      case Role::system:
        // Rendered where it stands, not hoisted.
        out.append_content(t.content).append("\n\n");
        break;
    }
  }
  // No space after the colon: the model writes it as part of its first token.
  if (c.add_generation_prompt) out.append("Assistant:");
  return {};
}

}  // namespace capserve::runtime::chat
