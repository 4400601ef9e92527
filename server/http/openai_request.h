#pragma once
// The OpenAI API's request side: a POST body to /v1/chat/completions or /v1/completions (and the
// X-Request-Id header) into the protocol-neutral IntakeRequest, plus what the response's shape needs (stream,
// usage chunk, echo, logprobs). Only the wire format is checked here — types, OpenAI's field rules and
// ranges that exist only in this API (n, echo, stream_options, penalties); every check both APIs share is
// RequestIntake::admit's. Errors are INVALID_ARGUMENT naming the body's field as the client spelt it.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"
#include "server/chat_output/chat_output_parser.h"
#include "server/chat_output/forced_tool_calls.h"
#include "server/intake_request.h"

namespace capserve::server::http {

enum class Endpoint { chat, completions };

// How the response is shaped, besides its choices.
struct ResponseShape {
  Endpoint endpoint = Endpoint::chat;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  bool logprobs = false;
  bool echo = false;  // completions: the prompt comes back before the completion
  std::string id;     // the response's id: the X-Request-Id
  std::string model;
  std::int64_t created = 0;
  // Chat: the tool-call format to parse the output with (the request offers tools with tool_choice "auto"),
  // whether more than one call is kept (parallel_tool_calls), and the reasoning format (the server's).
  std::optional<chat_output::ToolCallFormat> tool_calls;
  // tool_choice "required" or a named function: the output is the calls, constrained (forced_tool_calls.h).
  std::optional<chat_output::ForcedToolChoice> forced_tool;
  bool parallel_tool_calls = true;
  std::optional<chat_output::ReasoningFormat> reasoning;

  [[nodiscard]] bool chat() const { return endpoint == Endpoint::chat; }
};

struct CompletionCall {
  IntakeRequest intake;
  ResponseShape shape;
};

// The client's X-Request-Id when usable (1..128 printable ASCII characters without spaces), or a new one
// ("chatcmpl-" / "cmpl-" and 96 random bits) when it sent none.
runtime::StatusOr<std::string> response_id(std::string_view header, Endpoint endpoint);

struct ParseOptions {
  std::string served_model;       // the model field's default
  std::int64_t max_choices = 64;  // n times the number of prompts
  std::int64_t created = 0;       // the response's "created"
  // The server's output parsers (--tool-call-parser, --reasoning-parser).
  chat_output::ChatOutputFormats formats;
};

// The call `body` asks for, with `id` as its request id.
runtime::StatusOr<CompletionCall> parse_completion(std::string_view body, Endpoint endpoint, std::string id,
                                                   const ParseOptions& options);

// POST /tokenize (vLLM's): a text prompt, or chat messages with vLLM's chat fields, into token ids.
struct TokenizeCall {
  std::string model;  // empty: not sent
  PromptInput prompt;
  std::optional<bool> add_special_tokens;  // unset: vLLM's default (RequestIntake::tokenize)
  bool return_token_strs = false;          // also each token as tokenizer.json spells it
};
runtime::StatusOr<TokenizeCall> parse_tokenize(std::string_view body,
                                               const chat_output::ChatOutputFormats& formats);

// POST /detokenize (vLLM's): token ids into text.
struct DetokenizeCall {
  std::string model;  // empty: not sent
  std::vector<std::int32_t> tokens;
};
runtime::StatusOr<DetokenizeCall> parse_detokenize(std::string_view body);

}  // namespace capserve::server::http
