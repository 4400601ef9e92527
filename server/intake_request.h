#pragma once
// One client request as the intake sees it, whatever its wire format: each front end (the gRPC service, the
// OpenAI HTTP API) fills this from its protobuf or JSON and hands it to RequestIntake::admit, which runs
// every check in one order. What differs between the APIs is data here — the prompt's form, the spelling of
// field names in errors, how many choices — never the order of the checks.
#include <chrono>
#include <cstdint>
#include <optional>
#include <stop_token>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/sampling.h"
#include "runtime/chat/chat_template.h"
#include "server/request.h"

namespace capserve::server {

// The sampling fields of a request, whatever its wire format.
// Unset temperature / top_p / top_k take the checkpoint's generation_config.json defaults
// (ServiceLimits::generation_defaults), else IntakeRequest::unset_temperature and no filter.
struct SamplingInput {
  std::optional<double> temperature;
  std::optional<double> top_p;        // 0 or 1: off
  std::optional<std::int64_t> top_k;  // 0: off
  std::int64_t max_tokens = 0;        // 0: the server's default
  std::uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<std::int32_t> stop_token_ids;
  bool ignore_eos = false;
  std::int64_t min_tokens = 0;      // stop ids (EOS included) cannot end the output before this many tokens
  std::optional<double> min_p;      // 0: off
  double presence_penalty = 0.0;    // [-2, 2]
  double frequency_penalty = 0.0;   // [-2, 2]
  double repetition_penalty = 1.0;  // > 0; 1: off
  std::vector<kernels::LogitBias> logit_bias;  // token id -> bias in [-100, 100]
  bool logprobs = false;                       // each generated token's log-probability
  bool prompt_logprobs = false;                // each prompt token's, given its prefix
  std::int64_t top_logprobs = 0;
  // The request's capacity class (server/README.md, "Capacity classes"): "standard" (also when empty) or
  // "protected" (the capacity scheduler never drops its tokens).
  std::string capacity_class;
};

// Chat messages, rendered through the model's chat template.
struct ChatPrompt {
  std::vector<runtime::ChatMessage> messages;
  runtime::ChatInputs inputs;
};
// Text, tokenized as the model's tokenizer does (with its BOS where it adds one).
struct TextPrompt {
  std::string text;
};
// Token ids as sent: not empty, each in the vocabulary.
struct TokenPrompt {
  std::vector<std::int32_t> ids;
};

struct PromptInput {
  std::variant<ChatPrompt, TextPrompt, TokenPrompt> content;
  std::string field;  // where the client sent it: "messages", "input_ids", "prompt", "prompt[1]"
};

// How the front end spells the fields that errors name.
struct FieldNames {
  std::string request_id = "request_id";
  std::string sampling_prefix;  // before each sampling field: "sampling." (gRPC) or "" (HTTP)
  // Blamed (and named first in the message) for a prompt that leaves no room within the context length.
  std::string context = "prompt";
};

// How each choice's seed is chosen when there are several (HTTP's n, prompt lists).
enum class Seeding {
  client,  // the client's seed for the first choice, +1 for each next one
  random   // a random base for the first choice, +1 for each next one
};

// Structured output: what the generated text must be, in runtime/grammar's parse_constraint spelling
// ({"json_schema": {...}, "whitespace": "compact"}, {"regex": "..."}, ...), and the request field that asked
// for it, which its errors name ("response_format", "structured_outputs", "tool_choice").
struct ConstraintInput {
  nlohmann::ordered_json spec;
  std::string field;
};

struct IntakeRequest {
  std::string model;       // empty: the served one
  std::string request_id;  // empty: `id_prefix` + 96 random bits
  std::string id_prefix = "req-";
  std::vector<PromptInput> prompts;  // at least one; HTTP completions may send a list
  std::int64_t n = 1;                // choices per prompt: each is one Request
  SamplingInput sampling;
  std::optional<ConstraintInput> constraint;
  Seeding seeding = Seeding::client;
  // The temperature of a request that sets none when the checkpoint's generation_config.json sets none
  // either: 1 on the OpenAI API (as OpenAI and vLLM), greedy on the gRPC API (proto/README.md).
  double unset_temperature = 0.0;
  bool text_output = true;  // text deltas (chat, completions); false: token ids (Generate)
  // Special tokens the model writes spell nothing in the text (vLLM's default); false: their text, as vLLM's
  // skip_special_tokens false and its Mistral tool-call parser ([TOOL_CALLS] is a control token) have it.
  bool skip_special_tokens = true;
  FieldNames fields;
  std::string peer;  // the client's address in gRPC notation ("ipv4:10.0.0.1:5000"), for limits and logs
  Clock::time_point deadline = Clock::time_point::max();
  // Requested when the client goes away or the server drains: cancels a chat template's render and submits
  // nothing.
  std::stop_token stop;
};

}  // namespace capserve::server
