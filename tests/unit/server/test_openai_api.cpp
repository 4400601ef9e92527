// The OpenAI API's mapping without ranks or sockets: requests in as JSON, through the shared intake into a
// real scheduler driven step by step, responses and SSE chunks out; every bad input an OpenAI-shaped error
// naming its field; a client that leaves cancels its request; a failed request answers with its status.
#include "server/http/openai_api.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <regex>
#include <stop_token>
#include <string>

#include "tests/unit/server/scheduler_steps.h"
#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server::http {
namespace {

using json = nlohmann::json;

class OpenAiApiTest : public testing::Test {
 protected:
  OpenAiApiTest()
      : tokenizer_(load_tiny_tokenizer()),
        scheduler_({}, 1, &tokenizer_, nullptr, nullptr),
        intake_(scheduler_, &tokenizer_, std::nullopt, limits(tokenizer_), nullptr),
        api_(intake_, {.version = "1.2.3"}),
        routes_(api_.routes()) {}

  static ServiceLimits limits(const runtime::Tokenizer& tokenizer) {
    ServiceLimits l;
    l.model_id = "tiny";
    l.vocab_size = tokenizer.vocab_size();
    l.max_context = 64;
    l.default_max_tokens = 4;
    l.max_tokens_limit = 8;
    return l;
  }

  Response call(const std::string& path, const std::string& body,
                std::map<std::string, std::string> headers = {}) {
    IncomingRequest in{body, "ipv4:127.0.0.1:5000", [headers](std::string_view name) {
                         const auto it = headers.find(std::string(name));
                         return it == headers.end() ? std::string_view() : std::string_view(it->second);
                       }};
    return routes_.at(path).handler(in);
  }

  // Runs one step in which every sequence samples `token`.
  void step(std::int32_t token) { steps_.step(token); }

  // Steps the scheduler until the producer's body is complete; returns it.
  std::string run(Producer& producer, int& wakes) {
    producer.start([&wakes] { ++wakes; });
    std::string out;
    for (int i = 0; i < 20; ++i) {
      if (producer.poll(out)) return out;
      step(single_token(tokenizer_, "a"));
    }
    ADD_FAILURE() << "the response never completed: " << out;
    return out;
  }

  static std::string header(const Response& r, const std::string& name) {
    for (const auto& [n, v] : r.headers)
      if (n == name) return v;
    return {};
  }

