// Llama-2-chat's template (tokenizer_config.json of meta-llama/Llama-2-7b-chat-hf). It has no generation
// prompt: a prompt ending in " [/INST]" is where the assistant answers.
#include "runtime/chat/python_str.h"
#include "runtime/chat/renderers.h"

namespace capserve::runtime::chat {

Status render_llama2(const Conversation& c, RenderedPrompt& out) {
  const bool has_system = c.turns.front().role == Role::system;
  const std::size_t offset = has_system ? 1 : 0;
  const std::span<const Turn> loop = c.turns.subspan(offset);
  for (std::size_t j = 0; j < loop.size(); ++j) {
    const Turn& t = loop[j];
    // Parity only: a system message in an assistant slot passes this check and is then dropped below.
    if ((t.role == Role::user) != (j % 2 == 0)) {
      return rejected(j + offset, "Conversation roles must alternate user/assistant/user/assistant/...");
    }
    std::string content;
    if (j == 0 && has_system) {
      content.append("<<SYS>>\n").append(c.turns.front().content).append("\n<</SYS>>\n\n");
    }
    // strip() applies to the whole text, <<SYS>> block included: an empty first user message also loses the
    // blank line after <</SYS>>.
    content.append(t.content);
    // All of it counts as content: <<SYS>> is plain text to the Llama-2 tokenizer, not a special token.
    if (t.role == Role::user) {
      out.append(c.bos_token).append("[INST] ").append_content(py_strip(content)).append(" [/INST]");
    } else if (t.role == Role::assistant) {
      out.append(" ").append_content(py_strip(content)).append(" ").append(c.eos_token);
    }
  }
  return {};
}

}  // namespace capserve::runtime::chat
