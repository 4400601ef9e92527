#include "server/request_intake.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>
#include <variant>

#include <spdlog/spdlog.h>

#include "runtime/tokenizer/utf8.h"
#include "server/client_json.h"

namespace capserve::server {
namespace {

using runtime::Status;
using runtime::StatusCode;
using runtime::StatusOr;

Status invalid(std::string message, std::string field) {
  return Status::invalid_argument(std::move(message), std::move(field));
}

// The UTF-8 check of a request's text field (bytes on the wire), naming the field and the first bad byte.
Status check_utf8(std::string_view text, const std::string& field) {
  const std::size_t valid = runtime::utf8::valid_prefix_length(text);
  if (valid == text.size()) return {};
  return invalid(field + ": not valid UTF-8 (ill-formed byte at offset " + std::to_string(valid) + ")",
                 field);
}

// 64 random bits from a generator seeded once per thread from the OS: request ids, unseeded requests' seeds.
std::uint64_t random_u64() {
  thread_local std::mt19937_64 rng{[] {
    std::random_device device;
    return (static_cast<std::uint64_t>(device()) << 32) ^ device();
  }()};
  return rng();
}

// The client's address without its port ("ipv4:10.0.0.1", "ipv6:[::1]"); other peers ("unix:...") whole.
// Limits count per address, not per connection: a client can open connections at will.
std::string peer_address(const std::string& peer) {
  if (!peer.starts_with("ipv4:") && !peer.starts_with("ipv6:")) return peer;
  const std::size_t colon = peer.rfind(':');
  return colon > 4 ? peer.substr(0, colon) : peer;
}

// The message keys beyond role and content that the APIs define, in OpenAI's shapes; other keys pass through
// to the template unchecked, as transformers passes them.
Status check_message_fields(const nlohmann::ordered_json& fields, const std::string& at) {
  for (const char* key : {"tool_call_id", "name"}) {
    const auto it = fields.find(key);
    if (it == fields.end()) continue;
    if (!it->is_string()) return invalid(at + "." + key + ": must be a string", at + "." + key);
    if (Status bad = check_utf8(it->get_ref<const std::string&>(), at + "." + key); !bad.ok()) return bad;
  }
  const auto calls = fields.find("tool_calls");
  if (calls == fields.end() || calls->is_null()) return {};
  const std::string where = at + ".tool_calls";
  if (!calls->is_array()) return invalid(where + ": must be a list of tool calls", where);
  for (std::size_t i = 0; i < calls->size(); ++i) {
    const nlohmann::ordered_json& call = (*calls)[i];
    const std::string c = where + "[" + std::to_string(i) + "]";
    if (!call.is_object()) return invalid(c + ": must be an object", where);
    if (const auto id = call.find("id"); id != call.end() && !id->is_string())
      return invalid(c + ".id: must be a string", where);
    if (const auto type = call.find("type"); type != call.end() && *type != "function")
      return invalid(c + ".type: must be \"function\"", where);
    const auto function = call.find("function");
    if (function == call.end() || !function->is_object())
      return invalid(c + ".function: required, an object with name and arguments", where);
    if (const auto name = function->find("name"); name == function->end() || !name->is_string())
      return invalid(c + ".function.name: required, a string", where);
    if (const auto args = function->find("arguments");
        args != function->end() && !args->is_string() && !args->is_object())
      return invalid(c + ".function.arguments: must be a JSON string or an object", where);
  }
  return {};
}

// tools: absent, or OpenAI function tools {"type": "function", "function": {"name": ..., ...}}.
Status check_tools(const nlohmann::ordered_json& tools) {
  if (tools.is_null()) return {};
  if (!tools.is_array()) return invalid("tools: must be a list of tools", "tools");
  for (std::size_t i = 0; i < tools.size(); ++i) {
    const nlohmann::ordered_json& tool = tools[i];
    const std::string at = "tools[" + std::to_string(i) + "]";
    if (!tool.is_object()) return invalid(at + ": must be an object", "tools");
    if (const auto type = tool.find("type"); type == tool.end() || *type != "function")
      return invalid(at + ".type: must be \"function\"", "tools");
    const auto function = tool.find("function");
    if (function == tool.end() || !function->is_object())
      return invalid(at + ".function: required, an object", "tools");
    if (const auto name = function->find("name"); name == function->end() || !name->is_string())
      return invalid(at + ".function.name: required, a string", "tools");
  }
  return {};
}

// Client strings other than message text (tool calls, tools, template kwargs) that spell a special token are
// refused (keys too), as the API documents. The renderer marks them as the client's bytes like message text
// (RenderedPrompt::content), so this is a second line: such text could not become a control token anyway.
Status check_no_special_tokens(const runtime::Tokenizer& tokenizer, const nlohmann::ordered_json& value,
                               const std::string& field) {
  const auto spells_special = [&](const std::string& text) {
    std::vector<std::int32_t> ids;
    return tokenizer.encode(text, false, ids).ok() &&
           std::ranges::any_of(ids, [&](std::int32_t id) { return tokenizer.is_special(id); });
  };
  if (value.is_string()) {
    if (spells_special(value.get_ref<const std::string&>()))
      return invalid(field + ": " + excerpt(value.get_ref<const std::string&>()) +
                         " spells a special token of the model",
                     field);
  } else if (value.is_object()) {
    for (const auto& [key, item] : value.items()) {
      if (spells_special(key))
        return invalid(field + ": the key " + excerpt(key) + " spells a special token of the model", field);
      if (Status bad = check_no_special_tokens(tokenizer, item, field); !bad.ok()) return bad;
    }
  } else if (value.is_array()) {
    for (const nlohmann::ordered_json& item : value) {
      if (Status bad = check_no_special_tokens(tokenizer, item, field); !bad.ok()) return bad;
    }
  }
  return {};
}

// A prompt that must be prefilled whole (RequestLimits::check_prompt_length) and is longer than a step can
// never be: refused naming the field that holds it (the scheduler would refuse it too, but without knowing
// which field the client sent).
Status fits_one_step(const Scheduler& scheduler, std::size_t tokens, const std::string& field) {
  const Status s = scheduler.limits().check_prompt_length(static_cast<std::int64_t>(tokens));
  if (s.ok()) return s;
  return invalid(field + ": " + s.message(), field);
}

// The server's bound on a JSON number's exponent digits (runtime/grammar JsonOptions::max_exponent_digits).
constexpr int kExponentDigits = 3;

}  // namespace

StatusOr<nlohmann::ordered_json> parse_json_field(std::string_view text, const std::string& field) {
  if (Status bad = check_utf8(text, field); !bad.ok()) return bad;
  return parse_client_json<nlohmann::ordered_json>(text, field);
}

std::string excerpt(std::string_view text, std::size_t limit) {
  std::string out = "'";
  if (text.size() <= limit) return out.append(text).append("'");
  std::size_t cut = limit;
  while (cut > 0 && runtime::utf8::is_continuation(text[cut])) --cut;
  return out.append(text.substr(0, cut))
      .append("...' (")
      .append(std::to_string(text.size()))
      .append(" bytes)");
}

TerminalMeaning meaning_of(Terminal t) {
  switch (t) {
    case Terminal::ok_stop:
      return {std::nullopt, Outcome::stop};
    case Terminal::ok_length:
      return {std::nullopt, Outcome::length};
    case Terminal::cancelled:
      return {StatusCode::cancelled, Outcome::cancelled};
    case Terminal::deadline_exceeded:
      return {StatusCode::deadline_exceeded, Outcome::error};
    case Terminal::unavailable:
      return {StatusCode::unavailable, Outcome::error};
    case Terminal::invalid_argument:
      return {StatusCode::invalid_argument, Outcome::error};
    case Terminal::internal:
      break;
  }
  return {StatusCode::internal, Outcome::error};
}

void RateLimitedLog::log(const std::string& line) {
  std::int64_t suppressed = 0;
  {
    std::lock_guard lock(mutex_);
    const Clock::time_point now = Clock::now();
    if (last_ != Clock::time_point{} && now - last_ < interval_) {
      ++suppressed_;
      return;
    }
    last_ = now;
    suppressed = std::exchange(suppressed_, 0);
  }
  if (suppressed > 0) {
    spdlog::warn("{} ({} similar lines suppressed)", line, suppressed);
  } else {
    spdlog::warn("{}", line);
  }
}

std::string generate_request_id(std::string_view prefix) {
  char hex[25];
  const std::uint64_t hi = random_u64();
  const std::uint64_t lo = random_u64();
  std::snprintf(hex, sizeof hex, "%08x%016llx", static_cast<unsigned>(hi >> 32),
                static_cast<unsigned long long>(lo));
  return std::string(prefix) + hex;
}

RequestIntake::RequestIntake(Scheduler& scheduler, const runtime::Tokenizer* tokenizer,
                             std::optional<runtime::ChatTemplate> chat_template, ServiceLimits limits,
                             ServerMetrics* metrics, runtime::grammar::GrammarCache* grammars)
    : scheduler_(scheduler),
      tokenizer_(tokenizer),
      chat_template_(std::move(chat_template)),
      limits_(std::move(limits)),
      metrics_(metrics),
      grammars_(grammars) {}

Status RequestIntake::check_model(std::string_view model) const {
  if (Status bad = check_utf8(model, "model"); !bad.ok()) return bad;
  if (!model.empty() && model != limits_.model_id)
    return invalid(
        "model: unknown model " + excerpt(model) + "; this server serves '" + limits_.model_id + "'",
        "model");
  return {};
}

Status RequestIntake::check_request_id(std::string_view id, const std::string& field) const {
  if (static_cast<std::int64_t>(id.size()) > limits_.max_request_id_length)
    return invalid(field + ": " + std::to_string(id.size()) + " bytes exceed the limit " +
                       std::to_string(limits_.max_request_id_length),
                   field);
  return check_utf8(id, field);
}

StatusOr<std::vector<std::int32_t>> RequestIntake::tokenize(const PromptInput& prompt,
                                                            std::optional<bool> add_special_tokens,
                                                            std::stop_token stop) const {
  if (const auto* chat = std::get_if<ChatPrompt>(&prompt.content))
    return chat_prompt(*chat, prompt.field, add_special_tokens.value_or(false), std::move(stop));
  if (const auto* text = std::get_if<TextPrompt>(&prompt.content))
    return text_prompt(text->text, prompt.field, add_special_tokens.value_or(true));
  const std::vector<std::int32_t>& ids = std::get<TokenPrompt>(prompt.content).ids;
  if (Status bad = token_prompt(ids, prompt.field); !bad.ok()) return bad;
  return ids;
}

StatusOr<std::vector<std::int32_t>> RequestIntake::prompt_ids(const PromptInput& prompt,
                                                              std::stop_token stop) const {
  StatusOr<std::vector<std::int32_t>> ids = tokenize(prompt, std::nullopt, std::move(stop));
  if (!ids.ok()) return ids;
  if (Status bad = fits_one_step(scheduler_, ids->size(), prompt.field); !bad.ok()) return bad;
  return ids;
}

StatusOr<std::vector<std::int32_t>> RequestIntake::chat_prompt(const ChatPrompt& chat,
                                                               const std::string& field,
                                                               bool add_special_tokens,
                                                               std::stop_token stop) const {
  const std::vector<runtime::ChatMessage>& messages = chat.messages;
  const runtime::ChatInputs& inputs = chat.inputs;
  if (tokenizer_ == nullptr || !chat_template_)
    return Status{StatusCode::failed_precondition,
                  "this model has no tokenizer or chat template; send token ids instead", field};
  if (messages.empty()) return invalid(field + ": at least one message is required", field);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const runtime::ChatMessage& m = messages[i];
    const std::string at = field + "[" + std::to_string(i) + "]";
    if (Status bad = check_utf8(m.role, at + ".role"); !bad.ok()) return bad;
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool")
      return invalid(at + ".role: " + excerpt(m.role) + " is not system, user, assistant or tool",
                     at + ".role");
    if (m.content) {
      if (Status bad = check_utf8(*m.content, at + ".content"); !bad.ok()) return bad;
    }
    if (Status bad = check_message_fields(m.fields, at); !bad.ok()) return bad;
    if (!limits_.special_tokens_in_content) {
      if (Status bad = check_no_special_tokens(*tokenizer_, m.fields, at); !bad.ok()) return bad;
    }
  }
  if (Status bad = check_tools(inputs.tools); !bad.ok()) return bad;
  if (!inputs.kwargs.is_object())
    return invalid("chat_template_kwargs: must be an object", "chat_template_kwargs");
  if (!limits_.special_tokens_in_content) {
    if (Status bad = check_no_special_tokens(*tokenizer_, inputs.tools, "tools"); !bad.ok()) return bad;
    if (Status bad = check_no_special_tokens(*tokenizer_, inputs.kwargs, "chat_template_kwargs"); !bad.ok())
      return bad;
  }
  runtime::RenderedPrompt prompt;
  if (Status s = chat_template_->render(messages, inputs, prompt, stop); !s.ok()) {
    if (stop.stop_requested())
      return Status{StatusCode::cancelled, "the request was cancelled while its prompt was rendered"};
    // A render error of a named input (chat_template_kwargs, tools) names it; any other is the messages'.
    if (!s.field().empty()) return invalid(s.message(), s.field());
    return invalid(field + ": " + s.message(), field);
  }
  // Only the template's markup yields special tokens, unless the server allows them in content too.
  const std::span<const runtime::TextRange> plain_text =
      limits_.special_tokens_in_content ? std::span<const runtime::TextRange>() : prompt.content;
  std::vector<std::int32_t> ids;
  if (Status s = tokenizer_->encode(prompt.text, add_special_tokens, ids, plain_text); !s.ok())
    return invalid(field + ": " + s.message(), field);
  return ids;
}

