#include "server/http/openai_request.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <initializer_list>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/client_json.h"
#include "server/request_intake.h"

namespace capserve::server::http {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using runtime::Status;
using runtime::StatusOr;

Status bad(std::string message, std::string field) {
  return Status::invalid_argument(std::move(message), std::move(field));
}

bool present(const json& body, const char* name) {
  const auto it = body.find(name);
  return it != body.end() && !it->is_null();
}

// Field readers: absent or null is nullopt; a value of another type is an error naming the field.
StatusOr<std::optional<double>> number_field(const json& body, const char* name) {
  if (!present(body, name)) return std::optional<double>();
  const json& v = body[name];
  if (!v.is_number()) return bad(std::string(name) + ": must be a number", name);
  return std::optional(v.get<double>());
}

StatusOr<std::optional<std::int64_t>> int_field(const json& body, const char* name) {
  if (!present(body, name)) return std::optional<std::int64_t>();
  const json& v = body[name];
  if (!v.is_number_integer()) return bad(std::string(name) + ": must be an integer", name);
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
    return bad(std::string(name) + ": out of range", name);
  return std::optional(v.get<std::int64_t>());
}

StatusOr<std::optional<bool>> bool_field(const json& body, const char* name) {
  if (!present(body, name)) return std::optional<bool>();
  const json& v = body[name];
  if (!v.is_boolean()) return bad(std::string(name) + ": must be true or false", name);
  return std::optional(v.get<bool>());
}

// The top-level fields each endpoint accepts: those this file reads, and kNoOpFields. Anything else is
// refused naming it, so that no field the server does not act on is silently ignored. server/README.md lists
// the same.
constexpr std::string_view kBothEndpoints[] = {"model",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "max_tokens",
                                               "seed",
                                               "ignore_eos",
                                               "stop",
                                               "n",
                                               "presence_penalty",
                                               "frequency_penalty",
                                               "repetition_penalty",
                                               "min_p",
                                               "min_tokens",
                                               "logit_bias",
                                               "stop_token_ids",
                                               "logprobs",
                                               "top_logprobs",
                                               "echo",
                                               "stream",
                                               "stream_options",
                                               "response_format",
                                               "structured_outputs",
                                               "capacity_class",
                                               "skip_special_tokens"};
constexpr std::string_view kChatOnly[] = {"messages",
                                          "max_completion_tokens",
                                          "tools",
                                          "tool_choice",
                                          "parallel_tool_calls",
                                          "chat_template_kwargs",
                                          "add_generation_prompt",
                                          "continue_final_message"};
constexpr std::string_view kCompletionsOnly[] = {"prompt"};
// Accepted and without effect by their nature: they serve OpenAI's own platform (end-user ids for abuse
// monitoring, stored completions and their tags, service tiers, prompt-cache routing hints); this server
// has no such services, and its prefix cache needs no hint.
constexpr std::string_view kNoOpFields[] = {"user",
                                            "metadata",
                                            "store",
                                            "service_tier",
                                            "safety_identifier",
                                            "prompt_cache_key",
                                            "prompt_cache_retention"};
using Names = std::span<const std::string_view>;

bool listed(Names names, std::string_view name) {
  return std::ranges::find(names, name) != names.end();
}

// The first field of `body` on none of `accepted`, as an error naming it.
Status refuse_unlisted(const json& body, std::initializer_list<Names> accepted, std::string_view path) {
  for (const auto& item : body.items()) {
    const std::string& name = item.key();  // not a structured binding: clang 14 cannot capture one
    if (std::ranges::any_of(accepted, [&](auto names) { return listed(names, name); })) continue;
    // The name is client text: quoted and cut in the message, and not echoed as param when long.
    constexpr std::size_t kLongest = 64;
    return bad(excerpt(name, kLongest) + ": not a field this server's " + std::string(path) +
                   " accepts (server/README.md lists them)",
               name.size() <= kLongest ? name : std::string());
  }
  return Status();
}

// The first field of `body` the endpoint does not accept, as an error naming it.
Status check_fields(const json& body, Endpoint endpoint) {
  const bool chat = endpoint == Endpoint::chat;
  if (Status refused = refuse_unlisted(
          body, {kBothEndpoints, chat ? Names(kChatOnly) : Names(kCompletionsOnly), kNoOpFields},
          chat ? "/v1/chat/completions" : "/v1/completions");
      !refused.ok())
    return refused;
  if (present(body, "stream_options") && body["stream_options"].is_object()) {
    for (const auto& [name, value] : body["stream_options"].items()) {
      if (name != "include_usage")
        return bad("stream_options." + name + ": not supported by this server (only include_usage)",
                   "stream_options");
    }
  }
  return Status();
}

// logit_bias: OpenAI's map of token ids (decimal strings) to a bias in [-100, 100].
StatusOr<std::vector<kernels::LogitBias>> read_logit_bias(const json& body) {
  std::vector<kernels::LogitBias> biases;
  if (!present(body, "logit_bias")) return biases;
  const json& map = body["logit_bias"];
  if (!map.is_object()) return bad("logit_bias: must be an object of token ids to biases", "logit_bias");
  for (const auto& [key, value] : map.items()) {
    std::int32_t id = 0;
    const char* end = key.data() + key.size();
    const auto [at, error] = std::from_chars(key.data(), end, id);
    if (key.empty() || error != std::errc() || at != end || id < 0)
      return bad("logit_bias: key \"" + key + "\" is not a token id", "logit_bias");
    if (!value.is_number())
      return bad("logit_bias: the bias of token " + key + " must be a number", "logit_bias");
    const double bias = value.get<double>();
    if (!(bias >= -100.0 && bias <= 100.0))
      return bad("logit_bias: the bias of token " + key + " must be in [-100, 100]", "logit_bias");
    biases.push_back({id, static_cast<float>(bias)});
  }
  return biases;
}

// stop_token_ids: vLLM's list of token ids that end the output (kept in it).
StatusOr<std::vector<std::int32_t>> read_stop_token_ids(const json& body) {
  std::vector<std::int32_t> ids;
  if (!present(body, "stop_token_ids")) return ids;
  const json& list = body["stop_token_ids"];
  if (!list.is_array()) return bad("stop_token_ids: must be a list of token ids", "stop_token_ids");
  for (const json& id : list) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() > INT32_MAX)
      return bad("stop_token_ids: every entry must be a token id (an integer >= 0)", "stop_token_ids");
    ids.push_back(static_cast<std::int32_t>(id.get<std::int64_t>()));
  }
  return ids;
}

