#include "server/http/openai_api.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "server/client_json.h"

namespace capserve::server::http {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kJson = "application/json";

std::uint64_t random_seed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

// A bad field, as the error it becomes.
struct FieldError {
  std::string message;
  std::string param;
};

// What an intake refusal is over HTTP.
Response intake_response(const IntakeError& e) {
  switch (e.code) {
    case IntakeCode::invalid_argument:
      if (e.param == "model" && e.message.find("unknown model") != std::string::npos)
        return error_response(404, e.message, "invalid_request_error", e.param, "model_not_found");
      if (e.message.find("context length") != std::string::npos)
        return error_response(400, e.message, "invalid_request_error", e.param, "context_length_exceeded");
      return error_response(400, e.message, "invalid_request_error", e.param);
    case IntakeCode::resource_exhausted:
      return error_response(429, e.message, "rate_limit_error", e.param, "rate_limit_exceeded");
    case IntakeCode::unavailable:
      return error_response(503, e.message, "service_unavailable", e.param);
    case IntakeCode::failed_precondition:
      return error_response(400, e.message, "invalid_request_error", e.param);
    case IntakeCode::cancelled:
      return error_response(499, e.message, "cancelled", e.param);
    case IntakeCode::deadline_exceeded:
      return error_response(504, e.message, "timeout", e.param);
    case IntakeCode::internal:
      break;
  }
  return error_response(500, e.message, "server_error", e.param);
}

unsigned http_status(IntakeCode code) {
  return intake_response({code, {}, {}}).status;
}

json error_json(std::string_view message, std::string_view type, std::string_view param,
                std::string_view code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

// Field readers: absent or null gives the default; a value of another type is an error naming the field.
std::optional<FieldError> read_number(const json& body, const char* name, double& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return FieldError{std::string(name) + ": must be a number", name};
  out = it->get<double>();
  return std::nullopt;
}

std::optional<FieldError> read_int(const json& body, const char* name, std::int64_t& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) return FieldError{std::string(name) + ": must be an integer", name};
  if (it->is_number_unsigned() && it->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
    return FieldError{std::string(name) + ": out of range", name};
  out = it->get<std::int64_t>();
  return std::nullopt;
}

// A field the request may leave unset (then the server's default applies).
template <typename T>
std::optional<FieldError> read_optional(const json& body, const char* name, std::optional<T>& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  T value{};
  std::optional<FieldError> e;
  if constexpr (std::is_same_v<T, double>) {
    e = read_number(body, name, value);
  } else {
    e = read_int(body, name, value);
  }
  if (!e) out = value;
  return e;
}

std::optional<FieldError> read_bool(const json& body, const char* name, bool& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return FieldError{std::string(name) + ": must be true or false", name};
  out = it->get<bool>();
  return std::nullopt;
}

// The sampling fields common to both endpoints; `seeded` says whether the client chose the seed.
std::optional<FieldError> read_sampling(const json& body, bool chat, SamplingInput& s, bool& seeded) {
  if (auto e = read_optional(body, "temperature", s.temperature)) return e;
  if (auto e = read_optional(body, "top_p", s.top_p)) return e;
  if (auto e = read_optional(body, "top_k", s.top_k)) return e;
  if (s.top_k == -1) s.top_k = 0;  // vLLM's "off"
  std::int64_t max_tokens = 0;
  if (auto e = read_int(body, "max_tokens", max_tokens)) return e;
  if (chat) {
    if (auto e = read_int(body, "max_completion_tokens", max_tokens)) return e;
  }
  if (body.contains("max_tokens") && !body["max_tokens"].is_null() && max_tokens < 1)
    return FieldError{"max_tokens: must be >= 1, got " + std::to_string(max_tokens), "max_tokens"};
  if (max_tokens < 0 || (chat && body.contains("max_completion_tokens") &&
                         !body["max_completion_tokens"].is_null() && max_tokens < 1))
    return FieldError{"max_completion_tokens: must be >= 1, got " + std::to_string(max_tokens),
                      "max_completion_tokens"};
  s.max_tokens = max_tokens;
  std::int64_t seed = 0;
  if (auto e = read_int(body, "seed", seed)) return e;
  seeded = body.contains("seed") && !body["seed"].is_null();
  s.seed = static_cast<std::uint64_t>(seed);
  if (auto e = read_bool(body, "ignore_eos", s.ignore_eos)) return e;
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    double penalty = 0;
    if (auto e = read_number(body, name, penalty)) return e;
    if (penalty != 0) return FieldError{std::string(name) + ": not supported by this server (only 0)", name};
  }
  double repetition = 1;
  if (auto e = read_number(body, "repetition_penalty", repetition)) return e;
  if (repetition != 1)
    return FieldError{"repetition_penalty: not supported by this server (only 1)", "repetition_penalty"};
  const auto stop = body.find("stop");
  if (stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& one : *stop) {
        if (!one.is_string()) return FieldError{"stop: must be a string or a list of strings", "stop"};
        s.stop.push_back(one.get<std::string>());
      }
    } else {
      return FieldError{"stop: must be a string or a list of strings", "stop"};
    }
  }
  return std::nullopt;
}