StatusOr<std::vector<std::int32_t>> RequestIntake::text_prompt(std::string_view text,
                                                               const std::string& field,
                                                               bool add_special_tokens) const {
  if (tokenizer_ == nullptr)
    return Status{StatusCode::failed_precondition, "this model has no tokenizer; send token ids instead",
                  field};
  if (Status bad = check_utf8(text, field); !bad.ok()) return bad;
  // Plain text throughout: a prompt's special-token text is encoded as control tokens only where allowed.
  const runtime::TextRange all{0, text.size()};
  const std::span<const runtime::TextRange> plain_text =
      limits_.special_tokens_in_content ? std::span<const runtime::TextRange>() : std::span(&all, 1);
  std::vector<std::int32_t> ids;
  if (Status s = tokenizer_->encode(text, add_special_tokens, ids, plain_text); !s.ok())
    return invalid(field + ": " + s.message(), field);
  if (ids.empty()) return invalid(field + ": the prompt is empty", field);
  return ids;
}

Status RequestIntake::token_prompt(std::span<const std::int32_t> ids, const std::string& field) const {
  if (ids.empty()) return invalid(field + ": at least one token id is required", field);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limits_.vocab_size)
      return invalid(field + "[" + std::to_string(i) + "]: " + std::to_string(ids[i]) +
                         " is outside the vocabulary [0, " + std::to_string(limits_.vocab_size) + ")",
                     field);
  }
  return {};
}

