#pragma once
// What every front end (gRPC, the OpenAI HTTP API) checks before a request reaches the scheduler, in one
// entry (RequestIntake::admit) and one order, so that both refuse the same requests with the same words: the
// model name, the request id, chat messages through the model's template, token-id and text prompts, the
// sampling fields, stop strings, the per-address in-flight limit, and the scheduler's own refusals (queue
// full, draining, never fits). Errors are runtime::Status: a gRPC code, a message naming the field as the
// front end spells it (IntakeRequest::fields, e.g. "sampling.top_p" or "top_p") and the limit, and the field.
// Refusals are counted in the metrics and logged at most once a second.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/generation_config.h"
#include "runtime/grammar/grammar_cache.h"
#include "runtime/sampler.h"
#include "runtime/status.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/intake_request.h"
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
  // Protected requests (capacity class "protected") in flight at once; 0: none is admitted. The operator's
  // cap on how much of the load may escape the capacity factor.
  std::int64_t max_protected_requests = 0;
  // Whether special-token text typed in chat messages (e.g. "<|endoftext|>") encodes as the control token;
  // by default it is tokenized as plain text, so a message cannot forge turns.
  bool special_tokens_in_content = false;
  std::vector<std::int32_t> eos_token_ids;
  // The sampling defaults of requests that leave a field unset (generation_config.json, as vLLM).
  runtime::GenerationDefaults generation_defaults;
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
  // `grammars` (optional: without it a constraint is refused) compiles requests' output constraints; the
  // rank that samples a sequence finds its grammar there.
  RequestIntake(Scheduler& scheduler, const runtime::Tokenizer* tokenizer,
                std::optional<runtime::ChatTemplate> chat_template, ServiceLimits limits,
                ServerMetrics* metrics, runtime::grammar::GrammarCache* grammars = nullptr);

  [[nodiscard]] const ServiceLimits& limits() const { return limits_; }
  [[nodiscard]] const runtime::Tokenizer* tokenizer() const { return tokenizer_; }
  [[nodiscard]] bool draining() const { return scheduler_.draining(); }

  // `count` of a client address's in-flight slots, released on destruction.
  class PeerSlot {
   public:
    PeerSlot(RequestIntake& intake, std::string address, std::int64_t count)
        : intake_(&intake), address_(std::move(address)), count_(count) {}
    PeerSlot(PeerSlot&& other) noexcept
        : intake_(std::exchange(other.intake_, nullptr)),
          address_(std::move(other.address_)),
          count_(other.count_) {}
    PeerSlot& operator=(PeerSlot&&) = delete;
    PeerSlot(const PeerSlot&) = delete;
    PeerSlot& operator=(const PeerSlot&) = delete;
    ~PeerSlot();

   private:
    RequestIntake* intake_;  // null once moved from
    std::string address_;
    std::int64_t count_;
  };

  // A request the scheduler has queued: one Request per choice (prompt-major: prompt p's n choices are
  // requests p*n .. p*n+n-1), and the client address's in-flight slots, which the front end holds until its
  // response is gone.
  struct Admitted {
    std::vector<std::shared_ptr<Request>> requests;
    PeerSlot slot;
    std::optional<PeerSlot> protected_slot;  // a protected request's place under --max-protected-requests
  };

  // Every check, in this order, then the scheduler: the model name; the request id; each prompt (chat
  // messages through the template, text through the tokenizer, token ids against the vocabulary; each must
  // fit the batched tokens of one step); the sampling fields and stop strings against each prompt; the
  // client's stop (nothing is submitted for a client that has gone); the client address's in-flight slots
  // (one per choice, --max-requests-per-peer); then each request is submitted (queue full, draining, never
  // fits), and one refused cancels those submitted before it. `listener` is set on each request before it is
  // submitted (Request::set_listener): how the front end learns of its events. A refusal is counted in the
  // metrics and logged; a cancellation is counted as a cancelled request instead.
  [[nodiscard]] runtime::StatusOr<Admitted> admit(const IntakeRequest& request,
                                                  const std::function<void()>& listener);

  // A prompt as token ids (the /tokenize route), with every check a generation request's prompt gets but the
  // engine's bound on one step's tokens: chat messages through the template, text through the tokenizer, ids
  // against the vocabulary. `add_special_tokens` (e.g. BOS) defaults as vLLM's: false for chat messages (the
  // template writes them), true for text.
  [[nodiscard]] runtime::StatusOr<std::vector<std::int32_t>> tokenize(const PromptInput& prompt,
                                                                      std::optional<bool> add_special_tokens,
                                                                      std::stop_token stop) const;

  // Counts a refusal the front end found in the wire format itself (a malformed body, a bad header) in the
  // error metrics, logs it (rate-limited) and returns it.
  runtime::Status refuse(runtime::Status error);
  // Counts how a request that reached its terminal event ended.
  void conclude(const RequestEvent& terminal);
  // Counts a request whose client went away, or whose answer could not be sent.
  void count_outcome(Outcome outcome);

 private:
  // The sampling fields for a prompt (the seed is the caller's), and its stop strings.
  struct Sampling {
    runtime::SamplingParams params;
    std::vector<std::string> stops;
  };

  // Checks and requests up to the client's stop: what admit checks before it takes slots.
  [[nodiscard]] runtime::StatusOr<std::vector<std::shared_ptr<Request>>> prepare(
      const IntakeRequest& request);
  [[nodiscard]] runtime::Status check_model(std::string_view model) const;
  [[nodiscard]] runtime::Status check_request_id(std::string_view id, const std::string& field) const;
  // A prompt as token ids, its checks passed, within one step's batched tokens.
  [[nodiscard]] runtime::StatusOr<std::vector<std::int32_t>> prompt_ids(const PromptInput& prompt,
                                                                        std::stop_token stop) const;
  // Checks the messages and inputs (roles, UTF-8, tool_calls / tool_call_id / name, the tools list, kwargs),
  // renders them through the chat template and tokenizes them. A requested `stop` cancels the render.
  [[nodiscard]] runtime::StatusOr<std::vector<std::int32_t>> chat_prompt(const ChatPrompt& chat,
                                                                         const std::string& field,
                                                                         bool add_special_tokens,
                                                                         std::stop_token stop) const;
  [[nodiscard]] runtime::StatusOr<std::vector<std::int32_t>> text_prompt(std::string_view text,
                                                                         const std::string& field,
                                                                         bool add_special_tokens) const;
  [[nodiscard]] runtime::Status token_prompt(std::span<const std::int32_t> ids,
                                             const std::string& field) const;
  [[nodiscard]] runtime::StatusOr<Sampling> sampling(const IntakeRequest& request,
                                                     std::int64_t prompt_tokens) const;
  // The request's output constraint compiled (so that its errors are the client's), as
  // SamplingParams::constraint carries it; empty without one.
  [[nodiscard]] runtime::StatusOr<std::string> constraint(const IntakeRequest& request) const;
  // Takes `count` slots of `peer`'s address (gRPC notation, e.g. "ipv4:10.0.0.1:5000"), or refuses
  // (resource_exhausted) when they do not fit under --max-requests-per-peer beside the address's requests in
  // flight.
  [[nodiscard]] runtime::StatusOr<PeerSlot> enter(const std::string& peer, std::int64_t count);
  // Takes `count` of the --max-protected-requests slots, or refuses (resource_exhausted).
  [[nodiscard]] runtime::StatusOr<PeerSlot> enter_protected(std::int64_t count);
  // `count` more in flight under `key` when they fit under `limit` (0: no limit).
  [[nodiscard]] bool take_slots(const std::string& key, std::int64_t count, std::int64_t limit);
  // Hands the request to the scheduler.
  [[nodiscard]] runtime::Status submit(const std::shared_ptr<Request>& request);

  Scheduler& scheduler_;
  const runtime::Tokenizer* tokenizer_;
  std::optional<runtime::ChatTemplate> chat_template_;
  ServiceLimits limits_;
  ServerMetrics* metrics_;
  runtime::grammar::GrammarCache* grammars_;
  std::mutex peers_mutex_;
  // In flight, by client address, and the protected requests under a key that is no address.
  std::unordered_map<std::string, std::int64_t> peer_requests_;
  RateLimitedLog refusal_log_{std::chrono::seconds(1)};
};

// A JSON document sent as a string field (gRPC's tools, tool_calls, template kwargs): UTF-8 (the error names
// the first bad byte's offset), then parse_client_json (server/client_json.h: valid JSON within the depth
// limit), object keys kept in the client's order (templates show them in that order).
runtime::StatusOr<nlohmann::ordered_json> parse_json_field(std::string_view text, const std::string& field);

// Client text inside an error message: at most `limit` bytes of it (cut on a character boundary), quoted.
std::string excerpt(std::string_view text, std::size_t limit = 64);

// What a terminal state means: the status code of an error terminal (none for a normal completion) and the
// outcome the metrics count. One table, so the status a client gets and the outcome counted never disagree.
struct TerminalMeaning {
  std::optional<runtime::StatusCode> error;
  Outcome outcome = Outcome::error;
};
TerminalMeaning meaning_of(Terminal t);

}  // namespace capserve::server