// The sampling fields common to both endpoints (log-probabilities apart).
StatusOr<SamplingInput> read_sampling(const json& body, Endpoint endpoint) {
  SamplingInput s;
  const auto temperature = number_field(body, "temperature");
  if (!temperature.ok()) return temperature.status();
  s.temperature = *temperature;
  const auto top_p = number_field(body, "top_p");
  if (!top_p.ok()) return top_p.status();
  s.top_p = *top_p;
  const auto top_k = int_field(body, "top_k");
  if (!top_k.ok()) return top_k.status();
  s.top_k = *top_k == -1 ? 0 : *top_k;  // -1: vLLM's "off"
  const auto max_tokens = int_field(body, "max_tokens");
  if (!max_tokens.ok()) return max_tokens.status();
  std::int64_t limit = max_tokens->value_or(0);
  if (endpoint == Endpoint::chat) {
    const auto max_completion = int_field(body, "max_completion_tokens");
    if (!max_completion.ok()) return max_completion.status();
    if (*max_completion) limit = **max_completion;
  }
  if (*max_tokens && limit < 1)
    return bad("max_tokens: must be >= 1, got " + std::to_string(limit), "max_tokens");
  if (limit < 0 || (endpoint == Endpoint::chat && present(body, "max_completion_tokens") && limit < 1))
    return bad("max_completion_tokens: must be >= 1, got " + std::to_string(limit), "max_completion_tokens");
  s.max_tokens = limit;
  const auto seed = int_field(body, "seed");
  if (!seed.ok()) return seed.status();
  s.seed = static_cast<std::uint64_t>(seed->value_or(0));
  const auto ignore_eos = bool_field(body, "ignore_eos");
  if (!ignore_eos.ok()) return ignore_eos.status();
  s.ignore_eos = ignore_eos->value_or(false);
  for (const auto& [name, value] : {std::pair{"presence_penalty", &s.presence_penalty},
                                    std::pair{"frequency_penalty", &s.frequency_penalty},
                                    std::pair{"repetition_penalty", &s.repetition_penalty}}) {
    const auto penalty = number_field(body, name);
    if (!penalty.ok()) return penalty.status();
    if (*penalty) *value = **penalty;
  }
  const auto min_p = number_field(body, "min_p");
  if (!min_p.ok()) return min_p.status();
  s.min_p = *min_p;
  const auto min_tokens = int_field(body, "min_tokens");
  if (!min_tokens.ok()) return min_tokens.status();
  s.min_tokens = min_tokens->value_or(0);
  if (s.min_tokens < 0)
    return bad("min_tokens: must be >= 0, got " + std::to_string(s.min_tokens), "min_tokens");
  StatusOr<std::vector<kernels::LogitBias>> biases = read_logit_bias(body);
  if (!biases.ok()) return std::move(biases).take_status();
  s.logit_bias = std::move(*biases);
  StatusOr<std::vector<std::int32_t>> stop_ids = read_stop_token_ids(body);
  if (!stop_ids.ok()) return std::move(stop_ids).take_status();
  s.stop_token_ids = std::move(*stop_ids);
  if (present(body, "stop")) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      s.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array()) {
      for (const json& one : stop) {
        if (!one.is_string()) return bad("stop: must be a string or a list of strings", "stop");
        s.stop.push_back(one.get<std::string>());
      }
    } else {
      return bad("stop: must be a string or a list of strings", "stop");
    }
  }
  if (present(body, "capacity_class")) {
    if (!body["capacity_class"].is_string())
      return bad("capacity_class: must be \"standard\" or \"protected\"", "capacity_class");
    s.capacity_class = body["capacity_class"].get<std::string>();
  }
  return s;
}

