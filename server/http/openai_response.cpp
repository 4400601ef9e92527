#include "server/http/openai_response.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "server/chat_output/openai_json.h"

namespace capserve::server::http {
namespace {

using json = nlohmann::json;
using runtime::Status;
using runtime::StatusCode;

constexpr std::string_view kJson = "application/json";

json error_json(std::string_view message, std::string_view type, std::string_view param,
                std::string_view code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
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
  // The schema requires refusal beside content; this server never refuses in-band.
  return json{{"content", std::move(content)}, {"refusal", nullptr}};
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

unsigned http_status(StatusCode code) {
  return status_response(Status{code, {}}).status;
}

const char* finish_reason(Terminal t, bool tool_calls = false) {
  if (t == Terminal::ok_stop && tool_calls) return "tool_calls";
  return t == Terminal::ok_stop ? "stop" : "length";
}

// Prompt tokens enough to spell "</think>\n\n" whatever the tokenizer (a byte-level one takes a token a
// byte).
constexpr std::size_t kThinkingTail = 16;

// A chat choice's output parser, when the call parses tool calls or reasoning: a model whose template opens
// <think> in the prompt starts inside the thinking, one that closes it there starts in the answer (the
// prompt's last tokens tell).
std::optional<chat_output::ChatOutputParser> output_parser(const ResponseShape& shape, const Request& request,
                                                           const runtime::Tokenizer* tokenizer) {
  if (!shape.chat() || (!shape.tool_calls && !shape.forced_tool && !shape.reasoning)) return std::nullopt;
  std::optional<chat_output::ReasoningParser> reasoning;
  if (shape.reasoning) {
    const std::span<const std::int32_t> prompt = request.prompt();
    const std::span<const std::int32_t> tail =
        prompt.subspan(prompt.size() - std::min<std::size_t>(prompt.size(), kThinkingTail));
    reasoning.emplace(*shape.reasoning, tokenizer == nullptr
                                            ? chat_output::PromptThinking::neither
                                            : chat_output::prompt_thinking(tokenizer->decode(tail, false)));
  }
  std::unique_ptr<chat_output::ToolCallParser> tool_calls;
  const chat_output::ToolCallOptions options{shape.parallel_tool_calls, std::random_device{}()};
  if (shape.forced_tool) {
    tool_calls = chat_output::make_forced_tool_call_parser(*shape.forced_tool, options);
  } else if (shape.tool_calls) {
    tool_calls = chat_output::make_tool_call_parser(*shape.tool_calls, options);
  }
  return chat_output::ChatOutputParser(std::move(reasoning), std::move(tool_calls));
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
    std::string echo;                                     // the prompt's text, returned before the completion
    std::int32_t first_prompt_token = -1;                 // echo with logprobs: it has no log-probability
    LogprobEntries logprobs;                              // chat, not streamed
    CompletionLogprobs completion_logprobs;               // completions
    std::optional<chat_output::ChatOutputParser> parser;  // chat: tool calls and reasoning (output_parser)
    chat_output::ChatMessageOut message;                  // chat with a parser, not streamed
  };
  Completion(RequestIntake& intake, ResponseShape shape, RequestIntake::Admitted admitted, std::int64_t n,
             std::vector<std::string> echoes, std::shared_ptr<Waker> waker)
      : intake_(intake),
        tokenizer_(intake.tokenizer()),
        shape_(std::move(shape)),
        slot_(std::move(admitted.slot)),
        waker_(std::move(waker)) {
    choices_.reserve(admitted.requests.size());
    for (std::size_t i = 0; i < admitted.requests.size(); ++i) {
      const std::size_t prompt = i / static_cast<std::size_t>(n);
      std::optional<chat_output::ChatOutputParser> parser =
          output_parser(shape_, *admitted.requests[i], tokenizer_);
      Choice c{std::move(admitted.requests[i]),
               i % static_cast<std::size_t>(n) == 0,
               {},
               false,
               std::nullopt,
               shape_.echo ? echoes[prompt] : std::string(),
               -1,
               {},
               {},
               std::move(parser),
               {}};
      if (shape_.echo && !c.request->prompt().empty()) c.first_prompt_token = c.request->prompt().front();
      choices_.push_back(std::move(c));
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
        out += "data: " + error_json(error_->message(), error_type_, "", "").dump() + "\n\ndata: [DONE]\n\n";
      } else {
        const Response r = status_response(*error_);
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
      if (const std::optional<StatusCode> code = meaning_of(*e.terminal).error) {
        // One choice failed: the call fails, and the other choices are cancelled.
        c.terminal = e;
        for (Choice& other : choices_) {
          if (other.terminal) continue;
          other.request->cancel();
          intake_.count_outcome(Outcome::cancelled);
          other.terminal = RequestEvent{};
          other.terminal->terminal = Terminal::cancelled;
        }
        error_ = Status{*code, e.message.empty() ? "the request was cancelled" : e.message};
        error_type_ = http_status(*code) >= 500 ? "server_error" : "invalid_request_error";
        return;
      }
    }
    if (shape_.logprobs && !shape_.chat()) {
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
        if (shape_.chat()) {
          out += chunk(index, json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr, std::nullopt);
        } else if (!c.echo.empty()) {
          e.text = c.echo + e.text;
        }
      }
      std::optional<chat_output::ChatDelta> parsed;
      if (c.parser) parsed = parse(c, e);
      if (parsed ? !parsed->empty() || e.terminal || e.logprobs.size() > 0 : !e.text.empty() || e.terminal) {
        json finish = e.terminal ? json(finish_reason(*e.terminal, tool_calls(c))) : json(nullptr);
        json delta = parsed          ? chat_output::delta_json(*parsed)
                     : shape_.chat() ? (e.text.empty() ? json::object() : json{{"content", e.text}})
                                     : json(e.text);
        json logprobs = nullptr;
        if (shape_.logprobs) {
          if (shape_.chat()) {
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
      if (c.parser) {
        c.message.add(parse(c, e));
      } else {
        c.text += e.text;
      }
      if (shape_.logprobs && shape_.chat()) e.logprobs.move_front(e.logprobs.size(), c.logprobs);
    }
    if (e.terminal) c.terminal = std::move(e);
  }

  // The event's text through the choice's parser (its end at the terminal event).
  static chat_output::ChatDelta parse(Choice& c, const RequestEvent& e) {
    chat_output::ChatDelta delta = c.parser->feed(e.text);
    if (e.terminal) delta.append(c.parser->finish());
    return delta;
  }

  static bool tool_calls(const Choice& c) { return c.parser && c.parser->ends_in_tool_calls(); }

  // One SSE event with one choice: a chat delta (an object) or completion text (a string).
  std::string chunk(std::size_t index, json delta, json finish, json logprobs,
                    std::optional<json> moe) const {
    json choice{{"index", index}, {"finish_reason", std::move(finish)}, {"logprobs", std::move(logprobs)}};
    if (shape_.chat()) {
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = std::move(delta);
    }
    json body{{"id", shape_.id},
              {"object", shape_.chat() ? "chat.completion.chunk" : "text_completion"},
              {"created", shape_.created},
              {"model", shape_.model},
              {"choices", json::array({std::move(choice)})}};
    if (moe) body["moe"] = std::move(*moe);
    if (shape_.include_usage) body["usage"] = nullptr;
    return "data: " + body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
  }

  void finish(std::string& out) {
    std::uint64_t prompt = 0, cached = 0, completion = 0, assignments = 0, dropped = 0, rerouted = 0;
    json choices = json::array();
    for (std::size_t i = 0; i < choices_.size(); ++i) {
      const Choice& c = choices_[i];
      const RequestEvent& t = *c.terminal;
      if (c.counts_prompt) {
        prompt += t.prompt_tokens;
        cached += t.cached_tokens;
      }
      completion += t.completion_tokens;
      assignments += t.moe_assignments;
      dropped += t.moe_dropped;
      rerouted += t.moe_rerouted;
      json choice{
          {"index", i}, {"finish_reason", finish_reason(*t.terminal, tool_calls(c))}, {"logprobs", nullptr}};
      if (shape_.chat()) {
        choice["message"] = c.parser ? chat_output::message_json(c.message, shape_.reasoning.has_value())
                                     : json{{"role", "assistant"}, {"content", c.text}};
        choice["message"]["refusal"] = nullptr;
        if (shape_.logprobs) choice["logprobs"] = chat_logprobs(c.logprobs, tokenizer_);
      } else {
        choice["text"] = c.echo + c.text;
        if (shape_.logprobs) choice["logprobs"] = c.completion_logprobs.to_json();
      }
      choices.push_back(std::move(choice));
    }
    // OpenAI's CompletionUsage: the prompt tokens the prefix cache served.
    const json usage{{"prompt_tokens", prompt},
                     {"completion_tokens", completion},
                     {"total_tokens", prompt + completion},
                     {"prompt_tokens_details", {{"cached_tokens", cached}}}};
    const json moe = moe_json(assignments, dropped, rerouted);
    if (shape_.stream) {
      if (shape_.include_usage) {
        const json last{{"id", shape_.id},
                        {"object", shape_.chat() ? "chat.completion.chunk" : "text_completion"},
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
                    {"object", shape_.chat() ? "chat.completion" : "text_completion"},
                    {"created", shape_.created},
                    {"model", shape_.model},
                    {"choices", std::move(choices)},
                    {"usage", usage},
                    {"moe", moe}};
    out = body.dump(-1, ' ', false, json::error_handler_t::replace);
  }

  RequestIntake& intake_;
  const runtime::Tokenizer* tokenizer_;
  ResponseShape shape_;
  RequestIntake::PeerSlot slot_;  // held until the response is gone
  std::shared_ptr<Waker> waker_;
  std::vector<Choice> choices_;
  std::optional<Status> error_;
  std::string error_type_;
  unsigned status_ = 200;
};

}  // namespace

void Waker::arm(std::function<void()> wake) {
  wake_ = std::move(wake);
  armed_.store(true, std::memory_order_release);
}

void Waker::operator()() const {
  if (armed_.load(std::memory_order_acquire)) wake_();
}

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

Response status_response(const Status& e) {
  switch (e.code()) {
    case StatusCode::invalid_argument:
      if (e.field() == "model" && e.message().find("unknown model") != std::string::npos)
        return error_response(404, e.message(), "invalid_request_error", e.field(), "model_not_found");
      if (e.message().find("context length") != std::string::npos)
        return error_response(400, e.message(), "invalid_request_error", e.field(),
                              "context_length_exceeded");
      return error_response(400, e.message(), "invalid_request_error", e.field());
    case StatusCode::resource_exhausted:
      return error_response(429, e.message(), "rate_limit_error", e.field(), "rate_limit_exceeded");
    case StatusCode::unavailable:
      return error_response(503, e.message(), "service_unavailable", e.field());
    case StatusCode::failed_precondition:
      return error_response(400, e.message(), "invalid_request_error", e.field());
    case StatusCode::cancelled:
      return error_response(499, e.message(), "cancelled", e.field());
    case StatusCode::deadline_exceeded:
      return error_response(504, e.message(), "timeout", e.field());
    case StatusCode::ok:  // not an error: never refused with
    case StatusCode::internal:
      break;
  }
  return error_response(500, e.message(), "server_error", e.field());
}

std::shared_ptr<Producer> completion_response(RequestIntake& intake, ResponseShape shape,
                                              RequestIntake::Admitted admitted, std::int64_t n,
                                              std::vector<std::string> echoes, std::shared_ptr<Waker> waker) {
  return std::make_shared<Completion>(intake, std::move(shape), std::move(admitted), n, std::move(echoes),
                                      std::move(waker));
}

}  // namespace capserve::server::http