StatusOr<RequestIntake::Sampling> RequestIntake::sampling(const IntakeRequest& request,
                                                          std::int64_t prompt_tokens) const {
  const SamplingInput& s = request.sampling;
  const std::string& prefix = request.fields.sampling_prefix;
  const runtime::GenerationDefaults& defaults = limits_.generation_defaults;
  const double temperature = s.temperature.value_or(defaults.temperature.value_or(request.unset_temperature));
  const double top_p = s.top_p.value_or(defaults.top_p.value_or(1.0F));
  const std::int64_t top_k = s.top_k.value_or(defaults.top_k.value_or(0));
  if (!std::isfinite(temperature) || temperature < 0)
    return invalid(prefix + "temperature: must be a finite number >= 0 (0 is greedy), got " +
                       std::to_string(temperature),
                   prefix + "temperature");
  if (!std::isfinite(top_p) || top_p < 0 || top_p > 1)
    return invalid(prefix + "top_p: must be in [0, 1] (0 or 1: off), got " + std::to_string(top_p),
                   prefix + "top_p");
  if (top_k < 0 || top_k > limits_.vocab_size)
    return invalid(prefix + "top_k: " + std::to_string(top_k) + " is outside [0, the vocabulary size " +
                       std::to_string(limits_.vocab_size) + "]",
                   prefix + "top_k");
  if (s.top_logprobs < 0 || s.top_logprobs > runtime::kMaxTopLogprobs)
    return invalid(prefix + "top_logprobs: must be in [0, " + std::to_string(runtime::kMaxTopLogprobs) +
                       "], got " + std::to_string(s.top_logprobs),
                   prefix + "top_logprobs");
  if (s.top_logprobs > 0 && !s.logprobs && !s.prompt_logprobs)
    return invalid(prefix + "top_logprobs: needs " + prefix + "logprobs or " + prefix + "prompt_logprobs",
                   prefix + "top_logprobs");
  if (s.max_tokens < 0)
    return invalid(prefix + "max_tokens: must be >= 1, got " + std::to_string(s.max_tokens),
                   prefix + "max_tokens");
  const std::int64_t max_tokens = s.max_tokens == 0 ? limits_.default_max_tokens : s.max_tokens;
  if (max_tokens > limits_.max_tokens_limit)
    return invalid(prefix + "max_tokens: " + std::to_string(max_tokens) + " exceeds the limit " +
                       std::to_string(limits_.max_tokens_limit),
                   prefix + "max_tokens");
  if (prompt_tokens + 1 > limits_.max_context)
    return invalid(request.fields.context + ": " + std::to_string(prompt_tokens) +
                       " tokens leave no room to generate within the context length " +
                       std::to_string(limits_.max_context),
                   request.fields.context);
  if (!request.text_output && !s.stop.empty())
    return invalid(prefix + "stop: stop strings need text output; use stop_token_ids", prefix + "stop");
  if (static_cast<std::int64_t>(s.stop.size()) > limits_.max_stop_strings)
    return invalid(prefix + "stop: " + std::to_string(s.stop.size()) + " stop strings exceed the limit " +
                       std::to_string(limits_.max_stop_strings),
                   prefix + "stop");
  Sampling out;
  for (std::size_t i = 0; i < s.stop.size(); ++i) {
    const std::string& stop = s.stop[i];
    const std::string field = prefix + "stop[" + std::to_string(i) + "]";
    if (stop.empty() || static_cast<std::int64_t>(stop.size()) > limits_.max_stop_length)
      return invalid(field + ": must be 1.." + std::to_string(limits_.max_stop_length) + " bytes",
                     prefix + "stop");
    if (Status bad = check_utf8(stop, field); !bad.ok()) return bad;
    out.stops.push_back(stop);
  }
  if (static_cast<std::int64_t>(s.stop_token_ids.size()) > limits_.max_stop_token_ids)
    return invalid(prefix + "stop_token_ids: " + std::to_string(s.stop_token_ids.size()) +
                       " ids exceed the limit " + std::to_string(limits_.max_stop_token_ids),
                   prefix + "stop_token_ids");
  for (const std::int32_t id : s.stop_token_ids) {
    if (id < 0 || id >= limits_.vocab_size)
      return invalid(prefix + "stop_token_ids: " + std::to_string(id) + " is outside the vocabulary [0, " +
                         std::to_string(limits_.vocab_size) + ")",
                     prefix + "stop_token_ids");
  }
  runtime::SamplingParams& params = out.params;
  params.temperature = static_cast<float>(temperature);
  params.top_p = top_p == 0 ? 1.0F : static_cast<float>(top_p);
  params.top_k = static_cast<std::int32_t>(top_k);
  params.max_new_tokens = std::min(max_tokens, limits_.max_context - prompt_tokens);
  params.logprobs = s.logprobs;
  params.prompt_logprobs = s.prompt_logprobs;
  params.top_logprobs = static_cast<std::int32_t>(s.top_logprobs);
  params.stop_token_ids = s.stop_token_ids;
  if (!s.ignore_eos)
    params.stop_token_ids.insert(params.stop_token_ids.end(), limits_.eos_token_ids.begin(),
                                 limits_.eos_token_ids.end());
  params.min_p = static_cast<float>(s.min_p.value_or(0.0));
  params.presence_penalty = static_cast<float>(s.presence_penalty);
  params.frequency_penalty = static_cast<float>(s.frequency_penalty);
  params.repetition_penalty = static_cast<float>(s.repetition_penalty);
  params.logit_bias = s.logit_bias;
  if (s.capacity_class == "protected") {
    if (limits_.max_protected_requests <= 0)
      return invalid(prefix +
                         "capacity_class: this server admits no protected requests (--max-protected-requests "
                         "is 0)",
                     prefix + "capacity_class");
    params.protect = true;
  } else if (!s.capacity_class.empty() && s.capacity_class != "standard") {
    return invalid(prefix + "capacity_class: must be \"standard\" or \"protected\"",
                   prefix + "capacity_class");
  }
  // min_tokens beyond what the context leaves is the client's max_tokens's check, not the context's.
  if (s.min_tokens > max_tokens)
    return invalid(prefix + "min_tokens: " + std::to_string(s.min_tokens) + " exceeds max_tokens " +
                       std::to_string(max_tokens),
                   prefix + "min_tokens");
  // vLLM also holds stop strings back until min_tokens; the output stream does not yet, so refuse rather than
  // end early.
  if (s.min_tokens > 0 && !s.stop.empty())
    return invalid(prefix + "min_tokens: not supported together with stop strings (stop token ids are)",
                   prefix + "min_tokens");
  params.min_tokens = std::min(s.min_tokens, params.max_new_tokens);
  for (const kernels::LogitBias& b : s.logit_bias) {
    if (b.token >= limits_.vocab_size)
      return invalid(prefix + "logit_bias: token " + std::to_string(b.token) +
                         " is outside the vocabulary [0, " + std::to_string(limits_.vocab_size) + ")",
                     prefix + "logit_bias");
  }
  // The double values narrowed to float are checked as the runtime takes them.
  if (runtime::Status bad = runtime::validate_sampling(params); !bad.ok())
    return invalid(prefix + bad.message(), prefix + bad.field());
  return out;
}