struct Logprobs {
  bool logprobs = false;
  bool prompt_logprobs = false;
  std::int64_t top_logprobs = 0;
  bool echo = false;
};

// Token log-probabilities. Chat: `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs). Completions:
// `logprobs` (the number of alternatives, 0..20; present: every generated token's) and `echo` (the prompt
// comes back before the completion, with its tokens' log-probabilities when logprobs is set: what lm-eval's
// log-likelihood tasks read).
StatusOr<Logprobs> read_logprobs(const json& body, Endpoint endpoint) {
  const std::string max = std::to_string(runtime::kMaxTopLogprobs);
  Logprobs l;
  if (endpoint == Endpoint::chat) {
    const auto logprobs = bool_field(body, "logprobs");
    if (!logprobs.ok()) return logprobs.status();
    l.logprobs = logprobs->value_or(false);
    const auto top = int_field(body, "top_logprobs");
    if (!top.ok()) return top.status();
    l.top_logprobs = top->value_or(0);
    if (l.top_logprobs < 0 || l.top_logprobs > runtime::kMaxTopLogprobs)
      return bad("top_logprobs: must be in 0.." + max + ", got " + std::to_string(l.top_logprobs),
                 "top_logprobs");
    if (*top && !l.logprobs) return bad("top_logprobs: needs logprobs set to true", "top_logprobs");
    if (present(body, "echo")) return bad("echo: only /v1/completions echoes the prompt", "echo");
    return l;
  }
  const auto echo = bool_field(body, "echo");
  if (!echo.ok()) return echo.status();
  l.echo = echo->value_or(false);
  if (present(body, "top_logprobs"))
    return bad("top_logprobs: /v1/completions takes the number of alternatives in logprobs", "top_logprobs");
  if (!present(body, "logprobs")) return l;
  if (body["logprobs"].is_boolean())
    return bad("logprobs: /v1/completions takes the number of alternatives (0.." + max + ")", "logprobs");
  const auto top = int_field(body, "logprobs");
  if (!top.ok()) return top.status();
  l.top_logprobs = **top;
  if (l.top_logprobs < 0 || l.top_logprobs > runtime::kMaxTopLogprobs)
    return bad("logprobs: must be in 0.." + max + ", got " + std::to_string(l.top_logprobs), "logprobs");
  l.logprobs = true;
  l.prompt_logprobs = l.echo;
  return l;
}

// Chat messages (runtime::message_from_json), in the client's key order (`body` is parsed keeping it);
// request_intake checks the keys the API defines.
StatusOr<std::vector<runtime::ChatMessage>> read_messages(const ordered_json& body) {
  const auto it = body.find("messages");
  if (it == body.end() || !it->is_array()) return bad("messages: required, a list of messages", "messages");
  std::vector<runtime::ChatMessage> messages;
  for (std::size_t i = 0; i < it->size(); ++i) {
    runtime::ChatMessage message;
    if (std::optional<std::string> error = runtime::message_from_json((*it)[i], message))
      return bad("messages[" + std::to_string(i) + "]" + *error, "messages");
    messages.push_back(std::move(message));
  }
  return messages;
}

// JSON output's whitespace: ", " and ": " only by default, as vLLM's disable_any_whitespace (small models
// left free write newlines for ever); structured_outputs.disable_any_whitespace false allows any.
constexpr const char* kCompactWhitespace = "compact";

