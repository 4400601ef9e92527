#pragma once
// The gRPC API's requests as the intake sees them: one protocol-neutral IntakeRequest each, with the JSON
// string fields of a ChatRequest (tools, chat_template_kwargs, tool_calls) parsed here, naming the field on
// error, and sampling fields spelt "sampling.*". Independent of a live call, so that the fuzz target drives
// it too.
#include <string>

#include "capserve/v1/inference.pb.h"
#include "runtime/status.h"
#include "server/intake_request.h"

namespace capserve::server {

// What the call adds: the client's address (gRPC's peer string) and its deadline on this host's clock.
struct CallOrigin {
  std::string peer;
  Clock::time_point deadline = Clock::time_point::max();
};

[[nodiscard]] runtime::StatusOr<IntakeRequest> chat_intake_request(const capserve::v1::ChatRequest& request,
                                                                   CallOrigin origin);
[[nodiscard]] runtime::StatusOr<IntakeRequest> generate_intake_request(
    const capserve::v1::GenerateRequest& request, CallOrigin origin);

}  // namespace capserve::server