  runtime::Tokenizer tokenizer_;
  Scheduler scheduler_;
  SchedulerSteps steps_{scheduler_};
  RequestIntake intake_;
  OpenAiApi api_;
  std::map<std::string, Route, std::less<>> routes_;
};

TEST_F(OpenAiApiTest, BadInputGetsAnOpenAiErrorNamingTheField) {
  struct Case {
    std::string path, body;
    unsigned status;
    std::string param;  // "" when null
  };
  const std::string chat = "/v1/chat/completions";
  const std::string completions = "/v1/completions";
  const std::vector<Case> cases{
      {completions, "{", 400, ""},
      {completions, "[]", 400, ""},
      {completions, R"({"prompt": [1, 2], "model": "other"})", 404, "model"},
      {completions, R"({"prompt": [1, 2], "model": 5})", 400, "model"},
      {completions, R"({"prompt": [1, 2], "temperature": -1})", 400, "temperature"},
      {completions, R"({"prompt": [1, 2], "top_p": "x"})", 400, "top_p"},
      {completions, R"({"prompt": [1, 2], "top_k": -5})", 400, "top_k"},
      {completions, R"({"prompt": [1, 2], "max_tokens": 9})", 400, "max_tokens"},
      {completions, R"({"prompt": [1, 2], "max_tokens": 0})", 400, "max_tokens"},
      {completions, R"({"prompt": [1, 2], "seed": 1.5})", 400, "seed"},
      {completions, R"({"prompt": [1, 2], "n": 0})", 400, "n"},
      {completions, R"({"prompt": [1, 2], "n": 65})", 400, "n"},
      {completions, R"({"prompt": [1, 2], "stop": [1]})", 400, "stop"},
      {completions, R"({"prompt": [1, 2], "stop": ["", "x"]})", 400, "stop"},
      {completions, R"({"prompt": [1, 2], "stream": "yes"})", 400, "stream"},
      {completions, R"({"prompt": [1, 2], "stream_options": {"include_usage": true}})", 400,
       "stream_options"},
      {completions, R"({"prompt": [1, 2], "presence_penalty": 2.5})", 400, "presence_penalty"},
      {completions, R"({"prompt": [1, 2], "frequency_penalty": "x"})", 400, "frequency_penalty"},
      {completions, R"({"prompt": [1, 2], "frequency_penalty": -2.1})", 400, "frequency_penalty"},
      {completions, R"({"prompt": [1, 2], "repetition_penalty": 0})", 400, "repetition_penalty"},
      {completions, R"({"prompt": [1, 2], "min_p": 1.5})", 400, "min_p"},
      {completions, R"({"prompt": [1, 2], "min_tokens": -1})", 400, "min_tokens"},
      {completions, R"({"prompt": [1, 2], "min_tokens": 5})", 400, "min_tokens"},  // > max_tokens 4
      {completions, R"({"prompt": [1, 2], "min_tokens": 1, "stop": "x"})", 400, "min_tokens"},
      {completions, R"({"prompt": [1, 2], "logit_bias": [1]})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "logit_bias": {"a": 1}})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "logit_bias": {"-3": 1}})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "logit_bias": {"1": 101}})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "logit_bias": {"1": "x"}})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "logit_bias": {"99999999": 1}})", 400, "logit_bias"},
      {completions, R"({"prompt": [1, 2], "stop_token_ids": [-1]})", 400, "stop_token_ids"},
      {completions, R"({"prompt": [1, 2], "stop_token_ids": 3})", 400, "stop_token_ids"},
      {completions, R"({"prompt": [1, 2], "stop_token_ids": [99999999]})", 400, "stop_token_ids"},
      {completions,
       R"({"prompt": [1, 2], "presence_penalty": 1, "frequency_penalty": -2, "repetition_penalty": 1.2,
           "min_p": 0.1, "min_tokens": 2, "logit_bias": {"1": -100, "2": 5.5}, "stop_token_ids": [3]})",
       200, ""},
      {completions, R"({"prompt": [1, 2], "echo": 1})", 400, "echo"},
      {completions, R"({"prompt": [1, 2], "logprobs": 21})", 400, "logprobs"},
      {completions, R"({"prompt": [1, 2], "logprobs": true})", 400, "logprobs"},
      {completions, R"({"prompt": [1, 2], "top_logprobs": 2})", 400, "top_logprobs"},
      {completions, R"({"prompt": [1, 2], "logprobs": 2, "echo": true})", 200, ""},
      {completions, R"({"prompt": [-1]})", 400, "prompt"},
      {completions, R"({"prompt": []})", 400, "prompt"},
      {completions, R"({"prompt": [[1], {}]})", 400, "prompt"},
      {completions, R"({"prompt": ""})", 400, "prompt"},
      {completions, R"({"prompt": [1, 2], "top_k": -1, "seed": 3, "stop": "x", "ignore_eos": true})", 200,
       ""},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}]})", 400, "messages"},  // no chat template
      {chat, R"({"messages": "hi"})", 400, "messages"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1})", 400, "logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1})", 400, "top_logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21})",
       400, "top_logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "hi"}], "echo": true})", 400, "echo"},
  };
  for (const Case& c : cases) {
    const Response r = call(c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.body << " -> " << r.body;
    if (c.status == 200) continue;
    ASSERT_EQ(r.content_type, "application/json");
    const json error = json::parse(r.body).at("error");
    EXPECT_FALSE(error.at("message").get<std::string>().empty());
    EXPECT_TRUE(error.contains("type") && error.contains("code"));
    EXPECT_EQ(error.at("param"), c.param.empty() ? json(nullptr) : json(c.param))
        << c.body << " -> " << r.body;
  }
  const Response too_long = call(
      completions, R"({"prompt": [)" + [] {
        std::string ids = "1";
        for (int i = 0; i < 70; ++i) ids += ", 1";
        return ids;
      }() + "]}");
  EXPECT_EQ(too_long.status, 400);
  EXPECT_EQ(json::parse(too_long.body)["error"]["code"], "context_length_exceeded");
}