// A tool's "function" object with a string "name", or null. The tools' shapes are the intake's check (a 400
// naming tools); before it, a malformed tool is skipped.
const ordered_json* tool_function(const ordered_json& tool) {
  if (!tool.is_object()) return nullptr;
  const auto it = tool.find("function");
  return it != tool.end() && it->is_object() && it->contains("name") && (*it)["name"].is_string() ? &*it
                                                                                                  : nullptr;
}

// The output constraint of a forced tool choice, as vLLM builds it: a named function's output is its
// `parameters` (any JSON object when it has none); "required"'s is a list of calls {"name", "parameters"},
// one at least (at most one with parallel_tool_calls false), each of an offered tool. A schema the grammar
// engine cannot compile is the intake's 400, naming tool_choice.
ConstraintInput forced_tool_constraint(const ordered_json& tools, const chat_output::ForcedToolChoice& choice,
                                       bool parallel) {
  const auto parameters = [](const ordered_json& function) {
    const auto it = function.find("parameters");
    return it != function.end() && it->is_object() ? *it : ordered_json{{"type", "object"}};
  };
  ordered_json schema;
  if (!choice.name.empty()) {
    for (const ordered_json& tool : tools) {
      const ordered_json* function = tool_function(tool);
      if (function != nullptr && (*function)["name"] == choice.name) schema = parameters(*function);
    }
  } else {
    ordered_json calls = ordered_json::array();
    for (const ordered_json& tool : tools) {
      const ordered_json* function = tool_function(tool);
      if (function == nullptr) continue;
      calls.push_back({{"type", "object"},
                       {"properties",
                        {{"name", {{"const", (*function)["name"]}}}, {"parameters", parameters(*function)}}},
                       {"required", {"name", "parameters"}}});
    }
    schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", std::move(calls)}}}};
    if (!parallel) schema["maxItems"] = 1;
  }
  ordered_json spec = ordered_json::object();
  spec["json_schema"] = std::move(schema);
  spec["whitespace"] = kCompactWhitespace;
  return ConstraintInput{std::move(spec), "tool_choice"};
}

// What the chat template sees besides the messages: tools, chat_template_kwargs (vLLM), add_generation_prompt
// and continue_final_message (vLLM's top-level fields); and how the output is parsed (`shape`): tool calls in
// the server's format when the request offers tools with tool_choice "auto" (the default with tools), one
// call at most with parallel_tool_calls false, reasoning where the server splits it. tool_choice "none" hides
// the tools from the template; "required" and a named function (one of the tools) constrain the output to
// the calls (forced_tool_constraint) and parse it as such.
StatusOr<runtime::ChatInputs> read_chat_inputs(const json& body, const ordered_json& ordered,
                                               const ParseOptions& options, ResponseShape& shape) {
  runtime::ChatInputs inputs;
  if (const auto it = ordered.find("tools"); it != ordered.end() && !it->is_null()) {
    if (!it->is_array()) return bad("tools: must be a list of tools", "tools");
    inputs.tools = *it;
  }
  const bool offered = inputs.tools.is_array() && !inputs.tools.empty();
  std::string choice = offered ? "auto" : "none";
  if (const auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    const bool named = it->is_object() && it->value("type", "") == "function";
    const bool mode = it->is_string() && (*it == "none" || *it == "auto" || *it == "required");
    if (!named && !mode)
      return bad("tool_choice: must be \"none\", \"auto\", \"required\" or a named function", "tool_choice");
    if (!offered && (named || *it == "required"))
      return bad("tool_choice: " + std::string(named ? "a named function" : "\"required\"") + " needs tools",
                 "tool_choice");
    if (named) {
      const auto function = it->find("function");
      if (function == it->end() || !function->is_object() || !function->contains("name") ||
          !(*function)["name"].is_string())
        return bad("tool_choice.function.name: must be a string", "tool_choice");
      std::string name = (*function)["name"].get<std::string>();
      const bool known = std::ranges::any_of(inputs.tools, [&](const ordered_json& tool) {
        const ordered_json* function = tool_function(tool);
        return function != nullptr && (*function)["name"] == name;
      });
      if (!known) return bad("tool_choice: " + excerpt(name, 64) + " is not one of the tools", "tool_choice");
      shape.forced_tool = chat_output::ForcedToolChoice{std::move(name)};
      choice = "named";
    } else {
      choice = it->get<std::string>();
    }
    if (choice == "required") shape.forced_tool = chat_output::ForcedToolChoice{};
    if (choice == "auto" && !offered) return bad("tool_choice: \"auto\" needs tools", "tool_choice");
    if (choice == "auto" && !options.formats.tool_calls)
      return bad(
          "tool_choice: \"auto\" needs a tool-call parser; the model's chat template teaches no format "
          "this server knows (start it with --tool-call-parser NAME)",
          "tool_choice");
  }
  if (choice == "none") {
    inputs.tools = nullptr;
  } else {
    shape.tool_calls = options.formats.tool_calls;
  }
  const auto parallel = bool_field(body, "parallel_tool_calls");
  if (!parallel.ok()) return parallel.status();
  shape.parallel_tool_calls = parallel->value_or(true);
  shape.reasoning = options.formats.reasoning;
  if (const auto it = ordered.find("chat_template_kwargs"); it != ordered.end() && !it->is_null()) {
    if (!it->is_object()) return bad("chat_template_kwargs: must be an object", "chat_template_kwargs");
    inputs.kwargs = *it;
  }
  const auto add = bool_field(body, "add_generation_prompt");
  if (!add.ok()) return add.status();
  if (*add) inputs.add_generation_prompt = **add;
  const auto cont = bool_field(body, "continue_final_message");
  if (!cont.ok()) return cont.status();
  if (*cont) inputs.continue_final_message = **cont;
  if (inputs.continue_final_message && inputs.add_generation_prompt)
    return bad("continue_final_message: needs add_generation_prompt false", "continue_final_message");
  return inputs;
}