StatusOr<std::string> RequestIntake::constraint(const IntakeRequest& request) const {
  if (!request.constraint) return std::string();
  const std::string& field = request.constraint->field;
  if (grammars_ == nullptr)
    return invalid(field + ": structured output needs the model's tokenizer, and this server has none",
                   field);
  // The grammar allows the model's EOS once the text is complete, and nothing else ends it: min_tokens
  // would forbid that EOS and the grammar every other token.
  const std::string& prefix = request.fields.sampling_prefix;
  if (request.sampling.ignore_eos)
    return invalid(prefix + "ignore_eos: cannot be combined with " + field +
                       " (the output ends with the model's EOS once it is complete)",
                   prefix + "ignore_eos");
  if (request.sampling.min_tokens > 0)
    return invalid(
        prefix + "min_tokens: cannot be combined with " + field + " (a complete output ends, however short)",
        prefix + "min_tokens");
  nlohmann::ordered_json with_policy = request.constraint->spec;
  // JSON numbers' exponents: 3 digits at most unless the constraint says (no double goes past e308, and a
  // small model can write digits for ever).
  if ((with_policy.contains("json_schema") || with_policy.contains("json_object")) &&
      !with_policy.contains("exponent_digits"))
    with_policy["exponent_digits"] = kExponentDigits;
  std::string spec = with_policy.dump();
  StatusOr<std::shared_ptr<const runtime::grammar::CompiledGrammar>> compiled = grammars_->get(spec);
  if (!compiled.ok()) {
    const Status& why = compiled.status();
    const std::string where = why.field().empty() ? "" : " (" + why.field() + ")";
    return invalid(field + ": " + why.message() + where, field);
  }
  return spec;
}