// Token log-probabilities. Chat: `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs). Completions:
// `logprobs` (the number of alternatives, 0..20; present: every generated token's) and `echo` (the prompt
// comes back before the completion, with its tokens' log-probabilities when logprobs is set: what lm-eval's
// log-likelihood tasks read).
std::optional<FieldError> read_logprobs(const json& body, bool chat, SamplingInput& s, bool& echo) {
  const std::string max = std::to_string(runtime::kMaxTopLogprobs);
  if (chat) {
    if (auto e = read_bool(body, "logprobs", s.logprobs)) return e;
    if (auto e = read_int(body, "top_logprobs", s.top_logprobs)) return e;
    if (s.top_logprobs < 0 || s.top_logprobs > runtime::kMaxTopLogprobs)
      return FieldError{"top_logprobs: must be in 0.." + max + ", got " + std::to_string(s.top_logprobs),
                        "top_logprobs"};
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null() && !s.logprobs)
      return FieldError{"top_logprobs: needs logprobs set to true", "top_logprobs"};
    if (body.contains("echo") && !body["echo"].is_null())
      return FieldError{"echo: only /v1/completions echoes the prompt", "echo"};
    return std::nullopt;
  }
  if (auto e = read_bool(body, "echo", echo)) return e;
  if (body.contains("top_logprobs") && !body["top_logprobs"].is_null())
    return FieldError{"top_logprobs: /v1/completions takes the number of alternatives in logprobs",
                      "top_logprobs"};
  if (!body.contains("logprobs") || body["logprobs"].is_null()) return std::nullopt;
  if (body["logprobs"].is_boolean())
    return FieldError{"logprobs: /v1/completions takes the number of alternatives (0.." + max + ")",
                      "logprobs"};
  if (auto e = read_int(body, "logprobs", s.top_logprobs)) return e;
  if (s.top_logprobs < 0 || s.top_logprobs > runtime::kMaxTopLogprobs)
    return FieldError{"logprobs: must be in 0.." + max + ", got " + std::to_string(s.top_logprobs),
                      "logprobs"};
  s.logprobs = true;
  s.prompt_logprobs = echo;
  return std::nullopt;
}

// A token's text as the logprobs fields show it (as the gRPC API does: U+FFFD for part of a character,
// special tokens empty), and its UTF-8 bytes.
std::string token_text(const runtime::Tokenizer* tokenizer, std::int32_t id) {
  return tokenizer == nullptr ? std::string() : tokenizer->decode(std::span(&id, 1), true);
}

json utf8_bytes(const std::string& text) {
  json out = json::array();
  for (const char ch : text) out.push_back(static_cast<unsigned char>(ch));
  return out;
}

// Chat's logprobs.content entries.
json chat_logprobs(const LogprobEntries& entries, const runtime::Tokenizer* tokenizer) {
  json content = json::array();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string text = token_text(tokenizer, entries.tokens[i]);
    json top = json::array();
    for (const TopLogprob& alt : entries.alternatives(i)) {
      const std::string alt_text = token_text(tokenizer, alt.token);
      top.push_back({{"token", alt_text}, {"logprob", alt.logprob}, {"bytes", utf8_bytes(alt_text)}});
    }
    content.push_back({{"token", text},
                       {"logprob", entries.logprobs[i]},
                       {"bytes", utf8_bytes(text)},
                       {"top_logprobs", top}});
  }
  return json{{"content", std::move(content)}};
}

