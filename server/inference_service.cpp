#include "server/inference_service.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "server/grpc_requests.h"

namespace capserve::server {
namespace {

namespace v1 = capserve::v1;
using runtime::Status;
using runtime::StatusCode;
using runtime::StatusOr;

grpc::StatusCode grpc_code(StatusCode code) {
  switch (code) {
    case StatusCode::ok:
      return grpc::StatusCode::OK;
    case StatusCode::invalid_argument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case StatusCode::resource_exhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case StatusCode::unavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case StatusCode::failed_precondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case StatusCode::cancelled:
      return grpc::StatusCode::CANCELLED;
    case StatusCode::deadline_exceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case StatusCode::internal:
      break;
  }
  return grpc::StatusCode::INTERNAL;
}

grpc::Status grpc_status(const Status& status) {
  return {grpc_code(status.code()), status.message()};
}

Clock::time_point steady_deadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

// The gRPC status of a terminal event (OK for a normal completion).
grpc::Status terminal_status(const RequestEvent& e) {
  const std::optional<StatusCode> code = meaning_of(*e.terminal).error;
  if (!code) return grpc::Status::OK;
  if (*code == StatusCode::cancelled && e.message.empty()) return {grpc::StatusCode::CANCELLED, "cancelled"};
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
  m.mutable_usage()->set_cached_prompt_tokens(e.cached_tokens);
  m.mutable_moe()->set_assignments(e.moe_assignments);
  m.mutable_moe()->set_dropped(e.moe_dropped);
  m.mutable_moe()->set_rerouted(e.moe_rerouted);
}

// What the call adds to its request: the client's address and deadline.
CallOrigin origin(const grpc::CallbackServerContext& context) {
  return {.peer = context.peer(), .deadline = steady_deadline(context)};
}

// One call's request, relayed to its client as its events come. pump() takes the events while the relay may
// (no write in flight, not finished); the pump thread (woken by the request's listener) and gRPC's reactions
// (OnWriteDone) both call it, `mutex_` lets one of them at a time, and is never held while calling into gRPC
// (a reaction may run inline). The relay owns itself until OnDone; the listener holds it weakly, so an event
// after the call ended wakes nothing.
template <typename Reactor>
class Relay : public Reactor, public RelayPumps::Pumped {
 public:
  // A relay that lives until gRPC calls OnDone (after the relay's Finish).
  template <typename Derived, typename... Args>
  static Derived* open(Args&&... args) {
    auto relay = std::make_shared<Derived>(std::forward<Args>(args)...);
    relay->self_ = relay;
    return relay.get();
  }

  Relay(RequestIntake& intake, RelayPumps& pumps, grpc::CallbackServerContext& context)
      : intake_(intake), pumps_(pumps), context_(context) {}

  // Admits the call's request, or ends the call with what is wrong with it.
  void start(StatusOr<IntakeRequest> request) {
    if (!request.ok()) return end(grpc_status(intake_.refuse(std::move(request).take_status())));
    StatusOr<RequestIntake::Admitted> admitted = intake_.admit(
        *request, [&pumps = pumps_, relay = std::weak_ptr<Pumped>(self_)] { pumps.post(relay); });
    if (!admitted.ok()) return end(grpc_status(admitted.status()));
    {
      std::lock_guard lock(mutex_);
      request_ = admitted->requests.front();
      admitted_.emplace(std::move(*admitted));
      on_admitted();
      // A client that left while its request was admitted is not seen by OnCancel, which ran before.
      if (context_.IsCancelled()) client_left();
    }
    pump();
  }

  void end(const grpc::Status& status) {
    {
      std::lock_guard lock(mutex_);
      mark_finished();
    }
    this->Finish(status);
  }

  void OnCancel() override {
    std::lock_guard lock(mutex_);
    if (request_) client_left();
  }

  void OnDone() override {
    const std::shared_ptr<Relay> last = std::move(self_);  // may destroy this on return
  }

 protected:
  // Under mutex_, once the request is admitted.
  virtual void on_admitted() {}
  // Under mutex_, before Finish: the client's in-flight slot is free before it learns that the call ended,
  // so that its next call (the moment it does) finds it free.
  void mark_finished() {
    finished_ = true;
    admitted_.reset();
  }

  RequestIntake& intake_;
  RelayPumps& pumps_;
  grpc::CallbackServerContext& context_;
  std::mutex mutex_;
  std::shared_ptr<Request> request_;  // guarded by mutex_; set once admitted
  bool finished_ = false;             // guarded by mutex_; Finish called or about to be

 private:
  // gRPC cancels the call when its deadline passes too, and the client cancels it at its own deadline, which
  // comes first by the request's transit time (more on a loaded host): a cancellation that close to the
  // deadline is the deadline passing, and ends as DEADLINE_EXCEEDED.
  void client_left() {
    constexpr auto transit_slack = std::chrono::seconds(1);
    if (std::chrono::system_clock::now() + transit_slack >= context_.deadline()) {
      request_->expire();
    } else {
      request_->cancel();
    }
  }

  std::optional<RequestIntake::Admitted> admitted_;  // the request and its in-flight slot, until finished
  std::shared_ptr<Relay> self_;
};

// Chat: the whole text and every event's log-probabilities in one response at the terminal event.
class UnaryChat final : public Relay<grpc::ServerUnaryReactor> {
 public:
  UnaryChat(RequestIntake& intake, RelayPumps& pumps, grpc::CallbackServerContext& context,
            v1::ChatResponse& response)
      : Relay(intake, pumps, context), response_(response) {}