StatusOr<std::vector<std::shared_ptr<Request>>> RequestIntake::prepare(const IntakeRequest& request) {
  if (Status bad = check_model(request.model); !bad.ok()) return bad;
  if (Status bad = check_request_id(request.request_id, request.fields.request_id); !bad.ok()) return bad;
  StatusOr<std::string> constraint = this->constraint(request);
  if (!constraint.ok()) return std::move(constraint).take_status();
  std::vector<std::vector<std::int32_t>> prompts;
  prompts.reserve(request.prompts.size());
  for (const PromptInput& prompt : request.prompts) {
    StatusOr<std::vector<std::int32_t>> ids = prompt_ids(prompt, request.stop);
    if (!ids.ok()) return std::move(ids).take_status();
    prompts.push_back(std::move(*ids));
  }
  const std::size_t choices = prompts.size() * static_cast<std::size_t>(request.n);
  const std::string id =
      request.request_id.empty() ? generate_request_id(request.id_prefix) : request.request_id;
  const std::uint64_t base_seed = request.seeding == Seeding::client ? request.sampling.seed : random_u64();
  std::vector<std::shared_ptr<Request>> requests;
  requests.reserve(choices);
  for (std::vector<std::int32_t>& ids : prompts) {
    StatusOr<Sampling> sampled = sampling(request, static_cast<std::int64_t>(ids.size()));
    if (!sampled.ok()) return std::move(sampled).take_status();
    for (std::int64_t k = 0; k < request.n; ++k) {
      // Choices differ by their seed only; one choice keeps the call's id, several get "-index".
      const std::size_t index = requests.size();
      runtime::SamplingParams params = sampled->params;
      params.seed = base_seed + index;
      params.constraint = *constraint;
      requests.push_back(std::make_shared<Request>(
          choices == 1 ? id : id + "-" + std::to_string(index), ids, std::move(params),
          OutputForm{request.text_output, sampled->stops, request.skip_special_tokens}, request.deadline,
          request.peer));
    }
  }
  return requests;
}

