#pragma once
// What every front end (gRPC, the OpenAI HTTP API) checks before a request reaches the scheduler, in one
// place so that both refuse the same requests with the same words: the model name, the request id, chat
// messages through the model's template, token-id and text prompts, the sampling fields, stop strings, the
// per-address in-flight limit, and the scheduler's own refusals (queue full, draining, never fits). Errors
// name the field as the front end spells it (`prefix` + name, e.g. "sampling.top_p" or "top_p") and the
// limit. Refusals are counted in the metrics and logged at most once a second.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "runtime/chat/chat_template.h"
#include "runtime/generation_config.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/request.h"
#include "server/scheduler.h"
#include "server/server_metrics.h"

namespace capserve::server {

struct ServiceLimits {
  std::string model_id;
  std::int64_t vocab_size = 0;
  std::int64_t max_context = 4096;
  std::int64_t default_max_tokens = 256;
  std::int64_t max_tokens_limit = 4096;
  std::int64_t max_stop_strings = 8;
  std::int64_t max_stop_length = 64;
  std::int64_t max_stop_token_ids = 64;
  std::int64_t max_request_id_length = 256;  // bytes; the id is echoed on every chunk
  std::int64_t max_model_length = 256;       // bytes
  // Requests in flight (queued or generating) from one client address; 0: no limit.
  std::int64_t max_requests_per_peer = 256;
  // Whether special-token text typed in chat messages (e.g. "<|endoftext|>") encodes as the control token;
  // by default it is tokenized as plain text, so a message cannot forge turns.
  bool special_tokens_in_content = false;
  std::vector<std::int32_t> eos_token_ids;
  // The sampling defaults of requests that leave a field unset (generation_config.json, as vLLM).
  runtime::GenerationDefaults generation_defaults;
};

// Why a request is refused; the codes are gRPC's, which the HTTP API maps onto its statuses.
enum class IntakeCode {
  invalid_argument,
  resource_exhausted,
  unavailable,
  failed_precondition,
  cancelled,
  deadline_exceeded,
  internal
};

struct IntakeError {
  IntakeCode code = IntakeCode::invalid_argument;
  std::string message;
  std::string param;  // the field at fault, as the front end spells it; empty when none
};

// Empty when the check passed.
using IntakeResult = std::optional<IntakeError>;

// The gRPC name of a code ("INVALID_ARGUMENT"), as the error metrics label it.
const char* code_name(IntakeCode code);

// The sampling fields of a request, whatever its wire format.
// Unset temperature / top_p / top_k take the checkpoint's generation_config.json defaults
// (ServiceLimits::generation_defaults), else greedy and no filter.
struct SamplingInput {
  std::optional<double> temperature;
  std::optional<double> top_p;        // 0 or 1: off
  std::optional<std::int64_t> top_k;  // 0: off
  std::int64_t max_tokens = 0;        // 0: the server's default
  std::uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<std::int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool logprobs = false;         // each generated token's log-probability
  bool prompt_logprobs = false;  // each prompt token's, given its prefix
  std::int64_t top_logprobs = 0;
};

// Logs lines at most once per `interval`, with the number of lines suppressed in between: a client repeating
// a bad request cannot flood the log.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(std::chrono::milliseconds interval) : interval_(interval) {}
  void log(const std::string& line);

 private:
  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  Clock::time_point last_{};
  std::int64_t suppressed_ = 0;
};

// `prefix` + 96 random bits as 24 hex digits: a request id that does not repeat across restarts, unlike a
// counter (HTTP: "chatcmpl-" / "cmpl-", gRPC: "req-").
std::string generate_request_id(std::string_view prefix);

class RequestIntake {
 public:
  RequestIntake(Scheduler& scheduler, const runtime::Tokenizer* tokenizer,
                std::optional<runtime::ChatTemplate> chat_template, ServiceLimits limits,
                ServerMetrics* metrics);

  [[nodiscard]] const ServiceLimits& limits() const { return limits_; }
  [[nodiscard]] const runtime::Tokenizer* tokenizer() const { return tokenizer_; }
  [[nodiscard]] bool draining() const { return scheduler_.draining(); }

