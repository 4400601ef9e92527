#include "runtime/chat/chat_template.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "runtime/chat/jinja_json.h"
#include "runtime/chat/python_str.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

// The special tokens transformers passes to the template (its special_tokens_map's named ones).
constexpr const char* kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                          "pad_token", "cls_token", "mask_token"};

// The variables apply_chat_template sets itself, which template kwargs may not name.
constexpr const char* kReservedVariables[] = {"messages", "tools", "documents", "add_generation_prompt"};

[[noreturn]] void fail(std::string_view origin, const std::string& what) {
  throw LoadError(std::string(origin) + ": " + what);
}

// A special token: a plain string, an AddedToken object {"content": ...}, or null / absent.
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
std::optional<std::string> config_chat_template(const nlohmann::json& config, std::string_view origin) {
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

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError("cannot open " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// transformers' continue_final_message: the prompt ends where the last message's content does, at the last
// occurrence of its stripped text, with the trailing whitespace only where the template kept the content
// whole.
Status cut_after_final_message(const ChatMessage& final_message, RenderedPrompt& prompt) {
  if (!final_message.content)
    return Status::invalid_argument("continue_final_message: the final message has no text content");
  const std::string_view content = *final_message.content;
  const std::string_view stripped = chat::py_strip(content);
  const std::size_t at = prompt.text.rfind(stripped);
  if (at == std::string::npos)
    return Status::invalid_argument(
        "continue_final_message: the final message's content does not appear in the rendered prompt");
  const std::size_t kept = chat::py_lstrip(content).size();
  const std::size_t end =
      std::string_view(prompt.text).substr(at, kept) == content ? at + kept : at + stripped.size();
  prompt.text.resize(end);
  std::erase_if(prompt.content, [end](const TextRange& r) { return r.begin >= end; });
  for (TextRange& r : prompt.content) r.end = std::min(r.end, end);
  return {};
}

}  // namespace

std::optional<std::string> message_from_json(const nlohmann::ordered_json& json, ChatMessage& out) {
  out = {};
  if (!json.is_object()) return ": must be an object";
  const auto role = json.find("role");
  if (role == json.end() || !role->is_string()) return ".role: required, a string";
  out.role = role->get<std::string>();
  if (out.role == "developer") out.role = "system";
  for (const auto& [key, value] : json.items()) {
    if (key == "role") continue;
    if (key != "content" || value.is_null()) {
      out.fields[key] = value;
    } else if (value.is_string()) {
      out.content = value.get<std::string>();
    } else if (value.is_array()) {
      // vLLM's string content format: the text parts, one per line.
      std::string text;
      for (const nlohmann::ordered_json& part : value) {
        const auto part_text = part.is_object() ? part.find("text") : part.end();
        if (!part.is_object() || part.value("type", "") != "text" || part_text == part.end() ||
            !part_text->is_string())
          return R"(.content: only text parts ({"type": "text", "text": ...}) are supported)";
        if (&part != &value.front()) text += '\n';
        text += part_text->get<std::string>();
      }
      out.content = std::move(text);
    } else {
      return ".content: must be a string or a list of text parts";
    }
  }
  return std::nullopt;
}

ChatTemplate::ChatTemplate(std::string_view source, jinja::Dict special_tokens, std::string origin)
    : source_(source), special_tokens_(std::move(special_tokens)), origin_(std::move(origin)) {
  try {
    template_ = std::make_shared<const jinja::Template>(source);
  } catch (const jinja::Error& e) {
    fail(origin_, std::string("chat template: ") + e.what());
  }
}

ChatTemplate ChatTemplate::load(const std::filesystem::path& tokenizer_config,
                                const std::optional<std::filesystem::path>& override_file) {
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(read_file(tokenizer_config));
  } catch (const nlohmann::json::parse_error& e) {
    fail(tokenizer_config.string(), std::string("invalid JSON: ") + e.what());
  }
  if (override_file) return from_tokenizer_config(config, read_file(*override_file), override_file->string());
  const std::filesystem::path beside = tokenizer_config.parent_path() / "chat_template.jinja";
  if (std::filesystem::exists(beside))
    return from_tokenizer_config(config, read_file(beside), beside.string());
  return from_tokenizer_config(config, std::nullopt, tokenizer_config.string());
}