// Issue 24: a body nesting ~87,000 objects in an unknown key, followed by another key, killed the process
// with SIGSEGV inside ordered_json::parse (recursive copies as the outer object grew); 300 levels in tools
// reached the template engine's depth error, which escaped as HTTP 500. Both are 400s naming the field,
// counted like every refusal, for both endpoints.
TEST_F(OpenAiApiTest, DeeplyNestedBodiesAreRefusedNamingTheField) {
  const auto objects = [](int levels) {
    std::string out;
    for (int i = 0; i < levels; ++i) out += R"({"a":)";
    return out + "1" + std::string(levels, '}');
  };
  const std::string hi = R"("messages": [{"role": "user", "content": "hi"}])";
  struct Case {
    std::string path, body, param;
  };
  const std::vector<Case> cases{
      {"/v1/chat/completions", R"({"x": )" + objects(100000) + ", " + hi + "}", "x"},
      {"/v1/chat/completions",
       R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": )" + objects(300) +
           "}}], " + hi + "}",
       "tools"},
      {"/v1/chat/completions", "{" + hi + R"(, "chat_template_kwargs": {"k": )" + objects(300) + "}}",
       "chat_template_kwargs"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi", "extra": )" + objects(100000) + "}]}", "messages"},
      {"/v1/completions", R"({"prompt": [1], "x": )" + objects(100000) + "}", "x"},
  };
  for (const Case& c : cases) {
    const Response r = call(c.path, c.body);
    ASSERT_EQ(r.status, 400) << c.param << " -> " << r.body;
    const json error = json::parse(r.body).at("error");
    EXPECT_EQ(error.at("param"), c.param) << r.body;
    EXPECT_NE(error.at("message").get<std::string>().find("deeper than 64 levels"), std::string::npos)
        << r.body;
  }
  // The server goes on: the same endpoint answers a normal request.
  EXPECT_EQ(call("/v1/completions", R"({"prompt": [1, 2]})").status, 200);
}

TEST_F(OpenAiApiTest, RequestIdsComeFromTheClientOrAreRandom) {
  const Response mine = call("/v1/completions", R"({"prompt": [1, 2]})", {{"X-Request-Id", "abc-1"}});
  EXPECT_EQ(header(mine, "X-Request-Id"), "abc-1");
  const Response bad = call("/v1/completions", R"({"prompt": [1, 2]})", {{"X-Request-Id", "a b"}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "X-Request-Id");
  EXPECT_EQ(call("/v1/completions", "{}", {{"X-Request-Id", std::string(129, 'x')}}).status, 400);
  const std::string a = header(call("/v1/completions", R"({"prompt": [1]})"), "X-Request-Id");
  const std::string b = header(call("/v1/completions", R"({"prompt": [1]})"), "X-Request-Id");
  EXPECT_TRUE(std::regex_match(a, std::regex("cmpl-[0-9a-f]{24}"))) << a;
  EXPECT_NE(a, b);
}

TEST_F(OpenAiApiTest, AWholeCompletionRunsThroughTheScheduler) {
  const Response r = call("/v1/completions", R"({"prompt": [5, 6, 7], "max_tokens": 2, "model": "tiny"})");
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_TRUE(r.producer);
  EXPECT_FALSE(r.stream);
  int wakes = 0;
  const json body = json::parse(run(*r.producer, wakes));
  EXPECT_GT(wakes, 0);
  EXPECT_EQ(r.producer->status(), 200U);
  EXPECT_EQ(body["id"], header(r, "X-Request-Id"));
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "tiny");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["choices"][0]["text"], "aa");
  EXPECT_EQ(body["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(body["usage"]["completion_tokens"], 2);
  EXPECT_EQ(body["usage"]["total_tokens"], 5);
  EXPECT_TRUE(body["moe"].contains("dropped"));
}

TEST_F(OpenAiApiTest, AStreamedCompletionSendsChunksUsageAndDone) {
  const Response r = call("/v1/completions", R"({"prompt": [5, 6], "max_tokens": 3, "n": 2, "stream": true,
                                                 "stream_options": {"include_usage": true}})");
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_TRUE(r.stream);
  EXPECT_EQ(r.content_type, "text/event-stream");
  int wakes = 0;
  const std::string out = run(*r.producer, wakes);
  ASSERT_TRUE(out.ends_with("data: [DONE]\n\n")) << out;
  int finishes = 0;
  std::string text[2];
  json usage;
  for (std::size_t at = 0; (at = out.find("data: {", at)) != std::string::npos; ++at) {
    const json chunk = json::parse(out.substr(at + 6, out.find("\n\n", at) - at - 6));
    if (chunk["choices"].empty()) {
      usage = chunk["usage"];
      continue;
    }
    const json& choice = chunk["choices"][0];
    text[choice["index"].get<int>()] += choice["text"].get<std::string>();
    if (!choice["finish_reason"].is_null()) ++finishes;
  }
  EXPECT_EQ(finishes, 2);
  EXPECT_EQ(text[0], "aaa");
  EXPECT_EQ(text[1], "aaa");
  EXPECT_EQ(usage["completion_tokens"], 6);
  EXPECT_EQ(usage["prompt_tokens"], 2);  // one prompt, counted once
}

