#pragma once
// A checkpoint's own chat template. A ChatTemplate renders a conversation into the prompt text the model was
// trained on by running the checkpoint's Jinja chat_template (runtime/chat/jinja_template.h) exactly as
// transformers' apply_chat_template does, with the checkpoint's special tokens. A conversation the template
// rejects (its raise_exception, or any error) fails with the template's message and line.
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/jinja_template.h"
#include "runtime/status.h"
#include "runtime/text_range.h"

namespace capserve::runtime {

// One message as the template sees it: a dict of role, content (when it is text) and the message's other
// keys in the order the client sent them (tool_calls with their arguments as given, tool_call_id, name, a
// null or absent content, ...), as transformers' apply_chat_template passes a message dict.
struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool", or any role the template knows
  std::optional<std::string> content;  // nullopt: no "content" key unless `fields` holds one (e.g. null)
  // Further keys (an object); a "role", or a "content" beside text content, is not passed on.
  nlohmann::ordered_json fields = nlohmann::ordered_json::object();
};

// A message as OpenAI's chat API sends it: role, content as a string, null, absent or a list of text parts
// (joined), every other key kept as sent; "developer" is OpenAI's newer name for system. Returns what is
// wrong (".role: required, a string", ...) for a message it cannot read.
[[nodiscard]] std::optional<std::string> message_from_json(const nlohmann::ordered_json& json,
                                                           ChatMessage& out);

// What the template sees besides the messages and the special tokens, as apply_chat_template passes it.
struct ChatInputs {
  bool add_generation_prompt = true;
  // The prompt ends right after the last message's content, so the model continues that message (a
  // prefilled assistant turn), as apply_chat_template's continue_final_message.
  bool continue_final_message = false;
  // null: None; else the list of tool schemas (OpenAI function objects) as sent.
  nlohmann::ordered_json tools = nullptr;
  // Further template variables (enable_thinking, chat_template_kwargs): an object. They override the special
  // tokens; messages, tools, documents and add_generation_prompt are not theirs to set.
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
};

// A rendered prompt and which of its bytes came from the client rather than from the template: message
// content, every other message key (tool calls with their arguments, names, ids), tools and
// template kwargs. The template engine carries that mark through every operation a template applies to the
// client's strings (jinja_value.h), so the bytes are known, not searched for. The tokenizer keeps special
// tokens out of them (Tokenizer::encode's plain_text), so that a client cannot forge the template's control
// tokens.
struct RenderedPrompt {
  std::string text;
  std::vector<TextRange> content;  // the client's bytes: in order, not overlapping
};

// Immutable once built (the template is parsed once): render may be called from many threads at once.
class ChatTemplate {
 public:
  // `source` is the Jinja template; `special_tokens` the named tokens it sees (bos_token, eos_token, ...).
  // Throws LoadError naming `origin` and the line when the template does not parse.
  ChatTemplate(std::string_view source, jinja::Dict special_tokens, std::string origin);

  // The chat template of the checkpoint whose tokenizer_config.json is `tokenizer_config`: `override_file`
  // when given (--chat-template), else chat_template.jinja beside it, else the config's chat_template (a
  // string, or a list of named templates of which "default" is the chat one). Throws LoadError: unreadable
  // files, no chat template, a malformed special token, a template that does not parse.
  [[nodiscard]] static ChatTemplate load(
      const std::filesystem::path& tokenizer_config,
      const std::optional<std::filesystem::path>& override_file = std::nullopt);
  // The same from a parsed tokenizer_config.json (its chat_template, unless `source` is given); `origin`
  // names it in error messages.
  [[nodiscard]] static ChatTemplate from_tokenizer_config(const nlohmann::json& config,
                                                          std::optional<std::string> source = std::nullopt,
                                                          std::string origin = "tokenizer_config.json");

  // Replaces `out` with the rendered prompt; add_generation_prompt appends the opening of an assistant turn
  // where the template has one. invalid_argument (and no output) for an empty conversation, one the
  // template rejects, or kwargs that are not an object or name a reserved variable. A requested `stop` ends
  // the render early with an error (the client that asked for it has gone).
  Status render(std::span<const ChatMessage> messages, const ChatInputs& inputs, std::string& out,
                std::stop_token stop = {}) const;
  // The same, with the client's bytes of the prompt.
  Status render(std::span<const ChatMessage> messages, const ChatInputs& inputs, RenderedPrompt& out,
                std::stop_token stop = {}) const;

  // The bounds of every render (work steps, value and output sizes, call depth, loop iterations); the
  // defaults are jinja::RenderOptions'. A deployment whose template legitimately needs more work raises them
  // (capserve --chat-template-max-steps). Not thread-safe against concurrent renders: set before serving.
  void set_limits(const jinja::RenderOptions& limits);
  [[nodiscard]] const jinja::RenderOptions& limits() const { return limits_; }
  // The Jinja source: which tool-call and reasoning formats it teaches (server/chat_output).
  [[nodiscard]] const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const jinja::Template> template_;
  jinja::Dict special_tokens_;
  std::string origin_;
  jinja::RenderOptions limits_;
};

}  // namespace capserve::runtime