ChatTemplate ChatTemplate::from_tokenizer_config(const nlohmann::json& config,
                                                 std::optional<std::string> source, std::string origin) {
  if (!config.is_object()) fail(origin, "must be a JSON object");
  if (!source) source = config_chat_template(config, origin);
  if (!source) fail(origin, "has no chat_template; give one with --chat-template FILE.jinja");
  jinja::Dict tokens;
  for (const char* key : kSpecialTokens) {
    if (std::optional<std::string> token = special_token(config, key, origin))
      tokens.set(key, std::move(*token));
  }
  return {*source, std::move(tokens), std::move(origin)};
}

void ChatTemplate::set_limits(const jinja::RenderOptions& limits) {
  limits_ = limits;
  limits_.stop = {};  // each render brings its own
}

Status ChatTemplate::render(std::span<const ChatMessage> messages, const ChatInputs& inputs, std::string& out,
                            std::stop_token stop) const {
  RenderedPrompt prompt;
  Status status = render(messages, inputs, prompt, std::move(stop));
  out = std::move(prompt.text);
  return status;
}

Status ChatTemplate::render(std::span<const ChatMessage> messages, const ChatInputs& inputs,
                            RenderedPrompt& out, std::stop_token stop) const {
  out = {};
  if (messages.empty()) return Status::invalid_argument("chat template: no messages to render");
  if (!inputs.kwargs.is_object())
    return Status::invalid_argument(
        "chat_template_kwargs: must be an object, got " + std::string(inputs.kwargs.type_name()),
        "chat_template_kwargs");
  if (!inputs.tools.is_null() && !inputs.tools.is_array())
    return Status::invalid_argument("tools: must be a list, got " + std::string(inputs.tools.type_name()),
                                    "tools");
  // apply_chat_template passes these itself; Python refuses a second value for them.
  for (const char* reserved : kReservedVariables) {
    if (inputs.kwargs.contains(reserved))
      return Status::invalid_argument(
          std::string("chat_template_kwargs: ") + reserved + " cannot be set as a template kwarg",
          "chat_template_kwargs");
  }
  jinja::Dict context = special_tokens_;
  for (const auto& [key, value] : inputs.kwargs.items()) context.set(key, jinja::from_json(value));
  jinja::List list;
  list.reserve(messages.size());
  for (const ChatMessage& m : messages) {
    jinja::Dict message;
    message.items.reserve(2 + m.fields.size());
    // The role is template text: templates build control tokens from it ('<|' + role + '|>'), and the
    // server passes only the roles it knows (server/request_intake.cpp).
    message.items.emplace_back("role", m.role);
    if (m.content) message.items.emplace_back("content", jinja::client_str(*m.content));
    if (m.fields.is_object()) {
      for (const auto& [key, value] : m.fields.items()) {
        if (key == "role" || (m.content && key == "content")) continue;
        message.set(key, jinja::from_json(value));
      }
    }
    list.emplace_back(std::move(message));
  }
  context.set("messages", std::move(list));
  context.set("tools", inputs.tools.is_null() ? jinja::Value(jinja::None{}) : jinja::from_json(inputs.tools));
  context.set("documents", jinja::None{});
  context.set("add_generation_prompt", inputs.add_generation_prompt);
  jinja::RenderOptions options = limits_;
  options.stop = std::move(stop);
  try {
    jinja::Str rendered = template_->render(context, options);
    out.text = std::move(rendered.text);
    out.content = std::move(rendered.client);
  } catch (const jinja::Error& e) {
    return Status::invalid_argument(std::string("chat template: ") + e.what());
  }
  if (inputs.continue_final_message) return cut_after_final_message(messages.back(), out);
  return {};
}

}  // namespace capserve::runtime