  void pump() override {
    grpc::Status status;
    {
      std::lock_guard lock(mutex_);
      if (finished_ || !request_) return;
      while (std::optional<RequestEvent> e = request_->try_next()) {
        text_ += e->text;
        fill_logprobs(*e, intake_.tokenizer(), response_);
        if (!e->terminal) continue;
        intake_.conclude(*e);
        status = terminal_status(*e);
        if (status.ok()) {
          response_.set_text(std::move(text_));
          fill_final(*e, response_);
        }
        mark_finished();
        break;
      }
      if (!finished_) return;
    }
    Finish(status);
  }

 private:
  void on_admitted() override { response_.set_request_id(request_->id()); }

  v1::ChatResponse& response_;
  std::string text_;
};

// ChatStream and Generate: one chunk per event, one write in flight; the terminal event's chunk carries the
// finish reason, usage and MoE statistics, an error terminal ends the call with its status instead.
template <typename Chunk>
class Stream final : public Relay<grpc::ServerWriteReactor<Chunk>> {
  using Base = Relay<grpc::ServerWriteReactor<Chunk>>;

 public:
  using Base::Base;

  void OnWriteDone(bool ok) override {
    bool done = false;
    {
      std::lock_guard lock(this->mutex_);
      writing_ = false;
      done = !ok || terminal_.has_value();
      if (done) this->mark_finished();
    }
    if (!ok) return send_failed();
    if (done) {
      this->intake_.conclude(*terminal_);
      return this->Finish(terminal_status(*terminal_));
    }
    pump();
  }

  void pump() override {
    std::optional<grpc::Status> finish;
    {
      std::lock_guard lock(this->mutex_);
      if (writing_ || this->finished_ || !this->request_) return;
      std::optional<RequestEvent> e = this->request_->try_next();
      if (!e) return;
      if (e->terminal && !terminal_status(*e).ok()) {
        this->intake_.conclude(*e);
        finish = terminal_status(*e);
        this->mark_finished();
      } else {
        chunk_.Clear();
        chunk_.set_request_id(this->request_->id());
        if constexpr (std::is_same_v<Chunk, v1::ChatChunk>) {
          chunk_.set_delta(std::move(e->text));
          fill_logprobs(*e, this->intake_.tokenizer(), chunk_);
        } else {
          chunk_.mutable_token_ids()->Add(e->tokens.begin(), e->tokens.end());
          fill_logprobs(*e, nullptr, chunk_);
        }
        if (e->terminal) {
          fill_final(*e, chunk_);
          terminal_ = std::move(e);
        }
        writing_ = true;
      }
    }
    if (finish) return this->Finish(*finish);
    this->StartWrite(&chunk_);
  }

 private:
  // A chunk that could not be written: the client went away (a write fails only once the call is over;
  // IsCancelled() may not say so yet, which once counted it as INTERNAL). The request is cancelled, counted
  // and ended as CANCELLED.
  void send_failed() {
    this->request_->cancel();  // the engine frees its sequence at the next step
    this->intake_.count_outcome(Outcome::cancelled);
    this->Finish({grpc::StatusCode::CANCELLED, "the client went away"});
  }

  Chunk chunk_;                           // the write in flight
  bool writing_ = false;                  // guarded by mutex_
  std::optional<RequestEvent> terminal_;  // sent with the write in flight
};

}  // namespace

InferenceService::InferenceService(RequestIntake& intake, v1::ServerInfo info,
                                   std::optional<security::ApiKey> api_key)
    : intake_(intake), info_(std::move(info)), api_key_(std::move(api_key)) {}

grpc::Status InferenceService::authorize(const grpc::CallbackServerContext& context) const {
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

grpc::ServerUnaryReactor* InferenceService::Chat(grpc::CallbackServerContext* context,
                                                 const v1::ChatRequest* request, v1::ChatResponse* response) {
  auto* relay = UnaryChat::open<UnaryChat>(intake_, pumps_, *context, *response);
  if (grpc::Status refused = authorize(*context); !refused.ok()) {
    relay->end(refused);
  } else {
    relay->start(chat_intake_request(*request, origin(*context)));
  }
  return relay;
}

grpc::ServerWriteReactor<v1::ChatChunk>* InferenceService::ChatStream(grpc::CallbackServerContext* context,
                                                                      const v1::ChatRequest* request) {
  using ChatStream = Stream<v1::ChatChunk>;
  auto* relay = ChatStream::open<ChatStream>(intake_, pumps_, *context);
  if (grpc::Status refused = authorize(*context); !refused.ok()) {
    relay->end(refused);
  } else {
    relay->start(chat_intake_request(*request, origin(*context)));
  }
  return relay;
}

grpc::ServerWriteReactor<v1::GenerateChunk>* InferenceService::Generate(grpc::CallbackServerContext* context,
                                                                        const v1::GenerateRequest* request) {
  using GenerateStream = Stream<v1::GenerateChunk>;
  auto* relay = GenerateStream::open<GenerateStream>(intake_, pumps_, *context);
  if (grpc::Status refused = authorize(*context); !refused.ok()) {
    relay->end(refused);
  } else {
    relay->start(generate_intake_request(*request, origin(*context)));
  }
  return relay;
}

grpc::ServerUnaryReactor* InferenceService::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest*,
                                                       v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const grpc::Status status = authorize(*context);
  if (status.ok()) *response->add_models() = info_.model();
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::ServerInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const grpc::Status status = authorize(*context);
  if (status.ok()) *response = info_;
  reactor->Finish(status);
  return reactor;
}

}  // namespace capserve::server
