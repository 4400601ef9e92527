#include "runtime/chat/chat_template.h"

#include <fstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/renderers.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

using chat::Role;
using chat::Turn;

[[noreturn]] void fail(std::string_view origin, const std::string& what) {
  throw LoadError(std::string(origin) + ": " + what);
}

// bos_token / eos_token: a plain string, an AddedToken object {"content": ...}, or null / absent.
std::optional<std::string> special_token(const nlohmann::json& config, const char* key,
                                         std::string_view origin) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  fail(origin,
       std::string(key) + " must be a string or an object with a string \"content\", got " + it->dump());
}

// chat_template is one Jinja string, or a list of {"name", "template"} of which "default" is the chat one.
std::optional<std::string> default_chat_template(const nlohmann::json& config, std::string_view origin) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const nlohmann::json& entry : *it) {
      if (!entry.is_object()) continue;
      const auto name = entry.find("name");
      const auto body = entry.find("template");
      if (name != entry.end() && *name == "default" && body != entry.end() && body->is_string()) {
        return body->get<std::string>();
      }
    }
    fail(origin, "chat_template lists no template named \"default\"");
  }
  fail(origin,
       "chat_template must be a string or a list of named templates, got " + std::string(it->type_name()));
}

ChatFamily detect(const nlohmann::json& config, std::string_view origin) {
  const std::optional<std::string> source = default_chat_template(config, origin);
  if (!source) {
    fail(origin, "has no chat_template; force one of the supported families: " + supported_families());
  }
  const std::optional<ChatFamily> family = detect_family(*source);
  if (!family) {
    fail(origin,
         "chat_template is none of the built-in chat templates; force one of the supported families: " +
             supported_families());
  }
  return *family;
}

std::string required_token(const nlohmann::json& config, const char* key, ChatFamily family, bool used,
                           std::string_view origin) {
  std::optional<std::string> token = special_token(config, key, origin);
  if (used && !token) {
    fail(origin, std::string(key) + " is missing, and the " + std::string(family_name(family)) +
                     " chat template needs it");
  }
  return token.value_or("");
}

std::optional<Role> parse_role(std::string_view role) {
  if (role == "system") return Role::system;
  if (role == "user") return Role::user;
  if (role == "assistant") return Role::assistant;
  return std::nullopt;
}

Status render_turns(ChatFamily family, const chat::Conversation& c, RenderedPrompt& out) {
  switch (family) {
    case ChatFamily::chatml:
      return chat::render_chatml(c, out);
    case ChatFamily::deepseek:
      return chat::render_deepseek(c, out);
    case ChatFamily::deepseek_v2:
      return chat::render_deepseek_v2(c, out);
    case ChatFamily::llama2:
      return chat::render_llama2(c, out);
    case ChatFamily::mistral:
      return chat::render_mistral(c, out);
    case ChatFamily::tulu:
      return chat::render_tulu(c, out);
  }
  // Not reached: the switch covers every family, but a switch over an enum is not known to be exhaustive.
  return Status::invalid_argument("unknown chat template family");
}

}  // namespace

ChatTemplate::ChatTemplate(ChatFamily family, std::string bos_token, std::string eos_token)
    : family_(family), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {}

ChatTemplate ChatTemplate::load(const std::filesystem::path& tokenizer_config,
                                std::optional<ChatFamily> forced) {
  std::ifstream in(tokenizer_config);
  if (!in) throw LoadError("cannot open " + tokenizer_config.string());
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    fail(tokenizer_config.string(), std::string("invalid JSON: ") + e.what());
  }
  return from_tokenizer_config(config, forced, tokenizer_config.string());
}

ChatTemplate ChatTemplate::from_tokenizer_config(const nlohmann::json& config,
                                                 std::optional<ChatFamily> forced, std::string_view origin) {
  if (!config.is_object()) fail(origin, "must be a JSON object");
  const ChatFamily family = forced ? *forced : detect(config, origin);
  return {family, required_token(config, "bos_token", family, family_uses_bos(family), origin),
          required_token(config, "eos_token", family, family_uses_eos(family), origin)};
}

Status ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                            std::string& out) const {
  RenderedPrompt prompt;
  Status status = render(messages, add_generation_prompt, prompt);
  out = std::move(prompt.text);
  return status;
}

Status ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                            RenderedPrompt& out) const {
  out = {};
  const std::string who = std::string(family_name(family_)) + " chat template: ";
  if (messages.empty()) return Status::invalid_argument(who + "no messages to render");
  std::vector<Turn> turns;
  turns.reserve(messages.size());
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::optional<Role> role = parse_role(messages[i].role);
    if (!role) {
      return Status::invalid_argument(who + "message " + std::to_string(i) + ": unknown role '" +
                                      messages[i].role + "'; supported roles: system, user, assistant");
    }
    turns.push_back({*role, messages[i].content});
  }
  const chat::Conversation conversation{turns, add_generation_prompt, bos_token_, eos_token_};
  if (Status s = render_turns(family_, conversation, out); !s.ok()) {
    out = {};
    return Status::invalid_argument(who + s.message());
  }
  return {};
}

}  // namespace capserve::runtime
