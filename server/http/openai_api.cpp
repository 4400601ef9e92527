#include "server/http/openai_api.h"

#include <chrono>
#include <memory>
#include <utility>
#include <variant>
#include <vector>

namespace capserve::server::http {
namespace {

using json = nlohmann::json;
using runtime::Status;
using runtime::StatusOr;

constexpr std::string_view kJson = "application/json";

// An echoed prompt's text: the text sent, or its token ids decoded (the ids are checked by then).
std::string echo_text(const PromptInput& prompt, const runtime::Tokenizer* tokenizer) {
  if (const auto* text = std::get_if<TextPrompt>(&prompt.content)) return text->text;
  if (tokenizer == nullptr) return {};
  return tokenizer->decode(std::get<TokenPrompt>(prompt.content).ids, false);
}

}  // namespace

void require_api_key(std::map<std::string, Route, std::less<>>& routes,
                     std::shared_ptr<const security::ApiKey> key) {
  for (auto& [path, route] : routes) {
    if (path == "/health") continue;
    // Checked on the head, so that a client without the key gets no `100 Continue` and sends no body.
    route.admit = [key](const IncomingRequest& in) -> std::optional<Response> {
      if (key->accepts(in.header("authorization"))) return std::nullopt;
      Response refused = error_response(401,
                                        in.header("authorization").empty()
                                            ? "missing API key: send the header 'Authorization: Bearer KEY'"
                                            : "incorrect API key provided",
                                        "invalid_request_error", {}, "invalid_api_key");
      refused.headers.emplace_back("WWW-Authenticate", "Bearer");
      return refused;
    };
  }
}

OpenAiApi::OpenAiApi(RequestIntake& intake, OpenAiOptions options)
    : intake_(intake),
      options_(std::move(options)),
      created_(std::chrono::duration_cast<std::chrono::seconds>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}

std::map<std::string, Route, std::less<>> OpenAiApi::routes() {
  return {
      {"/v1/chat/completions",
       Route(Method::post, [this](const IncomingRequest& in) { return completions(in, Endpoint::chat); })},
      {"/v1/completions",
       Route(Method::post,
             [this](const IncomingRequest& in) { return completions(in, Endpoint::completions); })},
      {"/v1/models", [this] { return models(); }},
      {"/health", [this] { return health(); }},
      {"/version",
       [this] {
         return Response{200, std::string(kJson), json{{"version", options_.version}}.dump()};
       }},
  };
}

Response OpenAiApi::models() const {
  const ServiceLimits& limits = intake_.limits();
  const json card{{"id", limits.model_id},
                  {"object", "model"},
                  {"created", created_},
                  {"owned_by", "capserve"},
                  {"max_model_len", limits.max_context}};
  return {200, std::string(kJson), json{{"object", "list"}, {"data", json::array({card})}}.dump()};
}

Response OpenAiApi::health() const {
  if (options_.stalled && options_.stalled())
    return error_response(503, "a step stalled; the server is stopping", "service_unavailable");
  if (intake_.draining()) return error_response(503, "the server is shutting down", "service_unavailable");
  return {200, std::string(kJson), R"({"status":"ok"})"};
}

Response OpenAiApi::completions(const IncomingRequest& in, Endpoint endpoint) {
  StatusOr<std::string> id =
      response_id(in.header ? in.header("X-Request-Id") : std::string_view(), endpoint);
  if (!id.ok()) return status_response(intake_.refuse(std::move(id).take_status()));
  auto with_id = [&](Response r) {
    r.headers.emplace_back("X-Request-Id", *id);
    return r;
  };
  StatusOr<CompletionCall> call = parse_completion(in.body, endpoint, *id,
                                                   {.served_model = intake_.limits().model_id,
                                                    .max_choices = options_.max_choices,
                                                    .created = created_,
                                                    .formats = options_.formats});
  if (!call.ok()) return with_id(status_response(intake_.refuse(std::move(call).take_status())));
  IntakeRequest& request = call->intake;
  request.peer = in.peer;
  request.stop = in.stop;
  auto waker = std::make_shared<Waker>();
  StatusOr<RequestIntake::Admitted> admitted = intake_.admit(request, [waker] { (*waker)(); });
  if (!admitted.ok()) return with_id(status_response(admitted.status()));
  std::vector<std::string> echoes;
  if (call->shape.echo) {
    for (const PromptInput& prompt : request.prompts)
      echoes.push_back(echo_text(prompt, intake_.tokenizer()));
  }
  const bool stream = call->shape.stream;
  return with_id({200,
                  stream ? "text/event-stream" : std::string(kJson),
                  {},
                  {},
                  completion_response(intake_, std::move(call->shape), std::move(*admitted), request.n,
                                      std::move(echoes), std::move(waker)),
                  stream});
}

}  // namespace capserve::server::http
