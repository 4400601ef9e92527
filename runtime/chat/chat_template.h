#pragma once
// Built-in chat-template renderers. A ChatTemplate renders a system/user/assistant conversation into the
// prompt text the model was trained on, byte for byte what Hugging Face's Jinja chat_template renders
// (tests/fixtures/chat holds goldens rendered by Jinja2 with transformers' settings), without a Jinja
// interpreter. Conversations the real template rejects with raise_exception are rejected here too, with the
// template's message and the index of the offending message.
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/chat/chat_family.h"
#include "runtime/status.h"
#include "runtime/text_range.h"

namespace capserve::runtime {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// A rendered prompt and which of its bytes are message content rather than template markup: the tokenizer
// keeps special tokens out of the content (Tokenizer::encode's plain_text), so that a message cannot forge
// the template's control tokens.
struct RenderedPrompt {
  std::string text;
  std::vector<TextRange> content;  // in order, not overlapping

  RenderedPrompt& append(std::string_view markup) {
    text.append(markup);
    return *this;
  }
  RenderedPrompt& append_content(std::string_view message_text) {
    if (!message_text.empty()) content.push_back({text.size(), text.size() + message_text.size()});
    text.append(message_text);
    return *this;
  }
};

// Immutable once built: render may be called from many threads at once.
class ChatTemplate {
 public:
  // The tokens are the literal bos_token / eos_token strings; unused ones may be empty.
  ChatTemplate(ChatFamily family, std::string bos_token, std::string eos_token);

  // Reads tokenizer_config.json and detects the family from its chat_template, unless `forced` names it.
  // Throws LoadError: unreadable file, no or unrecognised chat_template (listing the supported families), or
  // a bos_token/eos_token the family needs that is missing or malformed.
  [[nodiscard]] static ChatTemplate load(const std::filesystem::path& tokenizer_config,
                                         std::optional<ChatFamily> forced = std::nullopt);
  // The same from a parsed tokenizer_config.json; `origin` names it in error messages.
  [[nodiscard]] static ChatTemplate from_tokenizer_config(const nlohmann::json& config,
                                                          std::optional<ChatFamily> forced = std::nullopt,
                                                          std::string_view origin = "tokenizer_config.json");

  [[nodiscard]] ChatFamily family() const { return family_; }

  // Replaces `out` with the rendered prompt; add_generation_prompt appends the opening of an assistant turn
  // where the template has one. invalid_argument for an empty conversation, an unknown role or a conversation
  // the template rejects, naming the message index.
  Status render(std::span<const ChatMessage> messages, bool add_generation_prompt, std::string& out) const;
  // The same, with the content ranges.
  Status render(std::span<const ChatMessage> messages, bool add_generation_prompt, RenderedPrompt& out) const;

 private:
  ChatFamily family_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace capserve::runtime