StatusOr<RequestIntake::Admitted> RequestIntake::admit(const IntakeRequest& request,
                                                       const std::function<void()>& listener) {
  StatusOr<std::vector<std::shared_ptr<Request>>> prepared = prepare(request);
  if (!prepared.ok()) {
    if (prepared.status().code() != StatusCode::cancelled) return refuse(std::move(prepared).take_status());
    count_outcome(Outcome::cancelled);
    return std::move(prepared).take_status();
  }
  // The client left (or the server drains) while the prompts were prepared: nothing reaches the scheduler.
  if (request.stop.stop_requested()) {
    count_outcome(Outcome::cancelled);
    return Status{StatusCode::cancelled, "the request was cancelled"};
  }
  std::vector<std::shared_ptr<Request>>& requests = *prepared;
  // Every choice is a request in flight: a call takes one slot per choice.
  StatusOr<PeerSlot> slot = enter(request.peer, static_cast<std::int64_t>(requests.size()));
  if (!slot.ok()) return std::move(slot).take_status();
  std::optional<PeerSlot> protected_slot;
  if (requests.front()->params().protect) {
    StatusOr<PeerSlot> taken = enter_protected(static_cast<std::int64_t>(requests.size()));
    if (!taken.ok()) return std::move(taken).take_status();
    protected_slot.emplace(std::move(*taken));
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i]->set_listener(listener);
    if (Status refused = submit(requests[i]); !refused.ok()) {
      for (std::size_t j = 0; j < i; ++j) {
        requests[j]->cancel();  // the engine frees their sequences at the next step
        count_outcome(Outcome::cancelled);
      }
      return refused;
    }
  }
  return Admitted{std::move(requests), std::move(*slot), std::move(protected_slot)};
}