// Completions' logprobs: parallel lists. The first prompt token of an echo has no log-probability (null).
struct CompletionLogprobs {
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       text_offset = json::array();
  std::size_t offset = 0;  // bytes of text before the next token

  void add(const std::string& text, json logprob, json top) {
    tokens.push_back(text);
    token_logprobs.push_back(std::move(logprob));
    top_logprobs.push_back(std::move(top));
    text_offset.push_back(offset);
    offset += text.size();
  }
  void add(const LogprobEntries& entries, const runtime::Tokenizer* tokenizer) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      json top = json::object();
      for (const TopLogprob& alt : entries.alternatives(i))
        top[token_text(tokenizer, alt.token)] = alt.logprob;
      add(token_text(tokenizer, entries.tokens[i]), entries.logprobs[i], std::move(top));
    }
  }
  [[nodiscard]] json to_json() const {
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top_logprobs},
            {"text_offset", text_offset}};
  }
};

// Chat messages (runtime::message_from_json), in the client's key order (`body` is parsed keeping it);
// request_intake checks the keys the API defines.
std::optional<FieldError> read_messages(const ordered_json& body,
                                        std::vector<runtime::ChatMessage>& messages) {
  const auto it = body.find("messages");
  if (it == body.end() || !it->is_array())
    return FieldError{"messages: required, a list of messages", "messages"};
  for (std::size_t i = 0; i < it->size(); ++i) {
    runtime::ChatMessage message;
    if (std::optional<std::string> error = runtime::message_from_json((*it)[i], message))
      return FieldError{"messages[" + std::to_string(i) + "]" + *error, "messages"};
    messages.push_back(std::move(message));
  }
  return std::nullopt;
}

// What the chat template sees besides the messages: tools, chat_template_kwargs (vLLM), add_generation_prompt
// and continue_final_message (vLLM's top-level fields). tool_choice is accepted and checked only: the server
// does not constrain generation to a tool call.
std::optional<FieldError> read_chat_inputs(const json& body, const ordered_json& ordered,
                                           runtime::ChatInputs& inputs) {
  if (const auto it = ordered.find("tools"); it != ordered.end() && !it->is_null()) {
    if (!it->is_array()) return FieldError{"tools: must be a list of tools", "tools"};
    inputs.tools = *it;
  }
  if (const auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      if (*it != "none" && *it != "auto" && *it != "required")
        return FieldError{"tool_choice: must be \"none\", \"auto\", \"required\" or a named function",
                          "tool_choice"};
    } else if (!it->is_object() || it->value("type", "") != "function") {
      return FieldError{"tool_choice: must be \"none\", \"auto\", \"required\" or a named function",
                        "tool_choice"};
    }
  }
  if (const auto it = ordered.find("chat_template_kwargs"); it != ordered.end() && !it->is_null()) {
    if (!it->is_object())
      return FieldError{"chat_template_kwargs: must be an object", "chat_template_kwargs"};
    inputs.kwargs = *it;
  }
  if (auto e = read_bool(body, "add_generation_prompt", inputs.add_generation_prompt)) return e;
  if (auto e = read_bool(body, "continue_final_message", inputs.continue_final_message)) return e;
  if (inputs.continue_final_message && inputs.add_generation_prompt)
    return FieldError{"continue_final_message: needs add_generation_prompt false", "continue_final_message"};
  return std::nullopt;
}

// A completions prompt: a string, a list of strings, a list of token ids or a list of such lists.
struct Prompt {
  std::optional<std::string> text;
  std::vector<std::int32_t> ids;
};