// A completions prompt: a string, a list of strings, a list of token ids or a list of such lists. One prompt
// is "prompt" in errors, one of several "prompt[i]".
StatusOr<std::vector<PromptInput>> read_prompts(const json& body) {
  const Status shape =
      bad("prompt: must be a string, a list of strings, a list of token ids or a list of lists of token ids",
          "prompt");
  if (!present(body, "prompt")) return bad("prompt: required", "prompt");
  const json& prompt = body["prompt"];
  const auto ids_of = [](const json& list) -> std::optional<TokenPrompt> {
    TokenPrompt p;
    for (const json& t : list) {
      if (!t.is_number_integer()) return std::nullopt;
      const auto v = t.get<std::int64_t>();
      p.ids.push_back(v < INT32_MIN || v > INT32_MAX ? -1 : static_cast<std::int32_t>(v));
    }
    return p;
  };
  std::vector<PromptInput> prompts;
  if (prompt.is_string()) {
    prompts.push_back({TextPrompt{prompt.get<std::string>()}, "prompt"});
    return prompts;
  }
  if (!prompt.is_array() || prompt.empty()) return shape;
  if (prompt.front().is_number_integer()) {
    std::optional<TokenPrompt> ids = ids_of(prompt);
    if (!ids) return shape;
    prompts.push_back({std::move(*ids), "prompt"});
    return prompts;
  }
  for (const json& one : prompt) {
    if (one.is_string()) {
      prompts.push_back({TextPrompt{one.get<std::string>()}, {}});
    } else if (std::optional<TokenPrompt> ids = one.is_array() ? ids_of(one) : std::nullopt) {
      prompts.push_back({std::move(*ids), {}});
    } else {
      return shape;
    }
  }
  for (std::size_t i = 0; i < prompts.size(); ++i)
    prompts[i].field = prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
  return prompts;
}

// vLLM's /tokenize takes a text prompt or chat messages with the chat fields its templates read.
constexpr std::string_view kTokenizeFields[] = {"model", "add_special_tokens", "return_token_strs"};
constexpr std::string_view kTokenizeTextFields[] = {"prompt"};
constexpr std::string_view kTokenizeChatFields[] = {"messages", "tools", "chat_template_kwargs",
                                                    "add_generation_prompt", "continue_final_message"};

// response_format's JSON constraint of `kind` ("json_object", "json_schema") with compact whitespace.
std::optional<ConstraintInput> json_format(const char* kind, ordered_json value) {
  ordered_json spec = ordered_json::object();
  spec[kind] = std::move(value);
  spec["whitespace"] = kCompactWhitespace;
  return ConstraintInput{std::move(spec), "response_format"};
}

// OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object), "json_schema" (the
// schema's instances; `strict` is always so here).
StatusOr<std::optional<ConstraintInput>> read_response_format(const ordered_json& format) {
  constexpr const char* kField = "response_format";
  if (!format.is_object() || !format.contains("type") || !format["type"].is_string())
    return bad("response_format: must be an object with a type: \"text\", \"json_object\" or \"json_schema\"",
               kField);
  const std::string type = format["type"].get<std::string>();
  for (const auto& item : format.items()) {
    const std::string& key = item.key();
    if (key != "type" && !(type == "json_schema" && key == "json_schema"))
      return bad("response_format: " + excerpt(key, 64) + " is not a field of response format type " +
                     excerpt(type, 64),
                 kField);
  }
  if (type == "text") return std::optional<ConstraintInput>();
  if (type == "json_object") return json_format("json_object", true);
  if (type != "json_schema")
    return bad("response_format.type: " + excerpt(type, 64) +
                   " is not one of \"text\", \"json_object\", \"json_schema\"",
               kField);
  if (!format.contains("json_schema") || !format["json_schema"].is_object())
    return bad("response_format.json_schema: must be an object with the schema", kField);
  const ordered_json& spec = format["json_schema"];
  for (const auto& item : spec.items()) {
    const std::string& key = item.key();
    // name and description tell the model about the schema on OpenAI's side; they change nothing here.
    const bool text_field = (key == "name" || key == "description") && item.value().is_string();
    if (!text_field && key != "schema" && !(key == "strict" && item.value().is_boolean()))
      return bad("response_format.json_schema: " + excerpt(key, 64) +
                     " is not one of its fields (name, description, schema, strict)",
                 kField);
  }
  if (!spec.contains("schema") || !(spec["schema"].is_object() || spec["schema"].is_boolean()))
    return bad("response_format.json_schema.schema: must be a JSON schema (an object)", kField);
  return json_format("json_schema", spec["schema"]);
}

// vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice, grammar (xgrammar's
// EBNF), and disable_any_whitespace.
StatusOr<ConstraintInput> read_structured_outputs(const ordered_json& outputs) {
  constexpr const char* kField = "structured_outputs";
  if (!outputs.is_object()) return bad("structured_outputs: must be an object", kField);
  ordered_json spec = ordered_json::object();
  bool compact = true;
  int kinds = 0;
  for (const auto& item : outputs.items()) {
    const std::string& key = item.key();
    const ordered_json& value = item.value();
    const std::string where = "structured_outputs." + key;  // used for known keys only
    if (value.is_null()) continue;
    if (key == "disable_any_whitespace") {
      if (!value.is_boolean()) return bad(where + ": must be true or false", kField);
      compact = value.get<bool>();
      continue;
    }
    ++kinds;
    if (key == "json") {
      // A schema, or its JSON text as vLLM also takes.
      ordered_json schema = value;
      if (value.is_string()) {
        StatusOr<ordered_json> parsed = parse_client_json<ordered_json>(value.get<std::string>(), where);
        if (!parsed.ok()) return bad(parsed.status().message(), kField);
        schema = std::move(*parsed);
      }
      if (!schema.is_object() && !schema.is_boolean()) return bad(where + ": must be a JSON schema", kField);
      spec["json_schema"] = std::move(schema);
    } else if (key == "json_object") {
      if (value != true) return bad(where + ": must be true", kField);
      spec["json_object"] = true;
    } else if (key == "regex" || key == "grammar") {
      if (!value.is_string()) return bad(where + ": must be a string", kField);
      spec[key] = value;
    } else if (key == "choice") {
      if (!value.is_array() || value.empty()) return bad(where + ": must be a list of strings", kField);
      spec[key] = value;
    } else {
      return bad("structured_outputs: " + excerpt(key, 64) +
                     " is not supported (json, json_object, regex, choice, grammar, disable_any_whitespace)",
                 kField);
    }
  }
  if (kinds != 1)
    return bad("structured_outputs: needs exactly one of json, json_object, regex, choice, grammar", kField);
  if (compact && (spec.contains("json_schema") || spec.contains("json_object")))
    spec["whitespace"] = kCompactWhitespace;
  return ConstraintInput{std::move(spec), kField};
}

// The request's output constraint: response_format or structured_outputs, not both.
StatusOr<std::optional<ConstraintInput>> read_constraint(const ordered_json& body) {
  const bool format = body.contains("response_format") && !body["response_format"].is_null();
  const bool outputs = body.contains("structured_outputs") && !body["structured_outputs"].is_null();
  if (format && outputs)
    return bad("structured_outputs: cannot be combined with response_format (each constrains the output)",
               "structured_outputs");
  if (format) return read_response_format(body["response_format"]);
  if (!outputs) return std::optional<ConstraintInput>();
  StatusOr<ConstraintInput> read = read_structured_outputs(body["structured_outputs"]);
  if (!read.ok()) return std::move(read).take_status();
  return std::optional<ConstraintInput>(std::move(*read));
}

StatusOr<std::string> model_field(const json& body) {
  if (!present(body, "model")) return std::string();
  if (!body["model"].is_string()) return bad("model: must be a string", "model");
  return body["model"].get<std::string>();
}

}  // namespace

