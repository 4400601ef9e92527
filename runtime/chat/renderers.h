#pragma once
// The per-family renderers behind ChatTemplate::render. Each one transcribes its reference Jinja template
// (tools/chat_templates/README.md) statement by statement, including its quirks, for a conversation whose
// roles are already validated and which has at least one message.
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "runtime/chat/chat_template.h"
#include "runtime/status.h"

namespace capserve::runtime::chat {

enum class Role { system, user, assistant };

struct Turn {
  Role role;
  std::string_view content;
};

struct Conversation {
  std::span<const Turn> turns;  // not empty
  bool add_generation_prompt;
  std::string_view bos_token;
  std::string_view eos_token;
};

// A conversation the template rejects: its raise_exception message, prefixed with the message index.
inline Status rejected(std::size_t message_index, std::string_view template_message) {
  return Status::invalid_argument("message " + std::to_string(message_index) + ": " +
                                  std::string(template_message));
}

// Each appends the rendering to `out`: message content (or text made of it) through append_content, the
// template's own text through append.
Status render_chatml(const Conversation& c, RenderedPrompt& out);
Status render_deepseek(const Conversation& c, RenderedPrompt& out);
Status render_deepseek_v2(const Conversation& c, RenderedPrompt& out);
Status render_llama2(const Conversation& c, RenderedPrompt& out);
Status render_mistral(const Conversation& c, RenderedPrompt& out);
Status render_tulu(const Conversation& c, RenderedPrompt& out);

}  // namespace capserve::runtime::chat