std::optional<FieldError> read_prompts(const json& body, std::vector<Prompt>& prompts) {
  const auto it = body.find("prompt");
  const FieldError shape{
      "prompt: must be a string, a list of strings, a list of token ids or a list of lists of "
      "token ids",
      "prompt"};
  if (it == body.end() || it->is_null()) return FieldError{"prompt: required", "prompt"};
  auto ids_of = [&](const json& list, Prompt& p) -> bool {
    for (const json& t : list) {
      if (!t.is_number_integer()) return false;
      const auto v = t.get<std::int64_t>();
      p.ids.push_back(v < INT32_MIN || v > INT32_MAX ? -1 : static_cast<std::int32_t>(v));
    }
    return true;
  };
  if (it->is_string()) {
    prompts.push_back({it->get<std::string>(), {}});
    return std::nullopt;
  }
  if (!it->is_array() || it->empty()) return shape;
  const json& first = it->front();
  if (first.is_number_integer()) {
    Prompt p;
    if (!ids_of(*it, p)) return shape;
    prompts.push_back(std::move(p));
    return std::nullopt;
  }
  for (const json& one : *it) {
    if (one.is_string()) {
      prompts.push_back({one.get<std::string>(), {}});
    } else if (one.is_array()) {
      Prompt p;
      if (!ids_of(one, p)) return shape;
      prompts.push_back(std::move(p));
    } else {
      return shape;
    }
  }
  return std::nullopt;
}

// Wakes a connection from the engine loop's thread once the connection has armed it; before, it does nothing
// (the connection polls once when it arms, so no event is missed).
class Waker {
 public:
  void arm(std::function<void()> wake) {
    wake_ = std::move(wake);
    armed_.store(true, std::memory_order_release);
  }
  void operator()() const {
    if (armed_.load(std::memory_order_acquire)) wake_();
  }

 private:
  std::function<void()> wake_;
  std::atomic<bool> armed_{false};
};

const char* finish_reason(Terminal t) {
  return t == Terminal::ok_stop ? "stop" : "length";
}

json moe_json(std::uint64_t assignments, std::uint64_t dropped, std::uint64_t rerouted) {
  return {{"assignments", assignments}, {"dropped", dropped}, {"rerouted", rerouted}};
}

// The choices of one call (n per prompt) on their way to the client: whole once every choice has ended, or
// as SSE chunks as their events come.
class Completion final : public Producer {
 public:
  struct Choice {
    std::shared_ptr<Request> request;
    bool counts_prompt = false;  // the first choice of its prompt: its prompt tokens count in usage
    std::string text;
    bool started = false;  // streamed: the chat role chunk (or the echoed prompt) went out
    std::optional<RequestEvent> terminal;
    std::string echo;                        // the prompt's text, returned before the completion
    std::int32_t first_prompt_token = -1;    // echo with logprobs: it has no log-probability
    LogprobEntries logprobs;                 // chat, not streamed
    CompletionLogprobs completion_logprobs;  // completions
  };
  struct Shape {
    bool chat = false;
    bool stream = false;
    bool include_usage = false;
    bool logprobs = false;
    bool echo = false;
    std::string id;
    std::string model;
    std::int64_t created = 0;
  };

  Completion(RequestIntake& intake, Shape shape)
      : intake_(intake),
        tokenizer_(intake.tokenizer()),
        shape_(std::move(shape)),
        waker_(std::make_shared<Waker>()) {}

  // The client address's in-flight slot, held as long as the response.
  std::optional<RequestIntake::PeerSlot>& slot() { return slot_; }

  // Before the request is submitted.
  void add(std::shared_ptr<Request> request, bool counts_prompt, std::string echo) {
    request->set_listener([waker = waker_] { (*waker)(); });
    Choice c{std::move(request), counts_prompt, {}, false, std::nullopt, std::move(echo), -1, {}, {}};
    if (shape_.echo && !c.request->prompt().empty()) c.first_prompt_token = c.request->prompt().front();
    choices_.push_back(std::move(c));
  }
  [[nodiscard]] std::size_t size() const { return choices_.size(); }
  // The call is refused after its first `submitted` choices were submitted: those are cancelled.
  void cancel_submitted(std::size_t submitted) {
    for (std::size_t i = 0; i < submitted; ++i) {
      choices_[i].request->cancel();
      intake_.count_outcome(Outcome::cancelled);
    }
  }

  void start(std::function<void()> wake) override {
    waker_->arm(std::move(wake));
    (*waker_)();
  }

