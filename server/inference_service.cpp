#include "server/inference_service.h"

#include <cmath>
#include <string_view>

#include <spdlog/spdlog.h>

#include "runtime/tokenizer/utf8.h"

namespace capserve::server {
namespace {

namespace v1 = capserve::v1;

grpc::Status invalid(const std::string& message) {
  return {grpc::StatusCode::INVALID_ARGUMENT, message};
}

const char* code_name(grpc::StatusCode code) {
  static const char* const names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const auto i = static_cast<std::size_t>(code);
  return i < std::size(names) ? names[i] : "UNKNOWN";
}

// Client text inside an error message: at most `limit` bytes of it (cut on a character boundary).
std::string excerpt(std::string_view text, std::size_t limit = 64) {
  std::string out = "'";
  if (text.size() <= limit) return out.append(text).append("'");
  std::size_t cut = limit;
  while (cut > 0 && runtime::utf8::is_continuation(text[cut])) --cut;
  return out.append(text.substr(0, cut))
      .append("...' (")
      .append(std::to_string(text.size()))
      .append(" bytes)");
}

// The UTF-8 check of a request's text field (bytes on the wire), naming the field and the first bad byte.
grpc::Status check_utf8(std::string_view text, const std::string& field) {
  const std::size_t valid = runtime::utf8::valid_prefix_length(text);
  if (valid == text.size()) return grpc::Status::OK;
  return invalid(field + ": not valid UTF-8 (ill-formed byte at offset " + std::to_string(valid) + ")");
}

// The client's address without its port ("ipv4:10.0.0.1", "ipv6:[::1]"); other peers ("unix:...") whole.
// Limits count per address, not per connection: a client can open connections at will.
std::string peer_address(const std::string& peer) {
  if (!peer.starts_with("ipv4:") && !peer.starts_with("ipv6:")) return peer;
  const std::size_t colon = peer.rfind(':');
  return colon > 4 ? peer.substr(0, colon) : peer;
}

Clock::time_point steady_deadline(const grpc::ServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

// What a terminal state means to the API and to the metrics: one table, so the status a client gets and the
// outcome the metrics count never disagree.
struct TerminalMeaning {
  grpc::StatusCode code;
  Outcome outcome;
};

TerminalMeaning meaning_of(Terminal t) {
  switch (t) {
    case Terminal::ok_stop:
      return {grpc::StatusCode::OK, Outcome::stop};
    case Terminal::ok_length:
      return {grpc::StatusCode::OK, Outcome::length};
    case Terminal::cancelled:
      return {grpc::StatusCode::CANCELLED, Outcome::cancelled};
    case Terminal::deadline_exceeded:
      return {grpc::StatusCode::DEADLINE_EXCEEDED, Outcome::error};
    case Terminal::unavailable:
      return {grpc::StatusCode::UNAVAILABLE, Outcome::error};
    case Terminal::invalid_argument:
      return {grpc::StatusCode::INVALID_ARGUMENT, Outcome::error};
    case Terminal::internal:
      break;
  }
  return {grpc::StatusCode::INTERNAL, Outcome::error};
}

// The gRPC status of a terminal event (OK for a normal completion).
grpc::Status status_of(const RequestEvent& e) {
  const grpc::StatusCode code = meaning_of(*e.terminal).code;
  if (code == grpc::StatusCode::OK) return grpc::Status::OK;
  if (code == grpc::StatusCode::CANCELLED && e.message.empty()) return {code, "cancelled"};
  return {code, e.message};
}

v1::FinishReason finish_reason(Terminal t) {
  return t == Terminal::ok_stop ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_LENGTH;
}

template <typename Message>
void fill_final(const RequestEvent& e, Message& m) {
  m.set_finish_reason(finish_reason(*e.terminal));
  m.mutable_usage()->set_prompt_tokens(e.prompt_tokens);
  m.mutable_usage()->set_completion_tokens(e.completion_tokens);
  m.mutable_moe()->set_assignments(e.moe_assignments);
  m.mutable_moe()->set_dropped(e.moe_dropped);
  m.mutable_moe()->set_rerouted(e.moe_rerouted);
}

}  // namespace

InferenceService::InferenceService(Scheduler& scheduler, const runtime::Tokenizer* tokenizer,
                                   std::optional<runtime::ChatTemplate> chat_template, ServiceLimits limits,
                                   v1::ServerInfo info, ServerMetrics* metrics)
    : scheduler_(scheduler),
      tokenizer_(tokenizer),
      chat_template_(std::move(chat_template)),
      limits_(std::move(limits)),
      info_(std::move(info)),
      metrics_(metrics) {}

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

InferenceService::PeerSlot::~PeerSlot() {
  std::lock_guard lock(service_->peers_mutex_);
  const auto it = service_->peer_requests_.find(peer_);
  if (--it->second == 0) service_->peer_requests_.erase(it);
}

grpc::Status InferenceService::enter(const grpc::ServerContext& context, std::optional<PeerSlot>& slot) {
  std::string peer = peer_address(context.peer());
  bool admitted = false;
  {
    std::lock_guard lock(peers_mutex_);
    std::int64_t& n = peer_requests_[peer];
    if (limits_.max_requests_per_peer <= 0 || n < limits_.max_requests_per_peer) {
      ++n;
      admitted = true;
    }
  }
  if (!admitted)
    return refuse(grpc::StatusCode::RESOURCE_EXHAUSTED,
                  "too many requests in flight from " + peer + ": the limit is " +
                      std::to_string(limits_.max_requests_per_peer) +
                      " per client address (--max-requests-per-peer); retry when one ends");
  slot.emplace(*this, std::move(peer));
  return grpc::Status::OK;
}

grpc::Status InferenceService::refuse(grpc::StatusCode code, const std::string& message) {
  if (metrics_ != nullptr) metrics_->count_error(code_name(code));
  refusal_log_.log(std::string("capserve: refused a request: ") + code_name(code) + ": " + message);
  return {code, message};
}

grpc::Status InferenceService::conclude(const RequestEvent& terminal) {
  const grpc::Status status = status_of(terminal);
  if (metrics_ != nullptr) {
    const Outcome outcome = meaning_of(*terminal.terminal).outcome;
    metrics_->count_outcome(outcome);
    if (outcome == Outcome::error) metrics_->count_error(code_name(status.error_code()));
  }
  return status;
}

grpc::Status InferenceService::send_failed(grpc::ServerContext* context, Request& request) {
  request.cancel();  // the engine frees its sequence at the next step
  if (context->IsCancelled()) {
    if (metrics_ != nullptr) metrics_->count_outcome(Outcome::cancelled);
    return {grpc::StatusCode::CANCELLED, "the client went away"};
  }
  if (metrics_ != nullptr) metrics_->count_outcome(Outcome::error);
  return refuse(grpc::StatusCode::INTERNAL, "request " + request.id() + ": a response could not be sent");
}

grpc::Status InferenceService::check_sampling(const v1::SamplingOptions& s, std::int64_t prompt_tokens,
                                              bool text, runtime::SamplingParams& params,
                                              std::vector<std::string>& stops) const {
  if (!std::isfinite(s.temperature()) || s.temperature() < 0)
    return invalid("sampling.temperature: must be a finite number >= 0 (0 is greedy), got " +
                   std::to_string(s.temperature()));
  if (!std::isfinite(s.top_p()) || s.top_p() < 0 || s.top_p() > 1)
    return invalid("sampling.top_p: must be in [0, 1] (0 or 1: off), got " + std::to_string(s.top_p()));
  if (s.top_k() > static_cast<std::uint32_t>(limits_.vocab_size))
    return invalid("sampling.top_k: " + std::to_string(s.top_k()) + " exceeds the vocabulary size " +
                   std::to_string(limits_.vocab_size));
  const std::int64_t max_tokens = s.max_tokens() == 0 ? limits_.default_max_tokens : s.max_tokens();
  if (max_tokens > limits_.max_tokens_limit)
    return invalid("sampling.max_tokens: " + std::to_string(max_tokens) + " exceeds the limit " +
                   std::to_string(limits_.max_tokens_limit));
  if (prompt_tokens + 1 > limits_.max_context)
    return invalid("prompt: " + std::to_string(prompt_tokens) +
                   " tokens leave no room to generate within the context length " +
                   std::to_string(limits_.max_context));
  if (!text && s.stop_size() > 0)
    return invalid("sampling.stop: stop strings need text output; use stop_token_ids");
  if (s.stop_size() > limits_.max_stop_strings)
    return invalid("sampling.stop: " + std::to_string(s.stop_size()) + " stop strings exceed the limit " +
                   std::to_string(limits_.max_stop_strings));
  for (int i = 0; i < s.stop_size(); ++i) {
    const std::string& stop = s.stop(i);
    const std::string field = "sampling.stop[" + std::to_string(i) + "]";
    if (stop.empty() || static_cast<std::int64_t>(stop.size()) > limits_.max_stop_length)
      return invalid(field + ": must be 1.." + std::to_string(limits_.max_stop_length) + " bytes");
    if (grpc::Status bad = check_utf8(stop, field); !bad.ok()) return bad;
    stops.push_back(stop);
  }
  if (s.stop_token_ids_size() > limits_.max_stop_token_ids)
    return invalid("sampling.stop_token_ids: " + std::to_string(s.stop_token_ids_size()) +
                   " ids exceed the limit " + std::to_string(limits_.max_stop_token_ids));
  for (const std::int32_t id : s.stop_token_ids()) {
    if (id < 0 || id >= limits_.vocab_size)
      return invalid("sampling.stop_token_ids: " + std::to_string(id) + " is outside the vocabulary [0, " +
                     std::to_string(limits_.vocab_size) + ")");
  }
  params.temperature = s.temperature();
  params.top_p = s.top_p() == 0 ? 1.0F : s.top_p();
  params.top_k = static_cast<std::int32_t>(s.top_k());
  params.seed = s.seed();
  params.max_new_tokens = std::min(max_tokens, limits_.max_context - prompt_tokens);
  params.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  if (!s.ignore_eos())
    params.stop_token_ids.insert(params.stop_token_ids.end(), limits_.eos_token_ids.begin(),
                                 limits_.eos_token_ids.end());
  return grpc::Status::OK;
}

grpc::Status InferenceService::check_common(const std::string& model, const std::string& request_id) const {
  if (grpc::Status s = check_utf8(model, "model"); !s.ok()) return s;
  if (!model.empty() && model != limits_.model_id)
    return invalid("model: unknown model " + excerpt(model) + "; this server serves '" + limits_.model_id +
                   "'");
  if (static_cast<std::int64_t>(request_id.size()) > limits_.max_request_id_length)
    return invalid("request_id: " + std::to_string(request_id.size()) + " bytes exceed the limit " +
                   std::to_string(limits_.max_request_id_length));
  return check_utf8(request_id, "request_id");
}

grpc::Status InferenceService::make_chat(grpc::ServerContext* context, const v1::ChatRequest& request,
                                         std::shared_ptr<Request>& out) {
  if (grpc::Status s = check_common(request.model(), request.request_id()); !s.ok()) return s;
  if (tokenizer_ == nullptr || !chat_template_)
    return {grpc::StatusCode::FAILED_PRECONDITION,
            "this model has no tokenizer or chat template; use Generate"};
  if (request.messages().empty()) return invalid("messages: at least one message is required");
  std::vector<runtime::ChatMessage> messages;
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::ChatMessage& m = request.messages(i);
    const std::string field = "messages[" + std::to_string(i) + "]";
    if (grpc::Status s = check_utf8(m.role(), field + ".role"); !s.ok()) return s;
    if (m.role() != "system" && m.role() != "user" && m.role() != "assistant")
      return invalid(field + ".role: " + excerpt(m.role()) + " is not system, user or assistant");
    if (grpc::Status s = check_utf8(m.content(), field + ".content"); !s.ok()) return s;
    messages.push_back({m.role(), m.content()});
  }
  runtime::RenderedPrompt prompt;
  if (runtime::Status s = chat_template_->render(messages, true, prompt); !s.ok())
    return invalid("messages: " + s.message());
  // Only the template's markup yields special tokens, unless the server allows them in content too.
  const std::span<const runtime::TextRange> plain_text =
      limits_.special_tokens_in_content ? std::span<const runtime::TextRange>() : prompt.content;
  std::vector<std::int32_t> ids;
  if (runtime::Status s = tokenizer_->encode(prompt.text, false, ids, plain_text); !s.ok())
    return invalid("messages: " + s.message());
  runtime::SamplingParams params;
  std::vector<std::string> stops;
  if (grpc::Status s =
          check_sampling(request.sampling(), static_cast<std::int64_t>(ids.size()), true, params, stops);
      !s.ok())
    return s;
  std::string id =
      request.request_id().empty() ? "req-" + std::to_string(next_request_++) : request.request_id();
  out = std::make_shared<Request>(std::move(id), std::move(ids), std::move(params), std::move(stops), true,
                                  steady_deadline(*context), context->peer());
  return grpc::Status::OK;
}

grpc::Status InferenceService::make_generate(grpc::ServerContext* context, const v1::GenerateRequest& request,
                                             std::shared_ptr<Request>& out) {
  if (grpc::Status s = check_common(request.model(), request.request_id()); !s.ok()) return s;
  if (request.input_ids().empty()) return invalid("input_ids: at least one token id is required");
  for (int i = 0; i < request.input_ids_size(); ++i) {
    const std::int32_t t = request.input_ids(i);
    if (t < 0 || t >= limits_.vocab_size)
      return invalid("input_ids[" + std::to_string(i) + "]: " + std::to_string(t) +
                     " is outside the vocabulary [0, " + std::to_string(limits_.vocab_size) + ")");
  }
  std::vector<std::int32_t> ids(request.input_ids().begin(), request.input_ids().end());
  runtime::SamplingParams params;
  std::vector<std::string> stops;
  if (grpc::Status s =
          check_sampling(request.sampling(), static_cast<std::int64_t>(ids.size()), false, params, stops);
      !s.ok())
    return s;
  std::string id =
      request.request_id().empty() ? "req-" + std::to_string(next_request_++) : request.request_id();
  out = std::make_shared<Request>(std::move(id), std::move(ids), std::move(params), std::move(stops), false,
                                  steady_deadline(*context), context->peer());
  return grpc::Status::OK;
}

grpc::Status InferenceService::submit(const std::shared_ptr<Request>& request) {
  switch (scheduler_.submit(request)) {
    case Scheduler::Refusal::none:
      return grpc::Status::OK;
    case Scheduler::Refusal::queue_full:
      return refuse(grpc::StatusCode::RESOURCE_EXHAUSTED,
                    "queue full: too many waiting requests; retry later");
    case Scheduler::Refusal::draining:
      return refuse(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
    case Scheduler::Refusal::never_fits:
      return refuse(grpc::StatusCode::INVALID_ARGUMENT, scheduler_.why_never_fits(*request));
  }
  return refuse(grpc::StatusCode::INTERNAL, "unknown refusal");
}

RequestEvent InferenceService::next_event(grpc::ServerContext* context, Request& request) {
  for (;;) {
    // Checked before every event, not only when none comes for a while: a unary Chat gets an event every
    // step, so a client that went away would otherwise go unnoticed until its request ends. gRPC also cancels
    // the call when its deadline passes; that one the scheduler ends as DEADLINE_EXCEEDED by itself.
    if (context->IsCancelled() && std::chrono::system_clock::now() < context->deadline()) request.cancel();
    if (auto e = request.next(std::chrono::milliseconds(20))) return std::move(*e);
  }
}

grpc::Status InferenceService::Chat(grpc::ServerContext* context, const v1::ChatRequest* request,
                                    v1::ChatResponse* response) {
  std::optional<PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (grpc::Status s = make_chat(context, *request, req); !s.ok())
    return refuse(s.error_code(), s.error_message());
  if (grpc::Status s = submit(req); !s.ok()) return s;
  response->set_request_id(req->id());
  std::string text;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    text += e.text;
    if (!e.terminal) continue;
    const grpc::Status status = conclude(e);
    if (!status.ok()) return status;
    response->set_text(text);
    fill_final(e, *response);
    return status;
  }
}

grpc::Status InferenceService::ChatStream(grpc::ServerContext* context, const v1::ChatRequest* request,
                                          grpc::ServerWriter<v1::ChatChunk>* writer) {
  std::optional<PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (grpc::Status s = make_chat(context, *request, req); !s.ok())
    return refuse(s.error_code(), s.error_message());
  if (grpc::Status s = submit(req); !s.ok()) return s;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    if (e.terminal && !status_of(e).ok()) return conclude(e);
    v1::ChatChunk chunk;
    chunk.set_request_id(req->id());
    chunk.set_delta(e.text);
    if (e.terminal) fill_final(e, chunk);
    if (!writer->Write(chunk)) return send_failed(context, *req);
    if (e.terminal) return conclude(e);
  }
}

grpc::Status InferenceService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                        grpc::ServerWriter<v1::GenerateChunk>* writer) {
  std::optional<PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (grpc::Status s = make_generate(context, *request, req); !s.ok())
    return refuse(s.error_code(), s.error_message());
  if (grpc::Status s = submit(req); !s.ok()) return s;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    if (e.terminal && !status_of(e).ok()) return conclude(e);
    v1::GenerateChunk chunk;
    chunk.set_request_id(req->id());
    chunk.mutable_token_ids()->Add(e.tokens.begin(), e.tokens.end());
    if (e.terminal) fill_final(e, chunk);
    if (!writer->Write(chunk)) return send_failed(context, *req);
    if (e.terminal) return conclude(e);
  }
}

grpc::Status InferenceService::ListModels(grpc::ServerContext*, const v1::ListModelsRequest*,
                                          v1::ListModelsResponse* response) {
  *response->add_models() = info_.model();
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                                             v1::ServerInfo* response) {
  *response = info_;
  return grpc::Status::OK;
}

}  // namespace capserve::server
