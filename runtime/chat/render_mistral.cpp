// Mixtral-8x7B-Instruct's template (tokenizer_config.json of mistralai/Mixtral-8x7B-Instruct-v0.1). It has no
// generation prompt: a prompt ending in " [/INST]" is where the assistant answers.
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {

Status render_mistral(const Conversation& c, RenderedPrompt& out) {
  const bool has_system = c.turns.front().role == Role::system;
  const std::size_t offset = has_system ? 1 : 0;
  const std::span<const Turn> loop = c.turns.subspan(offset);
  out.append(c.bos_token);
  for (std::size_t j = 0; j < loop.size(); ++j) {
    const Turn& t = loop[j];
    if ((t.role == Role::user) != (j % 2 == 0)) {
      return rejected(j + offset,
                      "After the optional system message, conversation roles must alternate "
                      "user/assistant/user/assistant/...");
    }
    switch (t.role) {
      case Role::user:
        out.append(" [INST] ");
        if (j == 0 && has_system) out.append_content(c.turns.front().content).append("\n\n");
        out.append_content(t.content).append(" [/INST]");
        break;
      case Role::assistant:
        out.append(" ").append_content(t.content).append(c.eos_token);
        break;
      case Role::system:
        return rejected(
            j + offset,
            "Only user and assistant roles are supported, with the exception of an initial optional "
            "system message!");
    }
  }
  return {};
}

}  // namespace capserve::runtime::chat