  bool poll(std::string& out) override {
    for (std::size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = choices_[i];
      while (!c.terminal) {
        std::optional<RequestEvent> e = c.request->try_next();
        if (!e) break;
        on_event(i, std::move(*e), out);
        if (error_) break;
      }
      if (error_) break;
    }
    if (error_) {
      if (shape_.stream) {
        out += "data: " + error_json(error_->message, error_type_, "", "").dump() + "\n\ndata: [DONE]\n\n";
      } else {
        const Response r = intake_response(*error_);
        out = r.body;
        status_ = r.status;
      }
      return true;
    }
    for (const Choice& c : choices_)
      if (!c.terminal) return false;
    finish(out);
    return true;
  }

  [[nodiscard]] unsigned status() const override { return status_; }

  void abandon() override {
    for (Choice& c : choices_) {
      if (c.terminal) continue;
      c.request->cancel();  // the engine frees its sequence at the next step
      intake_.count_outcome(Outcome::cancelled);
      c.terminal = RequestEvent{};
      c.terminal->terminal = Terminal::cancelled;
    }
  }

 private:
  void on_event(std::size_t index, RequestEvent e, std::string& out) {
    Choice& c = choices_[index];
    if (e.terminal) {
      intake_.conclude(e);
      if (const std::optional<IntakeCode> code = meaning_of(*e.terminal).error) {
        // One choice failed: the call fails, and the other choices are cancelled.
        c.terminal = e;
        for (Choice& other : choices_) {
          if (other.terminal) continue;
          other.request->cancel();
          intake_.count_outcome(Outcome::cancelled);
          other.terminal = RequestEvent{};
          other.terminal->terminal = Terminal::cancelled;
        }
        error_ = IntakeError{*code, e.message.empty() ? "the request was cancelled" : e.message, {}};
        error_type_ = http_status(*code) >= 500 ? "server_error" : "invalid_request_error";
        return;
      }
    }
    if (shape_.logprobs && !shape_.chat) {
      if (!e.prompt_logprobs.empty() && c.first_prompt_token >= 0) {
        c.completion_logprobs.add(token_text(tokenizer_, c.first_prompt_token), nullptr, nullptr);
        c.first_prompt_token = -1;
      }
      c.completion_logprobs.add(e.prompt_logprobs, tokenizer_);
      c.completion_logprobs.add(e.logprobs, tokenizer_);
    }
    if (shape_.stream) {
      if (!c.started) {
        c.started = true;
        if (shape_.chat) {
          out += chunk(index, json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr, std::nullopt);
        } else if (!c.echo.empty()) {
          e.text = c.echo + e.text;
        }
      }
      if (!e.text.empty() || e.terminal) {
        json finish = e.terminal ? json(finish_reason(*e.terminal)) : json(nullptr);
        json delta =
            shape_.chat ? (e.text.empty() ? json::object() : json{{"content", e.text}}) : json(e.text);
        json logprobs = nullptr;
        if (shape_.logprobs) {
          if (shape_.chat) {
            logprobs = chat_logprobs(e.logprobs, tokenizer_);
          } else {
            logprobs = c.completion_logprobs.to_json();
            const std::size_t offset = c.completion_logprobs.offset;
            c.completion_logprobs = {};
            c.completion_logprobs.offset = offset;  // text offsets count from the start of the text
          }
        }
        std::optional<json> moe;
        if (e.terminal) moe = moe_json(e.moe_assignments, e.moe_dropped, e.moe_rerouted);
        out += chunk(index, std::move(delta), std::move(finish), std::move(logprobs), std::move(moe));
      }
    } else {
      c.text += e.text;
      if (shape_.logprobs && shape_.chat) e.logprobs.move_front(e.logprobs.size(), c.logprobs);
    }
    if (e.terminal) c.terminal = std::move(e);
  }