StatusOr<TokenizeCall> parse_tokenize(std::string_view text, const chat_output::ChatOutputFormats& formats) {
  StatusOr<ordered_json> ordered = parse_client_json<ordered_json>(text, "");
  if (!ordered.ok()) return std::move(ordered).take_status();
  if (!ordered->is_object()) return bad("the request body must be a JSON object", "");
  const json body = *ordered;
  const bool chat = body.contains("messages");
  if (Status refused = refuse_unlisted(
          body, {kTokenizeFields, chat ? Names(kTokenizeChatFields) : Names(kTokenizeTextFields)},
          chat ? "/tokenize (with messages)" : "/tokenize (with a prompt)");
      !refused.ok())
    return refused;
  TokenizeCall call;
  StatusOr<std::string> model = model_field(body);
  if (!model.ok()) return model.status();
  call.model = std::move(*model);
  const auto add_special = bool_field(body, "add_special_tokens");
  if (!add_special.ok()) return add_special.status();
  call.add_special_tokens = *add_special;
  const auto token_strs = bool_field(body, "return_token_strs");
  if (!token_strs.ok()) return token_strs.status();
  call.return_token_strs = token_strs->value_or(false);
  if (chat) {
    StatusOr<std::vector<runtime::ChatMessage>> messages = read_messages(*ordered);
    if (!messages.ok()) return std::move(messages).take_status();
    ResponseShape shape;  // the tools the template sees follow tool_choice, as for a generation
    ParseOptions options;
    options.formats = formats;
    StatusOr<runtime::ChatInputs> inputs = read_chat_inputs(body, *ordered, options, shape);
    if (!inputs.ok()) return std::move(inputs).take_status();
    call.prompt = {ChatPrompt{std::move(*messages), std::move(*inputs)}, "messages"};
    return call;
  }
  if (!present(body, "prompt") || !body["prompt"].is_string())
    return bad("prompt: required, a string (or send messages)", "prompt");
  call.prompt = {TextPrompt{body["prompt"].get<std::string>()}, "prompt"};
  return call;
}

StatusOr<DetokenizeCall> parse_detokenize(std::string_view text) {
  StatusOr<json> parsed = parse_client_json<json>(text, "");
  if (!parsed.ok()) return std::move(parsed).take_status();
  const json& body = *parsed;
  if (!body.is_object()) return bad("the request body must be a JSON object", "");
  constexpr std::string_view kFields[] = {"model", "tokens"};
  if (Status refused = refuse_unlisted(body, {kFields}, "/detokenize"); !refused.ok()) return refused;
  DetokenizeCall call;
  StatusOr<std::string> model = model_field(body);
  if (!model.ok()) return model.status();
  call.model = std::move(*model);
  const Status shape = bad("tokens: required, a list of token ids", "tokens");
  if (!present(body, "tokens") || !body["tokens"].is_array()) return shape;
  for (const json& id : body["tokens"]) {
    if (!id.is_number_integer()) return shape;
    const auto v = id.get<std::int64_t>();
    call.tokens.push_back(v < INT32_MIN || v > INT32_MAX ? -1 : static_cast<std::int32_t>(v));
  }
  return call;
}

StatusOr<std::string> response_id(std::string_view header, Endpoint endpoint) {
  if (header.size() > 128)
    return bad("X-Request-Id: " + std::to_string(header.size()) + " bytes exceed the limit 128",
               "X-Request-Id");
  for (const char ch : header) {
    if (ch < 0x21 || ch > 0x7e)
      return bad("X-Request-Id: only printable ASCII characters without spaces are allowed", "X-Request-Id");
  }
  if (!header.empty()) return std::string(header);
  return generate_request_id(endpoint == Endpoint::chat ? "chatcmpl-" : "cmpl-");
}

