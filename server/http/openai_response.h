#pragma once
// The OpenAI API's response side: a call's requests' events into OpenAI's JSON — one response once every
// choice has ended, or Server-Sent Events chunks as they come — with the request's MoE statistics as the
// extra field "moe"; and errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"
#include "server/http/http_server.h"
#include "server/http/openai_request.h"
#include "server/request_intake.h"

namespace capserve::server::http {

// An error in OpenAI's shape with its HTTP status; `param` null when empty.
Response error_response(unsigned status, std::string_view message, std::string_view type,
                        std::string_view param = {}, std::string_view code = {});

// The server's own refusals (unknown path, method, oversized head or body, malformed HTTP, no worker free,
// draining) in OpenAI's shape: Options::error_response of the API's port.
Response server_error_response(unsigned status, std::string_view message);

// A refusal (the intake's, or the wire format's) over HTTP: its status (400, 404 for an unknown model, 429,
// 499 for a client that left, 503, 504, 500) and OpenAI's error, `param` its field.
Response status_response(const runtime::Status& status);

// Wakes a connection from the engine loop's thread once the connection has armed it; before, it does nothing
// (the connection polls once when it arms, so no event is missed). Each request's listener calls it.
class Waker {
 public:
  void arm(std::function<void()> wake);
  void operator()() const;

 private:
  std::function<void()> wake_;
  std::atomic<bool> armed_{false};
};

// The response of one call: its choices (`admitted`'s requests, prompt-major, `n` per prompt) whole once
// every choice has ended, or as SSE chunks as their events come. `echoes`: each prompt's text when the call
// echoes them; `waker`: the one every request's listener calls. It holds the call's in-flight slots until it
// is gone.
std::shared_ptr<Producer> completion_response(RequestIntake& intake, ResponseShape shape,
                                              RequestIntake::Admitted admitted, std::int64_t n,
                                              std::vector<std::string> echoes, std::shared_ptr<Waker> waker);

}  // namespace capserve::server::http
