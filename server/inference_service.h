#pragma once
// The capserve.v1.Inference gRPC service on rank 0: validates each request through the shared RequestIntake
// (naming the field and the limit), hands it to the scheduler, then relays its events to the client until the
// single terminal status. A client that goes away cancels its request, whose sequence the engine frees at
// the next step.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "capserve/v1/inference.grpc.pb.h"
#include "server/request_intake.h"
#include "server/security/api_key.h"

namespace capserve::server {

class InferenceService final : public capserve::v1::Inference::Service {
 public:
  // With `api_key`, every call must carry the metadata `authorization: Bearer KEY` (else UNAUTHENTICATED).
  InferenceService(RequestIntake& intake, capserve::v1::ServerInfo info,
                   std::optional<security::ApiKey> api_key = std::nullopt);

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
  // The validated request ready for the scheduler, or what is wrong with it.
  IntakeResult make_chat(grpc::ServerContext* context, const capserve::v1::ChatRequest& request,
                         std::shared_ptr<Request>& out);
  IntakeResult make_generate(grpc::ServerContext* context, const capserve::v1::GenerateRequest& request,
                             std::shared_ptr<Request>& out);
  // A refusal as a gRPC status.
  static grpc::Status status_of(const IntakeError& error);
  grpc::Status submit(const std::shared_ptr<Request>& request);
  grpc::Status authorize(const grpc::ServerContext& context) const;
  grpc::Status enter(const grpc::ServerContext& context, std::optional<RequestIntake::PeerSlot>& slot);
  // Waits for the request's next event, cancelling it when the client has gone.
  RequestEvent next_event(grpc::ServerContext* context, Request& request);
  // Counts how a call that reached its terminal event ends, once, and returns its status.
  grpc::Status conclude(const RequestEvent& terminal);
  // A response that could not be written (the client went away): the request is cancelled, counted and
  // ended as CANCELLED.
  grpc::Status send_failed(Request& request);

  RequestIntake& intake_;
  capserve::v1::ServerInfo info_;
  std::optional<security::ApiKey> api_key_;
};

}  // namespace capserve::server