Status RequestIntake::submit(const std::shared_ptr<Request>& request) {
  Status status = scheduler_.submit(request);
  if (status.ok()) return status;
  return refuse(std::move(status));
}

RequestIntake::PeerSlot::~PeerSlot() {
  if (intake_ == nullptr) return;
  std::lock_guard lock(intake_->peers_mutex_);
  const auto it = intake_->peer_requests_.find(address_);
  if ((it->second -= count_) <= 0) intake_->peer_requests_.erase(it);
}

bool RequestIntake::take_slots(const std::string& key, std::int64_t count, std::int64_t limit) {
  std::lock_guard lock(peers_mutex_);
  std::int64_t& n = peer_requests_[key];
  if (limit <= 0 || n + count <= limit) {
    n += count;
    return true;
  }
  if (n == 0) peer_requests_.erase(key);  // no entry for a key with nothing in flight
  return false;
}

StatusOr<RequestIntake::PeerSlot> RequestIntake::enter(const std::string& peer, std::int64_t count) {
  std::string address = peer_address(peer);
  if (!take_slots(address, count, limits_.max_requests_per_peer))
    return refuse({StatusCode::resource_exhausted,
                   "too many requests in flight from " + address + ": " + std::to_string(count) +
                       " more would exceed the limit of " + std::to_string(limits_.max_requests_per_peer) +
                       " per client address (--max-requests-per-peer); retry when one ends"});
  return PeerSlot(*this, std::move(address), count);
}

