#include "server/inference_service.h"

#include <utility>

namespace capserve::server {
namespace {

namespace v1 = capserve::v1;

grpc::StatusCode grpc_code(IntakeCode code) {
  switch (code) {
    case IntakeCode::invalid_argument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case IntakeCode::resource_exhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case IntakeCode::unavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case IntakeCode::failed_precondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case IntakeCode::cancelled:
      return grpc::StatusCode::CANCELLED;
    case IntakeCode::deadline_exceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case IntakeCode::internal:
      break;
  }
  return grpc::StatusCode::INTERNAL;
}

Clock::time_point steady_deadline(const grpc::ServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

// The gRPC status of a terminal event (OK for a normal completion).
grpc::Status terminal_status(const RequestEvent& e) {
  const std::optional<IntakeCode> code = meaning_of(*e.terminal).error;
  if (!code) return grpc::Status::OK;
  if (*code == IntakeCode::cancelled && e.message.empty()) return {grpc::StatusCode::CANCELLED, "cancelled"};
  return {grpc_code(*code), e.message};
}

v1::FinishReason finish_reason(Terminal t) {
  return t == Terminal::ok_stop ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_LENGTH;
}

// The event's log-probability entries into a response's repeated fields, with each token's text for Chat.
void fill_logprobs(const LogprobEntries& entries, const runtime::Tokenizer* tokenizer,
                   google::protobuf::RepeatedPtrField<v1::TokenLogprob>& out) {
  const auto text = [&](std::int32_t id) {
    return tokenizer == nullptr ? std::string() : tokenizer->decode(std::span(&id, 1), true);
  };
  for (std::size_t i = 0; i < entries.size(); ++i) {
    v1::TokenLogprob& entry = *out.Add();
    entry.set_token_id(entries.tokens[i]);
    entry.set_token(text(entries.tokens[i]));
    entry.set_logprob(entries.logprobs[i]);
    for (const TopLogprob& alt : entries.alternatives(i)) {
      v1::TopLogprob& top = *entry.add_top_logprobs();
      top.set_token_id(alt.token);
      top.set_token(text(alt.token));
      top.set_logprob(alt.logprob);
    }
  }
}

template <typename Message>
void fill_logprobs(const RequestEvent& e, const runtime::Tokenizer* tokenizer, Message& m) {
  fill_logprobs(e.logprobs, tokenizer, *m.mutable_logprobs());
  fill_logprobs(e.prompt_logprobs, tokenizer, *m.mutable_prompt_logprobs());
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

SamplingInput sampling_input(const v1::SamplingOptions& s) {
  SamplingInput in;
  if (s.has_temperature()) in.temperature = s.temperature();
  if (s.has_top_p()) in.top_p = s.top_p();
  if (s.has_top_k()) in.top_k = s.top_k();
  in.max_tokens = s.max_tokens();
  in.seed = s.seed();
  in.stop.assign(s.stop().begin(), s.stop().end());
  in.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  in.ignore_eos = s.ignore_eos();
  in.logprobs = s.logprobs();
  in.prompt_logprobs = s.prompt_logprobs();
  in.top_logprobs = s.top_logprobs();
  return in;
}

}  // namespace

InferenceService::InferenceService(RequestIntake& intake, v1::ServerInfo info,
                                   std::optional<security::ApiKey> api_key)
    : intake_(intake), info_(std::move(info)), api_key_(std::move(api_key)) {}

grpc::Status InferenceService::authorize(const grpc::ServerContext& context) const {
  if (!api_key_) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  if (found != metadata.end() &&
      api_key_->accepts(std::string_view(found->second.data(), found->second.size())))
    return grpc::Status::OK;
  return {grpc::StatusCode::UNAUTHENTICATED,
          found == metadata.end() ? "missing API key: send the metadata 'authorization: Bearer KEY'"
                                  : "invalid API key"};
}

grpc::Status InferenceService::status_of(const IntakeError& error) {
  return {grpc_code(error.code), error.message};
}

grpc::Status InferenceService::enter(const grpc::ServerContext& context,
                                     std::optional<RequestIntake::PeerSlot>& slot) {
  if (grpc::Status s = authorize(context); !s.ok()) return s;
  if (IntakeResult refused = intake_.enter(context.peer(), slot)) return status_of(*refused);
  return grpc::Status::OK;
}

grpc::Status InferenceService::submit(const std::shared_ptr<Request>& request) {
  if (IntakeResult refused = intake_.submit(request)) return status_of(*refused);
  return grpc::Status::OK;
}

grpc::Status InferenceService::conclude(const RequestEvent& terminal) {
  intake_.conclude(terminal);
  return terminal_status(terminal);
}

grpc::Status InferenceService::send_failed(Request& request) {
  request.cancel();  // the engine frees its sequence at the next step
  // A synchronous stream's Write fails only once the call is over, i.e. the client went away; IsCancelled()
  // may not say so yet (gRPC learns of the cancellation asynchronously), which once counted it as INTERNAL.
  intake_.count_outcome(Outcome::cancelled);
  return {grpc::StatusCode::CANCELLED, "the client went away"};
}

IntakeResult InferenceService::make_chat(grpc::ServerContext* context, const v1::ChatRequest& request,
                                         std::shared_ptr<Request>& out) {
  if (IntakeResult bad = intake_.check_model(request.model())) return bad;
  if (IntakeResult bad = intake_.check_request_id(request.request_id(), "request_id")) return bad;
  std::vector<runtime::ChatMessage> messages;
  messages.reserve(static_cast<std::size_t>(request.messages_size()));
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::ChatMessage& m = request.messages(i);
    const std::string at = "messages[" + std::to_string(i) + "]";
    runtime::ChatMessage message{m.role(), m.content()};
    if (!m.tool_calls().empty()) {
      nlohmann::ordered_json calls;
      if (IntakeResult bad = parse_json_field(m.tool_calls(), at + ".tool_calls", calls)) return bad;
      message.fields["tool_calls"] = std::move(calls);
      if (m.content().empty()) {
        message.content.reset();
        message.fields["content"] = nullptr;
      }
    }
    if (!m.tool_call_id().empty()) message.fields["tool_call_id"] = m.tool_call_id();
    if (!m.name().empty()) message.fields["name"] = m.name();
    messages.push_back(std::move(message));
  }
  runtime::ChatInputs inputs;
  if (request.has_add_generation_prompt()) inputs.add_generation_prompt = request.add_generation_prompt();
  if (!request.tools().empty()) {
    if (IntakeResult bad = parse_json_field(request.tools(), "tools", inputs.tools)) return bad;
  }
  if (!request.chat_template_kwargs().empty()) {
    if (IntakeResult bad =
            parse_json_field(request.chat_template_kwargs(), "chat_template_kwargs", inputs.kwargs))
      return bad;
  }
  std::vector<std::int32_t> ids;
  if (IntakeResult bad = intake_.chat_prompt(messages, inputs, "messages", ids)) return bad;
  runtime::SamplingParams params;
  std::vector<std::string> stops;
  if (IntakeResult bad =
          intake_.sampling(sampling_input(request.sampling()), static_cast<std::int64_t>(ids.size()), true,
                           "sampling.", params, stops))
    return bad;
  std::string id = request.request_id().empty() ? generate_request_id("req-") : request.request_id();
  out = std::make_shared<Request>(std::move(id), std::move(ids), std::move(params), std::move(stops), true,
                                  steady_deadline(*context), context->peer());
  return std::nullopt;
}

IntakeResult InferenceService::make_generate(grpc::ServerContext* context, const v1::GenerateRequest& request,
                                             std::shared_ptr<Request>& out) {
  if (IntakeResult bad = intake_.check_model(request.model())) return bad;
  if (IntakeResult bad = intake_.check_request_id(request.request_id(), "request_id")) return bad;
  std::vector<std::int32_t> ids(request.input_ids().begin(), request.input_ids().end());
  if (IntakeResult bad = intake_.token_prompt(ids, "input_ids")) return bad;
  runtime::SamplingParams params;
  std::vector<std::string> stops;
  if (IntakeResult bad =
          intake_.sampling(sampling_input(request.sampling()), static_cast<std::int64_t>(ids.size()), false,
                           "sampling.", params, stops))
    return bad;
  std::string id = request.request_id().empty() ? generate_request_id("req-") : request.request_id();
  out = std::make_shared<Request>(std::move(id), std::move(ids), std::move(params), std::move(stops), false,
                                  steady_deadline(*context), context->peer());
  return std::nullopt;
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
  std::optional<RequestIntake::PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (IntakeResult bad = make_chat(context, *request, req)) return status_of(intake_.refuse(std::move(*bad)));
  if (grpc::Status s = submit(req); !s.ok()) return s;
  response->set_request_id(req->id());
  std::string text;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    text += e.text;
    fill_logprobs(e, intake_.tokenizer(), *response);
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
  std::optional<RequestIntake::PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (IntakeResult bad = make_chat(context, *request, req)) return status_of(intake_.refuse(std::move(*bad)));
  if (grpc::Status s = submit(req); !s.ok()) return s;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    if (e.terminal && !terminal_status(e).ok()) return conclude(e);
    v1::ChatChunk chunk;
    chunk.set_request_id(req->id());
    chunk.set_delta(e.text);
    fill_logprobs(e, intake_.tokenizer(), chunk);
    if (e.terminal) fill_final(e, chunk);
    if (!writer->Write(chunk)) return send_failed(*req);
    if (e.terminal) return conclude(e);
  }
}

grpc::Status InferenceService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                        grpc::ServerWriter<v1::GenerateChunk>* writer) {
  std::optional<RequestIntake::PeerSlot> slot;
  if (grpc::Status s = enter(*context, slot); !s.ok()) return s;
  std::shared_ptr<Request> req;
  if (IntakeResult bad = make_generate(context, *request, req))
    return status_of(intake_.refuse(std::move(*bad)));
  if (grpc::Status s = submit(req); !s.ok()) return s;
  for (;;) {
    RequestEvent e = next_event(context, *req);
    if (e.terminal && !terminal_status(e).ok()) return conclude(e);
    v1::GenerateChunk chunk;
    chunk.set_request_id(req->id());
    chunk.mutable_token_ids()->Add(e.tokens.begin(), e.tokens.end());
    fill_logprobs(e, nullptr, chunk);
    if (e.terminal) fill_final(e, chunk);
    if (!writer->Write(chunk)) return send_failed(*req);
    if (e.terminal) return conclude(e);
  }
}

grpc::Status InferenceService::ListModels(grpc::ServerContext* context, const v1::ListModelsRequest*,
                                          v1::ListModelsResponse* response) {
  if (grpc::Status s = authorize(*context); !s.ok()) return s;
  *response->add_models() = info_.model();
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest*,
                                             v1::ServerInfo* response) {
  if (grpc::Status s = authorize(*context); !s.ok()) return s;
  *response = info_;
  return grpc::Status::OK;
}

}  // namespace capserve::server