TEST_F(OpenAiApiTest, AbandoningCancelsAndAFailureAnswersWithItsStatus) {
  const Response gone = call("/v1/completions", R"({"prompt": [5, 6], "max_tokens": 8, "stream": true})");
  gone.producer->start([] {});
  step(single_token(tokenizer_, "a"));
  gone.producer->abandon();
  step(single_token(tokenizer_, "a"));  // frees the cancelled sequence
  EXPECT_TRUE(scheduler_.idle());

  const Response failing = call("/v1/completions", R"({"prompt": [5, 6], "max_tokens": 8})");
  failing.producer->start([] {});
  scheduler_.fail_all(Terminal::unavailable, "a rank stopped");
  std::string out;
  EXPECT_TRUE(failing.producer->poll(out));
  EXPECT_EQ(failing.producer->status(), 503U);
  EXPECT_EQ(json::parse(out)["error"]["message"], "a rank stopped");
  // Draining now (fail_all stops admission): health and new requests say so.
  EXPECT_EQ(routes_.at("/health").handler({}).status, 503U);
  EXPECT_EQ(call("/v1/completions", R"({"prompt": [5]})").status, 503U);
}

// A call of n choices submits n requests: it takes n of its address's in-flight slots, and is refused when
// they do not fit (n once bypassed --max-requests-per-peer: eight calls of n=64 filled the queue).
TEST_F(OpenAiApiTest, EveryChoiceTakesAnInFlightSlotOfItsAddress) {
  ServiceLimits l = limits(tokenizer_);
  l.max_requests_per_peer = 4;
  RequestIntake intake(scheduler_, &tokenizer_, std::nullopt, l, nullptr);
  OpenAiApi api(intake, {.version = "1.2.3"});
  auto routes = api.routes();
  auto post = [&](const std::string& body, const std::string& peer) {
    return routes.at("/v1/completions").handler({body, peer, [](std::string_view) {
                                                   return std::string_view();
                                                 }});
  };
  const Response eight = post(R"({"prompt": [5], "n": 8})", "ipv4:10.0.0.1:1000");
  EXPECT_EQ(eight.status, 429U) << eight.body;
  Response four = post(R"({"prompt": [5], "n": 4})", "ipv4:10.0.0.1:1001");
  ASSERT_EQ(four.status, 200U) << four.body;
  const Response one_more = post(R"({"prompt": [5]})", "ipv4:10.0.0.1:1002");
  EXPECT_EQ(one_more.status, 429U) << one_more.body;
  EXPECT_EQ(post(R"({"prompt": [5], "n": 4})", "ipv4:10.0.0.2:1000").status, 200U);  // another address
  // The slots come back with the response.
  four.producer->abandon();
  four.producer.reset();
  EXPECT_EQ(post(R"({"prompt": [5], "n": 2})", "ipv4:10.0.0.1:1003").status, 200U);
}

// A client that left while its request was prepared (or a draining server) submits nothing.
TEST_F(OpenAiApiTest, AStoppedRequestIsNotSubmitted) {
  std::stop_source gone;
  gone.request_stop();
  const std::string body = R"({"prompt": [5, 6]})";
  const Response r = routes_.at("/v1/completions")
                         .handler({body, "ipv4:127.0.0.1:5000",
                                   [](std::string_view) { return std::string_view(); }, gone.get_token()});
  EXPECT_EQ(r.status, 499U) << r.body;
  EXPECT_TRUE(scheduler_.idle());
}

TEST_F(OpenAiApiTest, ModelsHealthAndVersion) {
  const json models = json::parse(routes_.at("/v1/models").handler({}).body);
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["max_model_len"], 64);
  EXPECT_EQ(routes_.at("/health").handler({}).status, 200U);
  EXPECT_EQ(json::parse(routes_.at("/version").handler({}).body)["version"], "1.2.3");
}