StatusOr<CompletionCall> parse_completion(std::string_view text, Endpoint endpoint, std::string id,
                                          const ParseOptions& options) {
  StatusOr<json> parsed = parse_client_json<json>(text, "");
  if (!parsed.ok()) return std::move(parsed).take_status();
  const json& body = *parsed;
  if (!body.is_object()) return bad("the request body must be a JSON object", "");
  if (Status refused = check_fields(body, endpoint); !refused.ok()) return refused;

  CompletionCall call;
  IntakeRequest& r = call.intake;
  ResponseShape& shape = call.shape;
  shape.endpoint = endpoint;
  shape.id = id;
  shape.created = options.created;
  shape.model = options.served_model;
  if (present(body, "model")) {
    if (!body["model"].is_string()) return bad("model: must be a string", "model");
    shape.model = body["model"].get<std::string>();
  }
  r.model = shape.model;
  r.request_id = std::move(id);
  r.fields.request_id = "X-Request-Id";
  r.fields.context = endpoint == Endpoint::chat ? "messages" : "prompt";

  const auto skip_special = bool_field(body, "skip_special_tokens");
  if (!skip_special.ok()) return skip_special.status();
  r.skip_special_tokens = skip_special->value_or(true);
  StatusOr<SamplingInput> sampling = read_sampling(body, endpoint);
  if (!sampling.ok()) return std::move(sampling).take_status();
  r.sampling = std::move(*sampling);
  r.seeding = present(body, "seed") ? Seeding::client : Seeding::random;
  r.unset_temperature = 1.0;  // OpenAI's default, and vLLM's
  const StatusOr<Logprobs> logprobs = read_logprobs(body, endpoint);
  if (!logprobs.ok()) return logprobs.status();
  r.sampling.logprobs = logprobs->logprobs;
  r.sampling.prompt_logprobs = logprobs->prompt_logprobs;
  r.sampling.top_logprobs = logprobs->top_logprobs;
  shape.logprobs = logprobs->logprobs;
  shape.echo = logprobs->echo;
  const auto n = int_field(body, "n");
  if (!n.ok()) return n.status();
  r.n = n->value_or(1);
  if (r.n < 1 || r.n > options.max_choices)
    return bad("n: must be in 1.." + std::to_string(options.max_choices) + ", got " + std::to_string(r.n),
               "n");
  const auto stream = bool_field(body, "stream");
  if (!stream.ok()) return stream.status();
  shape.stream = stream->value_or(false);
  if (present(body, "stream_options")) {
    const json& stream_options = body["stream_options"];
    if (!shape.stream) return bad("stream_options: only allowed when stream is true", "stream_options");
    if (!stream_options.is_object()) return bad("stream_options: must be an object", "stream_options");
    const auto include_usage = bool_field(stream_options, "include_usage");
    if (!include_usage.ok())
      return bad("stream_options.include_usage: must be true or false", "stream_options");
    shape.include_usage = include_usage->value_or(false);
  }

  // Parsed again keeping key order where it matters: templates show tool schemas and arguments in the
  // client's order, and a JSON schema's properties are generated in its order.
  const bool constrained = present(body, "response_format") || present(body, "structured_outputs");
  StatusOr<ordered_json> ordered = ordered_json();
  if (endpoint == Endpoint::chat || constrained) ordered = parse_client_json<ordered_json>(text, "");
  if (!ordered.ok()) return std::move(ordered).take_status();
  StatusOr<std::optional<ConstraintInput>> constraint = read_constraint(*ordered);
  if (!constraint.ok()) return std::move(constraint).take_status();
  r.constraint = std::move(*constraint);

  if (endpoint == Endpoint::chat) {
    StatusOr<std::vector<runtime::ChatMessage>> messages = read_messages(*ordered);
    if (!messages.ok()) return std::move(messages).take_status();
    StatusOr<runtime::ChatInputs> inputs = read_chat_inputs(body, *ordered, options, shape);
    if (!inputs.ok()) return std::move(inputs).take_status();
    // Mistral's [TOOL_CALLS] is a control token: the text keeps special tokens so that the parser sees it
    // (vLLM's Mistral parser does the same).
    if (shape.tool_calls == chat_output::ToolCallFormat::mistral && !shape.forced_tool)
      r.skip_special_tokens = false;
    if (shape.forced_tool) {
      if (r.constraint)
        return bad("tool_choice: a forced tool call cannot be combined with " + r.constraint->field +
                       " (each constrains the output)",
                   "tool_choice");
      r.constraint = forced_tool_constraint(inputs->tools, *shape.forced_tool, shape.parallel_tool_calls);
    }
    r.prompts.push_back({ChatPrompt{std::move(*messages), std::move(*inputs)}, "messages"});
  } else {
    StatusOr<std::vector<PromptInput>> prompts = read_prompts(body);
    if (!prompts.ok()) return std::move(prompts).take_status();
    r.prompts = std::move(*prompts);
  }
  if (static_cast<std::int64_t>(r.prompts.size()) * r.n > options.max_choices)
    return bad("prompt: " + std::to_string(r.prompts.size()) + " prompts times n=" + std::to_string(r.n) +
                   " exceed the limit of " + std::to_string(options.max_choices) + " choices per call",
               "n");
  return call;
}

}  // namespace capserve::server::http
