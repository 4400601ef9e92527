#pragma once
// The capserve.v1.Inference gRPC service on rank 0: validates each request (naming the field and the limit),
// renders chat messages through the model's template and tokenizes them, hands the request to the scheduler,
// then relays its events to the client until the single terminal status. A client that goes away cancels its
// request, whose sequence the engine frees at the next step.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "capserve/v1/inference.grpc.pb.h"
#include "runtime/chat/chat_template.h"
#include "runtime/tokenizer/tokenizer.h"
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

class InferenceService final : public capserve::v1::Inference::Service {
 public:
  InferenceService(Scheduler& scheduler, const runtime::Tokenizer* tokenizer,
                   std::optional<runtime::ChatTemplate> chat_template, ServiceLimits limits,
                   capserve::v1::ServerInfo info, ServerMetrics* metrics);

  grpc::Status Chat(grpc::ServerContext* context, const capserve::v1::ChatRequest* request,
                    capserve::v1::ChatResponse* response) override;
  grpc::Status ChatStream(grpc::ServerContext* context, const capserve::v1::ChatRequest* request,
                          grpc::ServerWriter<capserve::v1::ChatChunk>* writer) override;
  grpc::Status Generate(grpc::ServerContext* context, const capserve::v1::GenerateRequest* request,
                        grpc::ServerWriter<capserve::v1::GenerateChunk>* writer) override;
  grpc::Status ListModels(grpc::ServerContext* context, const capserve::v1::ListModelsRequest* request,
                          capserve::v1::ListModelsResponse* response) override;
  grpc::Status GetServerInfo(grpc::ServerContext* context, const capserve::v1::GetServerInfoRequest* request,
                             capserve::v1::ServerInfo* response) override;

 private:
  // The validated request ready for the scheduler, or the INVALID_ARGUMENT status saying what is wrong.
  grpc::Status make_chat(grpc::ServerContext* context, const capserve::v1::ChatRequest& request,
                         std::shared_ptr<Request>& out);
  grpc::Status make_generate(grpc::ServerContext* context, const capserve::v1::GenerateRequest& request,
                             std::shared_ptr<Request>& out);
  // model and request_id: UTF-8, the served model, bounded length.
  grpc::Status check_common(const std::string& model, const std::string& request_id) const;
  grpc::Status check_sampling(const capserve::v1::SamplingOptions& s, std::int64_t prompt_tokens, bool text,
                              runtime::SamplingParams& params, std::vector<std::string>& stops) const;
  grpc::Status submit(const std::shared_ptr<Request>& request);
  // Holds one of the client address's in-flight slots for the duration of a call.
  class PeerSlot;
  grpc::Status enter(const grpc::ServerContext& context, std::optional<PeerSlot>& slot);
  // Waits for the request's next event, cancelling it when the client has gone.
  RequestEvent next_event(grpc::ServerContext* context, Request& request);
  // Counts a refusal in the error metrics and returns it.
  grpc::Status refuse(grpc::StatusCode code, const std::string& message);
  // Counts how a call that reached its terminal event ends, once, and returns its status.
  grpc::Status conclude(const RequestEvent& terminal);
  // A response that could not be written: the request is cancelled, and the call ends CANCELLED when the
  // client went away, else as an INTERNAL error.
  grpc::Status send_failed(grpc::ServerContext* context, Request& request);

  Scheduler& scheduler_;
  const runtime::Tokenizer* tokenizer_;
  std::optional<runtime::ChatTemplate> chat_template_;
  ServiceLimits limits_;
  capserve::v1::ServerInfo info_;
  ServerMetrics* metrics_;
  std::atomic<std::uint64_t> next_request_{1};
  std::mutex peers_mutex_;
  std::unordered_map<std::string, std::int64_t> peer_requests_;  // in flight, by client address
  RateLimitedLog refusal_log_{std::chrono::seconds(1)};
};

// A call's slot among its client address's in-flight requests, released when the call returns.
class InferenceService::PeerSlot {
 public:
  PeerSlot(InferenceService& service, std::string peer) : service_(&service), peer_(std::move(peer)) {}
  PeerSlot(const PeerSlot&) = delete;
  PeerSlot& operator=(const PeerSlot&) = delete;
  ~PeerSlot();

 private:
  InferenceService* service_;
  std::string peer_;
};

}  // namespace capserve::server
