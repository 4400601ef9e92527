#include "server/http/openai_api.h"

#include <charconv>
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

std::int64_t unix_seconds_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// RFC 3986 percent-decoding of a path segment (a model id such as "org/name" may arrive as "org%2Fname");
// nullopt when an escape is malformed.
std::optional<std::string> percent_decoded(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    unsigned value = 0;
    if (i + 2 >= text.size()) return std::nullopt;
    const auto [end, error] = std::from_chars(text.data() + i + 1, text.data() + i + 3, value, 16);
    if (error != std::errc() || end != text.data() + i + 3) return std::nullopt;
    out += static_cast<char>(value);
    i += 2;
  }
  return out;
}

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
    : intake_(intake), options_(std::move(options)), created_(unix_seconds_now()) {}

std::map<std::string, Route, std::less<>> OpenAiApi::routes() {
  return {
      {"/v1/chat/completions",
       Route(Method::post, [this](const IncomingRequest& in) { return completions(in, Endpoint::chat); })},
      {"/v1/completions",
       Route(Method::post,
             [this](const IncomingRequest& in) { return completions(in, Endpoint::completions); })},
      {"/v1/models", [this] { return models(); }},
      {"/v1/models/", Route(Method::get, [this](const IncomingRequest& in) { return model(in); })},
      {"/tokenize", Route(Method::post, [this](const IncomingRequest& in) { return tokenize(in); })},
      {"/detokenize", Route(Method::post, [this](const IncomingRequest& in) { return detokenize(in); })},
      {"/health", [this] { return health(); }},
      {"/version",
       [this] {
         return Response{200, std::string(kJson), json{{"version", options_.version}}.dump()};
       }},
  };
}

json OpenAiApi::model_card() const {
  const ServiceLimits& limits = intake_.limits();
  return {{"id", limits.model_id},
          {"object", "model"},
          {"created", created_},
          {"owned_by", "capserve"},
          {"max_model_len", limits.max_context}};
}

Response OpenAiApi::models() const {
  return {200, std::string(kJson), json{{"object", "list"}, {"data", json::array({model_card()})}}.dump()};
}

Response OpenAiApi::model(const IncomingRequest& in) const {
  constexpr std::string_view kPrefix = "/v1/models/";
  const std::optional<std::string> id = percent_decoded(in.path.substr(kPrefix.size()));
  if (id && *id == intake_.limits().model_id) return {200, std::string(kJson), model_card().dump()};
  // As OpenAI answers an unknown model.
  return error_response(404,
                        "model: unknown model " +
                            excerpt(id.value_or(std::string(in.path.substr(kPrefix.size())))) +
                            "; this server serves '" + intake_.limits().model_id + "'",
                        "invalid_request_error", "model", "model_not_found");
}

Status OpenAiApi::check_model(const std::string& model) const {
  if (model.empty() || model == intake_.limits().model_id) return {};
  return Status::invalid_argument(
      "model: unknown model " + excerpt(model) + "; this server serves '" + intake_.limits().model_id + "'",
      "model");
}

Response OpenAiApi::tokenize(const IncomingRequest& in) {
  StatusOr<TokenizeCall> call = parse_tokenize(in.body, options_.formats);
  if (!call.ok()) return status_response(intake_.refuse(std::move(call).take_status()));
  if (Status bad = check_model(call->model); !bad.ok()) return status_response(intake_.refuse(bad));
  StatusOr<std::vector<std::int32_t>> ids = intake_.tokenize(call->prompt, call->add_special_tokens, in.stop);
  if (!ids.ok()) return status_response(intake_.refuse(std::move(ids).take_status()));
  json body{{"count", ids->size()}, {"max_model_len", intake_.limits().max_context}, {"tokens", *ids}};
  if (call->return_token_strs) {
    json strs = json::array();
    for (const std::int32_t id : *ids) strs.push_back(intake_.tokenizer()->id_to_token(id).value_or(""));
    body["token_strs"] = std::move(strs);
  }
  return {200, std::string(kJson), body.dump(-1, ' ', false, json::error_handler_t::replace)};
}

Response OpenAiApi::detokenize(const IncomingRequest& in) {
  StatusOr<DetokenizeCall> call = parse_detokenize(in.body);
  if (!call.ok()) return status_response(intake_.refuse(std::move(call).take_status()));
  if (Status bad = check_model(call->model); !bad.ok()) return status_response(intake_.refuse(bad));
  if (intake_.tokenizer() == nullptr)
    return status_response(intake_.refuse(
        Status{runtime::StatusCode::failed_precondition, "this model has no tokenizer", "tokens"}));
  // The same vocabulary check as a prompt of token ids.
  const PromptInput ids{TokenPrompt{std::move(call->tokens)}, "tokens"};
  if (StatusOr<std::vector<std::int32_t>> checked = intake_.tokenize(ids, std::nullopt, in.stop);
      !checked.ok())
    return status_response(intake_.refuse(std::move(checked).take_status()));
  const json body{{"prompt", intake_.tokenizer()->decode(std::get<TokenPrompt>(ids.content).ids, false)}};
  return {200, std::string(kJson), body.dump(-1, ' ', false, json::error_handler_t::replace)};
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
                                                    .created = unix_seconds_now(),
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