  // One SSE event with one choice: a chat delta (an object) or completion text (a string).
  std::string chunk(std::size_t index, json delta, json finish, json logprobs,
                    std::optional<json> moe) const {
    json choice{{"index", index}, {"finish_reason", std::move(finish)}, {"logprobs", std::move(logprobs)}};
    if (shape_.chat) {
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = std::move(delta);
    }
    json body{{"id", shape_.id},
              {"object", shape_.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", shape_.created},
              {"model", shape_.model},
              {"choices", json::array({std::move(choice)})}};
    if (moe) body["moe"] = std::move(*moe);
    if (shape_.include_usage) body["usage"] = nullptr;
    return "data: " + body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
  }

  void finish(std::string& out) {
    std::uint64_t prompt = 0, completion = 0, assignments = 0, dropped = 0, rerouted = 0;
    json choices = json::array();
    for (std::size_t i = 0; i < choices_.size(); ++i) {
      const Choice& c = choices_[i];
      const RequestEvent& t = *c.terminal;
      if (c.counts_prompt) prompt += t.prompt_tokens;
      completion += t.completion_tokens;
      assignments += t.moe_assignments;
      dropped += t.moe_dropped;
      rerouted += t.moe_rerouted;
      json choice{{"index", i}, {"finish_reason", finish_reason(*t.terminal)}, {"logprobs", nullptr}};
      if (shape_.chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        if (shape_.logprobs) choice["logprobs"] = chat_logprobs(c.logprobs, tokenizer_);
      } else {
        choice["text"] = c.echo + c.text;
        if (shape_.logprobs) choice["logprobs"] = c.completion_logprobs.to_json();
      }
      choices.push_back(std::move(choice));
    }
    const json usage{
        {"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
    const json moe = moe_json(assignments, dropped, rerouted);
    if (shape_.stream) {
      if (shape_.include_usage) {
        const json last{{"id", shape_.id},
                        {"object", shape_.chat ? "chat.completion.chunk" : "text_completion"},
                        {"created", shape_.created},
                        {"model", shape_.model},
                        {"choices", json::array()},
                        {"usage", usage},
                        {"moe", moe}};
        out += "data: " + last.dump() + "\n\n";
      }
      out += "data: [DONE]\n\n";
      return;
    }
    const json body{{"id", shape_.id},
                    {"object", shape_.chat ? "chat.completion" : "text_completion"},
                    {"created", shape_.created},
                    {"model", shape_.model},
                    {"choices", std::move(choices)},
                    {"usage", usage},
                    {"moe", moe}};
    out = body.dump(-1, ' ', false, json::error_handler_t::replace);
  }

  RequestIntake& intake_;
  const runtime::Tokenizer* tokenizer_;
  Shape shape_;
  std::optional<RequestIntake::PeerSlot> slot_;  // held until the response is gone
  std::shared_ptr<Waker> waker_;
  std::vector<Choice> choices_;
  std::optional<IntakeError> error_;
  std::string error_type_;
  unsigned status_ = 200;
};

// The client's X-Request-Id when usable: 1..128 printable ASCII characters without spaces.
std::optional<FieldError> client_request_id(std::string_view id) {
  if (id.size() > 128)
    return FieldError{"X-Request-Id: " + std::to_string(id.size()) + " bytes exceed the limit 128",
                      "X-Request-Id"};
  for (const char ch : id) {
    if (ch < 0x21 || ch > 0x7e)
      return FieldError{"X-Request-Id: only printable ASCII characters without spaces are allowed",
                        "X-Request-Id"};
  }
  return std::nullopt;
}

}  // namespace

Response error_response(unsigned status, std::string_view message, std::string_view type,
                        std::string_view param, std::string_view code) {
  return {status, std::string(kJson),
          error_json(message, type, param, code).dump(-1, ' ', false, json::error_handler_t::replace)};
}

Response server_error_response(unsigned status, std::string_view message) {
  const char* code = status == 404 ? "not_found" : status == 405 ? "method_not_allowed" : nullptr;
  // 503: the workers' queue is full or the server drains, as the intake's own 503 says.
  return error_response(status, message, status == 503 ? "service_unavailable" : "invalid_request_error", {},
                        code == nullptr ? "" : code);
}

void require_api_key(std::map<std::string, Route, std::less<>>& routes,
                     std::shared_ptr<const security::ApiKey> key) {
  for (auto& [path, route] : routes) {
    if (path == "/health") continue;
    // Checked on the head, so that a client without the key gets no `100 Continue` and sends no body.
    route.admit = [key](const IncomingRequest& in) -> std::optional<Response> {
      if (key->accepts(in.header("authorization"))) return std::nullopt;
      Response refused = error_response(401,
                                        in.header("authorization").empty()
                                            ? "missing API key: send the header 'Authorization: Bearer KEY'"
                                            : "incorrect API key provided",
                                        "invalid_request_error", {}, "invalid_api_key");
      refused.headers.emplace_back("WWW-Authenticate", "Bearer");
      return refused;
    };
  }
}

OpenAiApi::OpenAiApi(RequestIntake& intake, OpenAiOptions options)
    : intake_(intake),
      options_(std::move(options)),
      created_(std::chrono::duration_cast<std::chrono::seconds>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}

std::map<std::string, Route, std::less<>> OpenAiApi::routes() {
  return {
      {"/v1/chat/completions",
       Route(Method::post, [this](const IncomingRequest& in) { return completions(in, true); })},
      {"/v1/completions",
       Route(Method::post, [this](const IncomingRequest& in) { return completions(in, false); })},
      {"/v1/models", [this] { return models(); }},
      {"/health", [this] { return health(); }},
      {"/version",
       [this] {
         return Response{200, std::string(kJson), json{{"version", options_.version}}.dump()};
       }},
  };
}

Response OpenAiApi::models() const {
  const ServiceLimits& limits = intake_.limits();
  const json card{{"id", limits.model_id},
                  {"object", "model"},
                  {"created", created_},
                  {"owned_by", "capserve"},
                  {"max_model_len", limits.max_context}};
  return {200, std::string(kJson), json{{"object", "list"}, {"data", json::array({card})}}.dump()};
}

Response OpenAiApi::health() const {
  if (options_.stalled && options_.stalled())
    return error_response(503, "a step stalled; the server is stopping", "service_unavailable");
  if (intake_.draining()) return error_response(503, "the server is shutting down", "service_unavailable");
  return {200, std::string(kJson), R"({"status":"ok"})"};
}

Response OpenAiApi::completions(const IncomingRequest& in, bool chat) {
  const std::string_view client_id = in.header ? in.header("X-Request-Id") : std::string_view();
  if (auto e = client_request_id(client_id))
    return intake_response(intake_.refuse({IntakeCode::invalid_argument, e->message, e->param}));
  const std::string id =
      client_id.empty() ? generate_request_id(chat ? "chatcmpl-" : "cmpl-") : std::string(client_id);
  auto with_id = [&](Response r) {
    r.headers.emplace_back("X-Request-Id", id);
    return r;
  };
  auto refuse = [&](const FieldError& e) {
    return with_id(intake_response(intake_.refuse({IntakeCode::invalid_argument, e.message, e.param})));
  };

  json body;
  if (IntakeResult bad = parse_client_json(in.body, "", body))
    return with_id(intake_response(intake_.refuse(std::move(*bad))));
  if (!body.is_object()) return refuse({"the request body must be a JSON object", ""});

  std::string model = intake_.limits().model_id;
  if (const auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return refuse({"model: must be a string", "model"});
    model = it->get<std::string>();
  }
  if (IntakeResult bad = intake_.check_model(model))
    return with_id(intake_response(intake_.refuse(std::move(*bad))));

  SamplingInput sampling;
  bool seeded = false;
  if (auto e = read_sampling(body, chat, sampling, seeded)) return refuse(*e);
  bool echo = false;
  if (auto e = read_logprobs(body, chat, sampling, echo)) return refuse(*e);
  std::int64_t n = 1;
  if (auto e = read_int(body, "n", n)) return refuse(*e);
  if (n < 1 || n > options_.max_choices)
    return refuse(
        {"n: must be in 1.." + std::to_string(options_.max_choices) + ", got " + std::to_string(n), "n"});
  Completion::Shape shape{chat, false, false, sampling.logprobs, echo, id, model, created_};
  if (auto e = read_bool(body, "stream", shape.stream)) return refuse(*e);
  if (const auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!shape.stream) return refuse({"stream_options: only allowed when stream is true", "stream_options"});
    if (!it->is_object()) return refuse({"stream_options: must be an object", "stream_options"});
    if (auto e = read_bool(*it, "include_usage", shape.include_usage))
      return refuse({"stream_options.include_usage: must be true or false", "stream_options"});
  }

  // The prompts, as token ids, and as text for an echo.
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::string> echoes;
  if (chat) {
    // Parsed again keeping key order: templates show tool schemas and arguments in the client's order.
    ordered_json ordered;
    if (IntakeResult bad = parse_client_json(in.body, "", ordered))
      return with_id(intake_response(intake_.refuse(std::move(*bad))));
    std::vector<runtime::ChatMessage> messages;
    if (auto e = read_messages(ordered, messages)) return refuse(*e);
    runtime::ChatInputs inputs;
    if (auto e = read_chat_inputs(body, ordered, inputs)) return refuse(*e);
    std::vector<std::int32_t> ids;
    if (IntakeResult bad = intake_.chat_prompt(messages, inputs, "messages", ids, in.stop)) {
      if (bad->code != IntakeCode::cancelled)
        return with_id(intake_response(intake_.refuse(std::move(*bad))));
      intake_.count_outcome(Outcome::cancelled);
      return with_id(intake_response(*bad));
    }
    prompts.push_back(std::move(ids));
  } else {
    std::vector<Prompt> raw;
    if (auto e = read_prompts(body, raw)) return refuse(*e);
    for (std::size_t i = 0; i < raw.size(); ++i) {
      const std::string field = raw.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
      std::vector<std::int32_t> ids;
      IntakeResult bad = raw[i].text ? intake_.text_prompt(*raw[i].text, field, ids)
                                     : intake_.token_prompt(raw[i].ids, field);
      if (bad) return with_id(intake_response(intake_.refuse(std::move(*bad))));
      if (echo) {
        const runtime::Tokenizer* tokenizer = intake_.tokenizer();
        echoes.push_back(raw[i].text
                             ? *raw[i].text
                             : (tokenizer == nullptr ? std::string() : tokenizer->decode(raw[i].ids, false)));
      }
      prompts.push_back(raw[i].text ? std::move(ids) : std::move(raw[i].ids));
    }
  }
  if (static_cast<std::int64_t>(prompts.size()) * n > options_.max_choices)
    return refuse({"prompt: " + std::to_string(prompts.size()) + " prompts times n=" + std::to_string(n) +
                       " exceed the limit of " + std::to_string(options_.max_choices) + " choices per call",
                   "n"});

  // The client left (or the server drains) while the prompts were prepared: nothing reaches the scheduler.
  if (in.stop.stop_requested()) {
    intake_.count_outcome(Outcome::cancelled);
    return with_id(intake_response({IntakeCode::cancelled, "the request was cancelled", {}}));
  }
  auto completion = std::make_shared<Completion>(intake_, shape);
  // Every choice is a request in flight: a call takes one slot per choice.
  if (IntakeResult refused =
          intake_.enter(in.peer, completion->slot(), static_cast<std::int64_t>(prompts.size()) * n))
    return with_id(intake_response(*refused));
  const std::uint64_t base_seed = seeded ? sampling.seed : random_seed();
  std::vector<std::shared_ptr<Request>> requests;
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    for (std::int64_t k = 0; k < n; ++k) {
      SamplingInput s = sampling;
      s.seed = base_seed + static_cast<std::uint64_t>(completion->size());
      runtime::SamplingParams params;
      std::vector<std::string> stops;
      if (IntakeResult bad =
              intake_.sampling(s, static_cast<std::int64_t>(prompts[p].size()), true, "", params, stops)) {
        if (chat && bad->param == "prompt") bad->param = "messages";
        return with_id(intake_response(intake_.refuse(std::move(*bad))));
      }
      const std::string request_id = prompts.size() * static_cast<std::size_t>(n) == 1
                                         ? id
                                         : id + "-" + std::to_string(completion->size());
      auto request = std::make_shared<Request>(request_id, prompts[p], std::move(params), std::move(stops),
                                               true, Clock::time_point::max(), in.peer);
      completion->add(request, k == 0, echo ? echoes[p] : std::string());
      requests.push_back(std::move(request));
    }
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (IntakeResult refused = intake_.submit(requests[i])) {
      completion->cancel_submitted(i);
      return with_id(intake_response(*refused));
    }
  }
  Response r{200, shape.stream ? "text/event-stream" : std::string(kJson), {}, {}, completion, shape.stream};
  return with_id(std::move(r));
}

}  // namespace capserve::server::http
