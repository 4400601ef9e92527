// The Tulu template as OLMoE-Instruct ships it (tokenizer_config.json of allenai/OLMoE-1B-7B-0924-Instruct):
// open-instruct's "tulu" template with bos_token in front.
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {

Status render_tulu(const Conversation& c, RenderedPrompt& out) {
  out.append(c.bos_token);
  for (std::size_t i = 0; i < c.turns.size(); ++i) {
    const Turn& t = c.turns[i];
    const bool last = i + 1 == c.turns.size();
    switch (t.role) {
      case Role::system:
        out.append("<|system|>\n").append_content(t.content).append("\n");
        break;
      case Role::user:
        out.append("<|user|>\n").append_content(t.content).append("\n");
        break;
      case Role::assistant:
        // A final assistant turn ends at eos_token, without the newline that separates turns.
        out.append("<|assistant|>\n").append_content(t.content).append(c.eos_token);
        if (!last) out.append("\n");
        break;
    }
    if (last && c.add_generation_prompt) out.append("<|assistant|>\n");
  }
  return {};
}

}  // namespace capserve::runtime::chat
