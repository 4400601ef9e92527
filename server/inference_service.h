#pragma once
// The capserve.v1.Inference gRPC service on rank 0, on grpc++'s callback API: each call's protobuf becomes an
// IntakeRequest, RequestIntake::admit checks it (naming the field and the limit) and queues it, and a reactor
// relays the request's events to the client until the single terminal status. The reactor is woken by the
// request's listener (server/request.h), as an HTTP stream is, through RelayPumps' one thread, so a call in
// flight holds no thread. A client
// that goes away cancels its request at once; the engine frees its sequence at the next step.
#include <optional>

#include "capserve/v1/inference.grpc.pb.h"
#include "server/relay_pumps.h"
#include "server/request_intake.h"
#include "server/security/api_key.h"

namespace capserve::server {

class InferenceService final : public capserve::v1::Inference::CallbackService {
 public:
  // With `api_key`, every call must carry the metadata `authorization: Bearer KEY` (else UNAUTHENTICATED).
  InferenceService(RequestIntake& intake, capserve::v1::ServerInfo info,
                   std::optional<security::ApiKey> api_key = std::nullopt);

  grpc::ServerUnaryReactor* Chat(grpc::CallbackServerContext* context,
                                 const capserve::v1::ChatRequest* request,
                                 capserve::v1::ChatResponse* response) override;
  grpc::ServerWriteReactor<capserve::v1::ChatChunk>* ChatStream(
      grpc::CallbackServerContext* context, const capserve::v1::ChatRequest* request) override;
  grpc::ServerWriteReactor<capserve::v1::GenerateChunk>* Generate(
      grpc::CallbackServerContext* context, const capserve::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const capserve::v1::ListModelsRequest* request,
                                       capserve::v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const capserve::v1::GetServerInfoRequest* request,
                                          capserve::v1::ServerInfo* response) override;

 private:
  [[nodiscard]] grpc::Status authorize(const grpc::CallbackServerContext& context) const;

  RequestIntake& intake_;
  capserve::v1::ServerInfo info_;
  std::optional<security::ApiKey> api_key_;
  RelayPumps pumps_;
};

}  // namespace capserve::server
