// libFuzzer target for the request parsers: the JSON bodies of POST /v1/chat/completions and /v1/completions
// (OpenAiApi's real handlers) and the JSON fields of a gRPC ChatRequest (the service's chat_intake_request),
// through the shared intake (field checks, the chat template, the tokenizer) up to the scheduler, which is
// draining, so that every request that passes is refused there (HTTP 503 / UNAVAILABLE) and nothing is
// queued.
//
// Build and run (clang; a 30 s smoke run from the committed seeds):
//   configure with -DCMAKE_CXX_COMPILER=clang++ -DCAPSERVE_FUZZ=ON, build the fuzz_request_parsers target,
//   then (the copy keeps new inputs out of the repository)
//   cp -r tests/fuzz/corpus/request_parsers /tmp/rp && build-fuzz/tests/fuzz/fuzz_request_parsers
//   -max_total_time=30 /tmp/rp
//
// Input: byte 0 picks the mode. 0: the rest is a chat completions body; 1: a completions body; 2: a gRPC
// chat, the rest split at 0xFF bytes into tools, chat_template_kwargs, the tool_calls of an assistant message
// and the content of the user message before it (a missing part is left unset); 3: a /tokenize body; 4: a
// /detokenize body. Any input must give an answer that is a client error or the scheduler's refusal (or, for
// /tokenize and /detokenize, which need no scheduler, a success), never a crash, an exception, a 500 or an
// UNKNOWN / INTERNAL status.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/grpc_requests.h"
#include "server/http/openai_api.h"
#include "server/request_intake.h"
#include "server/scheduler.h"

namespace {

namespace server = capserve::server;
namespace runtime = capserve::runtime;

void check(bool condition) {
  if (!condition) std::abort();
}

const std::filesystem::path kModel =
    std::filesystem::path(CAPSERVE_SOURCE_DIR) / "deploy/models/capserve-moe-tiny";

// A template that shows tools, tool calls and kwargs through tojson, as tool-calling checkpoints do (the tiny
// model's own template shows only roles and text), with the tiny model's special tokens.
constexpr std::string_view kTemplate =
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}{% if enable_thinking is defined %}{{ enable_thinking | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

runtime::ChatTemplate load_template() {
  std::ifstream in(kModel / "tokenizer_config.json");
  return runtime::ChatTemplate::from_tokenizer_config(nlohmann::json::parse(in), std::string(kTemplate));
}

struct Server {
  runtime::Tokenizer tokenizer = runtime::Tokenizer::load(kModel);
  server::Scheduler scheduler{{}, 1, &tokenizer, nullptr, nullptr};
  server::RequestIntake intake{scheduler, &tokenizer, load_template(), limits(tokenizer), nullptr};
  server::http::OpenAiApi api{intake, {}};
  std::map<std::string, server::http::Route, std::less<>> routes = api.routes();

  Server() { scheduler.drain(); }

  static server::ServiceLimits limits(const runtime::Tokenizer& tokenizer) {
    server::ServiceLimits l;
    l.model_id = "tiny";
    l.vocab_size = tokenizer.vocab_size();
    l.max_context = 512;
    return l;
  }
};

Server& instance() {
  static Server s;
  return s;
}

void http(const std::string& path, std::string_view body) {
  const server::http::IncomingRequest in{body, "ipv4:127.0.0.1:5000",
                                         [](std::string_view) { return std::string_view(); }};
  const server::http::Response r = instance().routes.at(path).handler(in);
  const bool tokenizer_route = path == "/tokenize" || path == "/detokenize";
  if (tokenizer_route && r.status == 200) {
    check(nlohmann::json::parse(r.body).is_object());
    return;
  }
  // 503: it passed every check and reached the draining scheduler.
  check(r.status == 400 || r.status == 404 || (r.status == 503 && !tokenizer_route));
  const nlohmann::json error = nlohmann::json::parse(r.body).at("error");
  check(error.at("message").is_string() && !error.at("message").get_ref<const std::string&>().empty());
}

void grpc_chat(std::string_view data) {
  std::vector<std::string_view> parts;
  while (!data.empty() && parts.size() < 4) {
    const std::size_t end = std::min(data.find('\xff'), data.size());
    parts.push_back(data.substr(0, end));
    data.remove_prefix(std::min(end + 1, data.size()));
  }
  parts.resize(4);
  capserve::v1::ChatRequest request;
  request.set_tools(std::string(parts[0]));
  request.set_chat_template_kwargs(std::string(parts[1]));
  capserve::v1::ChatMessage* user = request.add_messages();
  user->set_role("user");
  user->set_content(std::string(parts[3]));
  if (!parts[2].empty()) {
    capserve::v1::ChatMessage* assistant = request.add_messages();
    assistant->set_role("assistant");
    assistant->set_tool_calls(std::string(parts[2]));
  }
  runtime::StatusOr<server::IntakeRequest> intake = server::chat_intake_request(request, {});
  const runtime::Status status =
      intake.ok() ? instance().intake.admit(*intake, [] {}).status() : intake.status();
  check(status.code() == runtime::StatusCode::invalid_argument ||
        status.code() == runtime::StatusCode::unavailable);
  check(!status.message().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view data(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  switch (bytes[0] % 5) {
    case 0:
      http("/v1/chat/completions", data);
      break;
    case 1:
      http("/v1/completions", data);
      break;
    case 2:
      grpc_chat(data);
      break;
    case 3:
      http("/tokenize", data);
      break;
    default:
      http("/detokenize", data);
  }
  return 0;
}
