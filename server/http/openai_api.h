#pragma once
// The OpenAI-compatible HTTP API on rank 0, beside gRPC and from the same scheduler: POST
// /v1/chat/completions and /v1/completions (whole, or streamed as Server-Sent Events), GET /v1/models and
// /v1/models/{id}, vLLM's POST /tokenize and /detokenize, /health and /version. The routes' glue: a body
// becomes an IntakeRequest (openai_request.h), which the shared RequestIntake admits (so both APIs refuse
// alike), and the requests' events become OpenAI's responses and chunks (openai_response.h).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "server/http/http_server.h"
#include "server/http/openai_request.h"
#include "server/http/openai_response.h"
#include "server/request_intake.h"
#include "server/security/api_key.h"

namespace capserve::server::http {

struct OpenAiOptions {
  std::string version;                          // GET /version
  std::int64_t max_choices = 64;                // n times the number of prompts, per call
  std::function<bool()> stalled = {};           // the step watchdog fired: /health answers 503
  chat_output::ChatOutputFormats formats = {};  // how chat output is parsed (tool calls, reasoning)
};

// Puts every route but /health behind the key (Route::admit): a request without `Authorization: Bearer KEY`
// gets 401 in
// OpenAI's shape (code "invalid_api_key") and a WWW-Authenticate header. /health stays open because load
// balancers and orchestrators probe it without credentials, and it tells nothing but up or down.
void require_api_key(std::map<std::string, Route, std::less<>>& routes,
                     std::shared_ptr<const security::ApiKey> key);

class OpenAiApi {
 public:
  OpenAiApi(RequestIntake& intake, OpenAiOptions options);

  // The API's routes, to serve beside others (e.g. /metrics).
  std::map<std::string, Route, std::less<>> routes();

 private:
  Response completions(const IncomingRequest& in, Endpoint endpoint);
  nlohmann::json model_card() const;
  Response models() const;
  // GET /v1/models/{id}: the served model's card, or 404 in OpenAI's shape.
  Response model(const IncomingRequest& in) const;
  Response health() const;
  // vLLM's POST /tokenize and /detokenize: a prompt (text, or chat messages through the template) into token
  // ids, and token ids into text.
  Response tokenize(const IncomingRequest& in);
  Response detokenize(const IncomingRequest& in);
  // An unset model (empty) or the served one.
  runtime::Status check_model(const std::string& model) const;

  RequestIntake& intake_;
  OpenAiOptions options_;
  std::int64_t created_;  // the models' "created": the server's start, in Unix seconds
};

}  // namespace capserve::server::http