StatusOr<RequestIntake::PeerSlot> RequestIntake::enter_protected(std::int64_t count) {
  // Not a client address (those have no spaces), so it never shares a count with one.
  const std::string key = "protected requests";
  if (!take_slots(key, count, limits_.max_protected_requests))
    return refuse({StatusCode::resource_exhausted,
                   "too many protected requests in flight: " + std::to_string(count) +
                       " more would exceed the server's limit of " +
                       std::to_string(limits_.max_protected_requests) +
                       " (--max-protected-requests); retry when one ends, or send it as standard"});
  return PeerSlot(*this, key, count);
}

Status RequestIntake::refuse(Status error) {
  if (metrics_ != nullptr) metrics_->count_error(runtime::code_name(error.code()));
  refusal_log_.log(std::string("capserve: refused a request: ") + runtime::code_name(error.code()) + ": " +
                   error.message());
  return error;
}

void RequestIntake::conclude(const RequestEvent& terminal) {
  if (metrics_ == nullptr) return;
  const TerminalMeaning meaning = meaning_of(*terminal.terminal);
  metrics_->count_outcome(meaning.outcome);
  if (meaning.outcome == Outcome::error) metrics_->count_error(runtime::code_name(*meaning.error));
}

void RequestIntake::count_outcome(Outcome outcome) {
  if (metrics_ != nullptr) metrics_->count_outcome(outcome);
}

}  // namespace capserve::server
