#include "runtime/chat/chat_family.h"

#include <algorithm>
#include <array>
#include <span>

#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

// Markers are matched against the Jinja source, where a newline inside a string literal is written "\n".
constexpr std::string_view kChatmlRequired[] = {"<|im_start|>", "<|im_end|>", "last_query_index",
                                                "reasoning_content", "enable_thinking"};
// Thinking-only Qwen templates (QwQ, Qwen3-*-Thinking-2507) open <think> in the generation prompt.
constexpr std::string_view kChatmlForbidden[] = {"'<|im_start|>assistant\\n<think>\\n'"};

constexpr std::string_view kDeepseekRequired[] = {"<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                                                  "ns.system_prompt"};
// DeepSeek-R1 templates drop the reasoning of earlier assistant turns.
constexpr std::string_view kDeepseekForbidden[] = {"</think>"};

// Both turn prefixes with their exact continuation (eos after assistant turns), and the generation prompt
// without a trailing space.
constexpr std::string_view kDeepseekV2Required[] = {"'User: ' + message['content'] + '\\n\\n'",
                                                    "'Assistant: ' + message['content'] + eos_token",
                                                    "{{ 'Assistant:' }}", "{{ bos_token }}"};

constexpr std::string_view kLlama2Required[] = {"[INST]", "[/INST]", "<<SYS>>", "content.strip()"};

constexpr std::string_view kMistralRequired[] = {"' [INST] '", "' [/INST]'", "system_message + '\\n\\n'"};
// Mistral v3 templates move the system prompt to the last user turn and add tool blocks.
constexpr std::string_view kMistralForbidden[] = {"<<SYS>>", "[AVAILABLE_TOOLS]",
                                                  "loop.last and system_message"};

constexpr std::string_view kTuluRequired[] = {"<|user|>", "<|assistant|>", "bos_token", "not loop.last"};
// tulu_thinker opens <think> in the generation prompt.
constexpr std::string_view kTuluForbidden[] = {"<think>"};

struct FamilyInfo {
  ChatFamily family;
  std::string_view name;
  std::string_view models;  // what the family's reference template belongs to
  bool uses_bos;
  bool uses_eos;
  std::span<const std::string_view> required;
  std::span<const std::string_view> forbidden;
};

constexpr std::array<FamilyInfo, 6> kFamilies = {{
    {ChatFamily::chatml, "chatml", "Qwen3", false, false, kChatmlRequired, kChatmlForbidden},
    {ChatFamily::deepseek, "deepseek", "DeepSeek-V3", true, false, kDeepseekRequired, kDeepseekForbidden},
    {ChatFamily::deepseek_v2, "deepseek_v2", "DeepSeek-V2-Chat", true, true, kDeepseekV2Required, {}},
    {ChatFamily::llama2, "llama2", "Llama-2-chat", true, true, kLlama2Required, {}},
    {ChatFamily::mistral, "mistral", "Mixtral-8x7B-Instruct", true, true, kMistralRequired,
     kMistralForbidden},
    {ChatFamily::tulu, "tulu", "OLMoE-Instruct", true, true, kTuluRequired, kTuluForbidden},
}};

const FamilyInfo& info(ChatFamily family) {
  return *std::find_if(kFamilies.begin(), kFamilies.end(),
                       [family](const FamilyInfo& f) { return f.family == family; });
}

bool matches(const FamilyInfo& f, std::string_view chat_template) {
  const auto present = [chat_template](std::string_view marker) {
    return chat_template.find(marker) != std::string_view::npos;
  };
  return std::all_of(f.required.begin(), f.required.end(), present) &&
         std::none_of(f.forbidden.begin(), f.forbidden.end(), present);
}

}  // namespace

std::string_view family_name(ChatFamily family) {
  return info(family).name;
}

bool family_uses_bos(ChatFamily family) {
  return info(family).uses_bos;
}

bool family_uses_eos(ChatFamily family) {
  return info(family).uses_eos;
}

std::string supported_families() {
  std::string out;
  for (const FamilyInfo& f : kFamilies) {
    if (!out.empty()) out += ", ";
    out += std::string(f.name) + " (" + std::string(f.models) + ")";
  }
  return out;
}

ChatFamily parse_family(std::string_view name) {
  const auto it = std::find_if(kFamilies.begin(), kFamilies.end(),
                               [name](const FamilyInfo& f) { return f.name == name; });
  if (it == kFamilies.end()) {
    throw LoadError("unknown chat template family '" + std::string(name) +
                    "'; supported: " + supported_families());
  }
  return it->family;
}

std::optional<ChatFamily> detect_family(std::string_view chat_template) {
  std::optional<ChatFamily> found;
  for (const FamilyInfo& f : kFamilies) {
    if (!matches(f, chat_template)) continue;
    if (found) return std::nullopt;
    found = f.family;
  }
  return found;
}

}  // namespace capserve::runtime