TEST_F(OpenAiApiTest, OneModelByIdOrOpenAisNotFound) {
  const auto get = [this](std::string_view path) {
    IncomingRequest in;
    in.path = path;
    return routes_.at("/v1/models/").handler(in);
  };
  const Response card = get("/v1/models/tiny");
  ASSERT_EQ(card.status, 200U) << card.body;
  EXPECT_EQ(json::parse(card.body), json::parse(routes_.at("/v1/models").handler({}).body)["data"][0]);
  EXPECT_EQ(get("/v1/models/t%69ny").status, 200U);  // percent-encoded
  for (const std::string_view path : {"/v1/models/other", "/v1/models/tiny/x", "/v1/models/ti%6"}) {
    const Response missing = get(path);
    EXPECT_EQ(missing.status, 404U) << path;
    const json error = json::parse(missing.body).at("error");
    EXPECT_EQ(error.at("code"), "model_not_found") << path;
    EXPECT_EQ(error.at("param"), "model") << path;
  }
}

// Each endpoint accepts exactly the fields it reads and the no-op list; any other is a 400 naming it, so that
// nothing the server does not act on passes silently.
TEST_F(OpenAiApiTest, FieldsTheServerDoesNotActOnAreRefusedByName) {
  const std::string chat = "/v1/chat/completions";
  const std::string completions = "/v1/completions";
  const std::string messages = R"("messages": [{"role": "user", "content": "hi"}])";
  struct Case {
    std::string path, body, param, needle;
  };
  const std::vector<Case> refused{
      {completions, R"({"prompt": [1], "response_format": {"type": "xml"}})", "response_format", "xml"},
      {completions, R"({"prompt": [1], "response_format": {"type": "json_object", "schema": {}}})",
       "response_format", "'schema' is not a field"},
      {completions, R"({"prompt": [1], "structured_outputs": {"regex": "a", "choice": ["b"]}})",
       "structured_outputs", "exactly one"},
      {completions, R"({"prompt": [1], "structured_outputs": {"structural_tag": "x"}})", "structured_outputs",
       "structural_tag"},
      {completions,
       R"({"prompt": [1], "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})",
       "structured_outputs", "response_format"},
      {completions, R"({"prompt": [1], "suffix": "x"})", "suffix", "/v1/completions"},
      {completions, R"({"prompt": [1], "best_of": 2})", "best_of", "/v1/completions"},
      {completions, R"({"prompt": [1], "max_completion_tokens": 2})", "max_completion_tokens",
       "/v1/completions"},
      {completions, R"({"prompt": [1], "messages": []})", "messages", "/v1/completions"},
      {completions, R"({"prompt": [1], "tempreature": 0})", "tempreature", "/v1/completions"},
      {completions, R"({"prompt": [1], "stream": true, "stream_options": {"include_usage": true, "x": 1}})",
       "stream_options", "stream_options.x"},
      {chat,
       "{" + messages + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})",
       "response_format", "json_schema.schema"},
      {chat,
       "{" + messages +
           R"(, "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}})",
       "response_format", "'x' is not one of its fields"},
      {chat, "{" + messages + R"(, "tool_choice": "required"})", "tool_choice", "needs tools"},
      {chat, "{" + messages + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}}})",
       "tool_choice", "needs tools"},
      {chat, "{" + messages + R"(, "prompt": "x"})", "prompt", "/v1/chat/completions"},
      {chat, "{" + messages + R"(, "audio": {}})", "audio", "/v1/chat/completions"},
      {chat, "{" + messages + R"(, "reasoning_effort": "low"})", "reasoning_effort", "/v1/chat/completions"},
  };
  for (const Case& c : refused) {
    const Response r = call(c.path, c.body);
    EXPECT_EQ(r.status, 400U) << c.body << " -> " << r.body;
    const json error = json::parse(r.body).at("error");
    EXPECT_EQ(error.at("param"), c.param) << c.body << " -> " << r.body;
    EXPECT_NE(error.at("message").get<std::string>().find(c.needle), std::string::npos) << r.body;
  }
  // The no-op fields pass on both endpoints.
  const std::string no_ops = R"("user": "u1", "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
                                "safety_identifier": "s", "prompt_cache_key": "p", "prompt_cache_retention": "24h")";
  EXPECT_EQ(call(completions, R"({"prompt": [1], )" + no_ops + "}").status, 200U);
  // (The fixture has no chat template: a chat that passes the field checks fails on its messages.)
  const Response chat_no_ops = call(chat, "{" + messages + ", " + no_ops + "}");
  EXPECT_EQ(json::parse(chat_no_ops.body)["error"]["param"], "messages") << chat_no_ops.body;
}

