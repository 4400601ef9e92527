#pragma once
// The chat-template families CapServe renders natively, and how a tokenizer_config.json chat_template is
// mapped onto one. Detection is by markers: substrings that every template of the family contains (and that
// tell it apart from look-alike templates that render differently), so reformatting a template does not
// defeat it but a different template is never silently rendered with the wrong rules.
#include <optional>
#include <string>
#include <string_view>

namespace capserve::runtime {

enum class ChatFamily {
  chatml,       // Qwen3 (ChatML with <think> handling)
  deepseek,     // DeepSeek-V3 (<｜User｜>/<｜Assistant｜>)
  deepseek_v2,  // DeepSeek-V2-Chat / V2-Lite-Chat ("User: " / "Assistant: ")
  llama2,       // Llama-2-chat ([INST] with <<SYS>>)
  mistral,      // Mixtral-8x7B-Instruct ([INST], system prompt prefixed to the first user turn)
  tulu,         // OLMoE-Instruct (<|user|>/<|assistant|>)
};

// The name `--chat-template` takes, e.g. "chatml".
[[nodiscard]] std::string_view family_name(ChatFamily family);

// Whether the family's template emits bos_token / eos_token, which must then come from tokenizer_config.json.
[[nodiscard]] bool family_uses_bos(ChatFamily family);
[[nodiscard]] bool family_uses_eos(ChatFamily family);

// "chatml (Qwen3), deepseek (DeepSeek-V3), ...": for error messages.
[[nodiscard]] std::string supported_families();

// The family named `name`; throws LoadError listing the supported families when there is none.
[[nodiscard]] ChatFamily parse_family(std::string_view name);

// The family whose markers `chat_template` (the Jinja source) carries; nullopt when no family or more than
// one matches.
[[nodiscard]] std::optional<ChatFamily> detect_family(std::string_view chat_template);

}  // namespace capserve::runtime