  // model: UTF-8 and the served model (empty: the served one); the error's param is "model" (HTTP: 404).
  [[nodiscard]] IntakeResult check_model(std::string_view model) const;
  // A client-chosen request id: bounded, UTF-8 (`field` names it).
  [[nodiscard]] IntakeResult check_request_id(std::string_view id, const std::string& field) const;
  // Checks `messages` and `inputs` (roles, UTF-8, tool_calls / tool_call_id / name, the tools list, kwargs),
  // renders them through the chat template and tokenizes them; `field` names the messages array. A
  // requested `stop` (the client has gone, the server drains) cancels the render: IntakeCode::cancelled.
  // Every prompt must fit the batched tokens of one step (--max-batched-tokens); a longer one is refused
  // naming `field`.
  [[nodiscard]] IntakeResult chat_prompt(std::span<const runtime::ChatMessage> messages,
                                         const runtime::ChatInputs& inputs, const std::string& field,
                                         std::vector<std::int32_t>& ids, std::stop_token stop = {}) const;
  // A text prompt, tokenized as the model's tokenizer does (with its BOS where it adds one).
  [[nodiscard]] IntakeResult text_prompt(std::string_view text, const std::string& field,
                                         std::vector<std::int32_t>& ids) const;
  // A token-id prompt: not empty, every id in the vocabulary.
  [[nodiscard]] IntakeResult token_prompt(std::span<const std::int32_t> ids, const std::string& field) const;
  // The sampling fields for a prompt of `prompt_tokens` tokens; stop strings need `text` output.
  [[nodiscard]] IntakeResult sampling(const SamplingInput& s, std::int64_t prompt_tokens, bool text,
                                      const std::string& prefix, runtime::SamplingParams& params,
                                      std::vector<std::string>& stops) const;
  // Hands the request to the scheduler (counted and logged when refused).
  [[nodiscard]] IntakeResult submit(const std::shared_ptr<Request>& request);

  // `count` of a client address's in-flight slots, released on destruction.
  class PeerSlot {
   public:
    PeerSlot(RequestIntake& intake, std::string peer, std::int64_t count)
        : intake_(&intake), peer_(std::move(peer)), count_(count) {}
    PeerSlot(const PeerSlot&) = delete;
    PeerSlot& operator=(const PeerSlot&) = delete;
    ~PeerSlot();

   private:
    RequestIntake* intake_;
    std::string peer_;
    std::int64_t count_;
  };
  // Takes `count` slots of `peer`'s address (gRPC notation, e.g. "ipv4:10.0.0.1:5000"), one per request the
  // call submits (HTTP's n choices are n requests), or refuses (resource_exhausted) when they do not fit
  // under --max-requests-per-peer beside the address's requests in flight.
  [[nodiscard]] IntakeResult enter(const std::string& peer, std::optional<PeerSlot>& slot,
                                   std::int64_t count = 1);

  // Counts a refusal in the error metrics, logs it (rate-limited) and returns it.
  IntakeError refuse(IntakeError error);
  // Counts how a request that reached its terminal event ended.
  void conclude(const RequestEvent& terminal);
  // Counts a request whose client went away, or whose answer could not be sent.
  void count_outcome(Outcome outcome);

 private:
  Scheduler& scheduler_;
  const runtime::Tokenizer* tokenizer_;
  std::optional<runtime::ChatTemplate> chat_template_;
  ServiceLimits limits_;
  ServerMetrics* metrics_;
  std::mutex peers_mutex_;
  std::unordered_map<std::string, std::int64_t> peer_requests_;  // in flight, by client address
  RateLimitedLog refusal_log_{std::chrono::seconds(1)};
};

// A JSON document sent as a string field (gRPC's tools, tool_calls, template kwargs): UTF-8 (the error names
// the first bad byte's offset), then parse_client_json (server/client_json.h: valid JSON within the depth
// limit), object keys kept in the client's order (templates show them in that order).
IntakeResult parse_json_field(std::string_view text, const std::string& field, nlohmann::ordered_json& out);

// Client text inside an error message: at most `limit` bytes of it (cut on a character boundary), quoted.
std::string excerpt(std::string_view text, std::size_t limit = 64);

// What a terminal state means: the intake code of an error terminal (none for a normal completion) and the
// outcome the metrics count. One table, so the status a client gets and the outcome counted never disagree.
struct TerminalMeaning {
  std::optional<IntakeCode> error;
  Outcome outcome = Outcome::error;
};
TerminalMeaning meaning_of(Terminal t);

}  // namespace capserve::server