// OpenAI and vLLM sample at temperature 1 when neither the request nor the checkpoint sets one.
TEST_F(OpenAiApiTest, AnUnsetTemperatureIsOne) {
  for (const Endpoint endpoint : {Endpoint::chat, Endpoint::completions}) {
    const auto call = parse_completion(R"({"prompt": [1], "messages": []})", endpoint, "id", {});
    ASSERT_FALSE(call.ok());  // each endpoint refuses the other's prompt field
    const auto parsed =
        parse_completion(endpoint == Endpoint::chat ? R"({"messages": [{"role": "user", "content": "hi"}]})"
                                                    : R"({"prompt": [1]})",
                         endpoint, "id", {});
    ASSERT_TRUE(parsed.ok()) << parsed.status().message();
    EXPECT_EQ(parsed->intake.unset_temperature, 1.0);
    EXPECT_FALSE(parsed->intake.sampling.temperature);
  }
}

// vLLM's /tokenize and /detokenize: the same tokenizer and checks as a prompt, the response shapes vLLM's.
TEST_F(OpenAiApiTest, TokenizeAndDetokenizeRoundTrip) {
  std::vector<std::int32_t> want;
  ASSERT_TRUE(tokenizer_.encode("ab a", true, want).ok());
  const Response r = call("/tokenize", R"({"model": "tiny", "prompt": "ab a", "return_token_strs": true})");
  ASSERT_EQ(r.status, 200U) << r.body;
  const json body = json::parse(r.body);
  EXPECT_EQ(body["tokens"].get<std::vector<std::int32_t>>(), want);
  EXPECT_EQ(body["count"], want.size());
  EXPECT_EQ(body["max_model_len"], 64);
  ASSERT_EQ(body["token_strs"].size(), want.size());
  EXPECT_EQ(body["token_strs"][0], std::string(*tokenizer_.id_to_token(want[0])));
  EXPECT_FALSE(json::parse(call("/tokenize", R"({"prompt": "ab a"})").body).contains("token_strs"));

  const Response back = call("/detokenize", json{{"tokens", want}}.dump());
  ASSERT_EQ(back.status, 200U) << back.body;
  EXPECT_EQ(json::parse(back.body)["prompt"], tokenizer_.decode(want, false));

  struct Case {
    std::string path, body;
    unsigned status;
    std::string param;
  };
  for (const Case& c : std::vector<Case>{
           {"/tokenize", R"({"prompt": "a", "max_tokens": 3})", 400, "max_tokens"},
           {"/tokenize", R"({"prompt": 5})", 400, "prompt"},
           {"/tokenize", R"({"prompt": "a", "model": "other"})", 404, "model"},
           {"/tokenize", R"({"prompt": "a", "add_special_tokens": 1})", 400, "add_special_tokens"},
           {"/tokenize", R"({"messages": [{"role": "user", "content": "hi"}], "prompt": "a"})", 400,
            "prompt"},
           {"/detokenize", R"({"tokens": [1, "x"]})", 400, "tokens"},
           {"/detokenize", R"({"tokens": [99999]})", 400, "tokens"},
           {"/detokenize", R"({"tokens": [1], "skip_special_tokens": true})", 400, "skip_special_tokens"},
       }) {
    const Response bad = call(c.path, c.body);
    EXPECT_EQ(bad.status, c.status) << c.body << " -> " << bad.body;
    EXPECT_EQ(json::parse(bad.body)["error"]["param"], c.param) << c.body << " -> " << bad.body;
  }
}

TEST_F(OpenAiApiTest, CreatedIsTheResponsesOwnTime) {
  const auto now = [] {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const std::int64_t before = now();
  const Response r = call("/v1/completions", R"({"prompt": [5], "max_tokens": 1})");
  ASSERT_EQ(r.status, 200U) << r.body;
  int wakes = 0;
  const json body = json::parse(run(*r.producer, wakes));
  EXPECT_GE(body["created"].get<std::int64_t>(), before);
  EXPECT_LE(body["created"].get<std::int64_t>(), now());
}

}  // namespace
}  // namespace capserve::server::http
