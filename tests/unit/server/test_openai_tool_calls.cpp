// Tool calls and reasoning through the real output path of the OpenAI API, without ranks: a chat request
// (with tools) in as JSON, rendered through a real chat template of the corpus
// (../shared/data/chat_templates) and tokenized with the committed tiny tokenizer, a real scheduler whose
// steps sample the tokens of a scripted model output (what a Qwen3 model writes when it calls a tool, or
// thinks), detokenized by the request's OutputStream, parsed by the choice's chat_output parser into OpenAI's
// message / stream deltas. The whole response and the stream must carry the same calls, and the
// function-calling round trip (the calls sent back as an assistant message with a tool message) must render.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "runtime/grammar/grammar_cache.h"
#include "server/http/openai_api.h"
#include "server/http/openai_request.h"
#include "tests/unit/server/scheduler_steps.h"
#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server::http {
namespace {

using json = nlohmann::json;
using chat_output::ReasoningFormat;
using chat_output::ToolCallFormat;

std::string corpus_template(const std::string& id) {
  std::ifstream in(std::filesystem::path(CAPSERVE_SHARED_DATA_DIR) / "chat_templates/templates.jsonl");
  EXPECT_TRUE(in) << "cannot open the chat-template corpus (CAPSERVE_SHARED_DATA_DIR)";
  for (std::string line; std::getline(in, line);) {
    const json record = json::parse(line);
    if (record["id"] == id) return record["chat_template"].get<std::string>();
  }
  ADD_FAILURE() << "no template " << id;
  return {};
}

const json kTools = json::parse(R"([{"type": "function", "function": {"name": "get_current_weather",
  "description": "Get the current weather in a given location", "parameters": {"type": "object",
  "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
  "required": ["location"]}}}])");
constexpr std::string_view kCall =
    "<tool_call>\n{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Paris, France\", "
    "\"unit\": \"celsius\"}}\n</tool_call>";
constexpr std::string_view kArguments = R"({"location": "Paris, France", "unit": "celsius"})";

class OpenAiToolCallsTest : public testing::Test {
 protected:
  // `template_id` of the corpus, and the server's parsers as --tool-call-parser / --reasoning-parser auto
  // resolve them from it.
  void serve(const std::string& template_id) {
    const std::string source = corpus_template(template_id);
    intake_.emplace(
        scheduler_, &tokenizer_,
        runtime::ChatTemplate::from_tokenizer_config(json{{"eos_token", "<|endoftext|>"}}, source), limits(),
        nullptr, &grammars_);
    api_.emplace(*intake_, OpenAiOptions{.version = "1",
                                         .formats = {chat_output::tool_call_format_for("auto", source),
                                                     chat_output::reasoning_format_for("auto", source)}});
    routes_ = api_->routes();
  }

  ServiceLimits limits() {
    ServiceLimits l;
    l.model_id = "tiny";
    l.vocab_size = tokenizer_.vocab_size();
    l.max_context = 4096;
    l.max_tokens_limit = 512;
    l.eos_token_ids = {eos_};
    return l;
  }

  Response call(const json& body) {
    const std::string text = body.dump();  // the request views it
    IncomingRequest in{text, "ipv4:127.0.0.1:5000", [](std::string_view) { return std::string_view(); }};
    return routes_.at("/v1/chat/completions").handler(in);
  }

  // The response once the model has written `output` and its end-of-sequence token, one token a step.
  std::string run(Producer& producer, std::string_view output) {
    std::vector<std::int32_t> ids;
    EXPECT_TRUE(tokenizer_.encode(output, false, ids).ok());
    ids.push_back(eos_);
    producer.start([] {});
    std::string out;
    for (const std::int32_t id : ids) {
      EXPECT_FALSE(producer.poll(out)) << out;
      steps_.step(id);
    }
    EXPECT_TRUE(producer.poll(out)) << "the response did not end with the model's end of sequence";
    return out;
  }

  json whole(const json& request, std::string_view output) {
    const Response r = call(request);
    EXPECT_EQ(r.status, 200U) << r.body;
    return r.producer ? json::parse(run(*r.producer, output)) : json();
  }

  // The stream's chunks of choice 0.
  std::vector<json> streamed(json request, std::string_view output) {
    request["stream"] = true;
    const Response r = call(request);
    EXPECT_EQ(r.status, 200U) << r.body;
    std::vector<json> chunks;
    if (!r.producer) return chunks;
    const std::string out = run(*r.producer, output);
    EXPECT_TRUE(out.ends_with("data: [DONE]\n\n"));
    for (std::size_t at = 0; (at = out.find("data: {", at)) != std::string::npos; ++at)
      chunks.push_back(json::parse(out.substr(at + 6, out.find("\n\n", at) - at - 6)));
    return chunks;
  }

  // A streamed message as a client library accumulates it: content and reasoning appended, tool calls by
  // index.
  static json accumulate(const std::vector<json>& chunks, std::string& finish_reason) {
    json message{{"content", ""}, {"reasoning_content", ""}, {"tool_calls", json::array()}};
    for (const json& chunk : chunks) {
      const json& choice = chunk["choices"][0];
      if (!choice["finish_reason"].is_null()) finish_reason = choice["finish_reason"];
      const json& delta = choice["delta"];
      for (const char* key : {"content", "reasoning_content"})
        if (delta.contains(key))
          message[key] = message[key].get<std::string>() + delta[key].get<std::string>();
      for (const json& d : delta.value("tool_calls", json::array())) {
        json& calls = message["tool_calls"];
        const std::size_t index = d["index"];
        while (calls.size() <= index)
          calls.push_back({{"id", ""}, {"type", ""}, {"function", {{"name", ""}, {"arguments", ""}}}});
        json& c = calls[index];
        if (d.contains("id")) c["id"] = d["id"];
        if (d.contains("type")) c["type"] = d["type"];
        if (d["function"].contains("name")) c["function"]["name"] = d["function"]["name"];
        c["function"]["arguments"] =
            c["function"]["arguments"].get<std::string>() + d["function"]["arguments"].get<std::string>();
      }
    }
    return message;
  }

  static json ask(json extra = json::object()) {
    json body{{"messages", {{{"role", "user"}, {"content", "What's the weather in Paris?"}}}},
              {"tools", kTools},
              {"max_tokens", 200}};
    body.update(extra);
    return body;
  }

  runtime::Tokenizer tokenizer_ = load_tiny_tokenizer();
  std::int32_t eos_ = single_token(tokenizer_, "<|endoftext|>");
  // Forced tool choices compile their constraint at intake (this test scripts the output the grammar allows).
  runtime::grammar::GrammarCache grammars_{
      std::make_shared<const runtime::grammar::TokenVocabulary>(
          runtime::grammar::TokenVocabulary::from_tokenizer(tokenizer_, {eos_})),
      8};
  Scheduler scheduler_{{}, 1, &tokenizer_, nullptr, nullptr};
  SchedulerSteps steps_{scheduler_};
  std::optional<RequestIntake> intake_;
  std::optional<OpenAiApi> api_;
  std::map<std::string, Route, std::less<>> routes_;
};

TEST_F(OpenAiToolCallsTest, AFunctionCallingRoundTripWholeAndStreamed) {
  serve("qwen3");
  // tool_choice auto (the default with tools): the model's <tool_call> becomes tool_calls.
  const json reply = whole(ask({{"tool_choice", "auto"}}), "\n\n" + std::string(kCall));
  const json& choice = reply["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& message = choice["message"];
  EXPECT_EQ(message["content"], "\n\n");  // what the model wrote before the call, as vLLM keeps it
  ASSERT_EQ(message["tool_calls"].size(), 1U) << reply;
  const json& call = message["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_current_weather");
  EXPECT_EQ(call["function"]["arguments"], kArguments);
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("chatcmpl-tool-"));

  // Streamed: the same message once the deltas are added up, finish_reason tool_calls.
  std::string finish;
  const json accumulated = accumulate(streamed(ask(), "\n\n" + std::string(kCall)), finish);
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(accumulated["content"], "\n\n");
  ASSERT_EQ(accumulated["tool_calls"].size(), 1U);
  EXPECT_EQ(accumulated["tool_calls"][0]["function"], call["function"]);
  EXPECT_EQ(accumulated["tool_calls"][0]["type"], "function");

  // The call goes back with the tool's result; the model answers in text.
  json round_trip = ask();
  // Content "", not null: Qwen3's template tests `'</think>' in content` (transformers fails on null too).
  round_trip["messages"].push_back(
      {{"role", "assistant"}, {"content", ""}, {"tool_calls", message["tool_calls"]}});
  round_trip["messages"].push_back(
      {{"role", "tool"}, {"tool_call_id", call["id"]}, {"content", R"({"temperature": 22})"}});
  const json answer = whole(round_trip, "It is 22 degrees in Paris.");
  EXPECT_EQ(answer["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(answer["choices"][0]["message"]["content"], "It is 22 degrees in Paris.");
  EXPECT_FALSE(answer["choices"][0]["message"].contains("tool_calls"));
}

TEST_F(OpenAiToolCallsTest, ParallelToolCallsFalseKeepsOneCall) {
  serve("qwen3");
  const std::string two = std::string(kCall) + "\n" + std::string(kCall);
  EXPECT_EQ(whole(ask(), two)["choices"][0]["message"]["tool_calls"].size(), 2U);
  const json one = whole(ask({{"parallel_tool_calls", false}}), two);
  EXPECT_EQ(one["choices"][0]["message"]["tool_calls"].size(), 1U);
}

TEST_F(OpenAiToolCallsTest, ToolChoiceNoneHidesTheToolsAndParsesNothing) {
  serve("qwen3");
  json plain = ask();
  plain.erase("tools");
  const json without_tools = whole(plain, "Hi");
  const json none = whole(ask({{"tool_choice", "none"}}), kCall);
  EXPECT_EQ(none["usage"]["prompt_tokens"],
            without_tools["usage"]["prompt_tokens"]);  // the template saw none
  EXPECT_EQ(none["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(none["choices"][0]["message"]["content"], kCall);  // the text, as written
  EXPECT_GT(whole(ask(), "Hi")["usage"]["prompt_tokens"], without_tools["usage"]["prompt_tokens"]);
}

// A named function: the output is constrained to its parameters (vLLM's named tool choice) and is the call's
// arguments, whole and streamed; the choice ends "stop", as OpenAI's forced function does.
TEST_F(OpenAiToolCallsTest, ANamedFunctionIsTheOutput) {
  serve("qwen3");
  const json named = json::parse(R"({"type": "function", "function": {"name": "get_current_weather"}})");
  const json reply = whole(ask({{"tool_choice", named}}), kArguments);
  const json& choice = reply["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop");
  EXPECT_TRUE(choice["message"]["content"].is_null()) << reply;
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1U) << reply;
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_current_weather");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], kArguments);
  std::string finish;
  const json accumulated = accumulate(streamed(ask({{"tool_choice", named}}), kArguments), finish);
  EXPECT_EQ(finish, "stop");
  EXPECT_EQ(accumulated["tool_calls"][0]["function"], choice["message"]["tool_calls"][0]["function"]);
}

// "required": the output is constrained to a list of calls of the offered tools, each parsed as a call.
TEST_F(OpenAiToolCallsTest, RequiredIsAListOfCalls) {
  serve("qwen3");
  const std::string output =
      R"([{"name": "get_current_weather", "parameters": )" + std::string(kArguments) + "}]";
  const json reply = whole(ask({{"tool_choice", "required"}}), output);
  EXPECT_EQ(reply["choices"][0]["finish_reason"], "tool_calls");
  ASSERT_EQ(reply["choices"][0]["message"]["tool_calls"].size(), 1U) << reply;
  EXPECT_EQ(reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], kArguments);
  std::string finish;
  const json accumulated = accumulate(streamed(ask({{"tool_choice", "required"}}), output), finish);
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(accumulated["tool_calls"][0]["function"],
            reply["choices"][0]["message"]["tool_calls"][0]["function"]);
}

// The constraints the forced choices send to the intake, as vLLM builds them.
TEST(ForcedToolConstraint, AsVllmBuildsThem) {
  ParseOptions options;
  options.formats.tool_calls = ToolCallFormat::hermes;
  json body{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", kTools}};
  body["tool_choice"] = json::parse(R"({"type": "function", "function": {"name": "get_current_weather"}})");
  auto named = parse_completion(body.dump(), Endpoint::chat, "id", options);
  ASSERT_TRUE(named.ok()) << named.status().message();
  ASSERT_TRUE(named->intake.constraint);
  EXPECT_EQ(named->intake.constraint->field, "tool_choice");
  EXPECT_EQ(json(named->intake.constraint->spec["json_schema"]), kTools[0]["function"]["parameters"]);
  body["tool_choice"] = "required";
  body["parallel_tool_calls"] = false;
  auto required = parse_completion(body.dump(), Endpoint::chat, "id", options);
  ASSERT_TRUE(required.ok()) << required.status().message();
  const json schema = json(required->intake.constraint->spec["json_schema"]);
  EXPECT_EQ(schema["type"], "array");
  EXPECT_EQ(schema["minItems"], 1);
  EXPECT_EQ(schema["maxItems"], 1);
  const json& call = schema["items"]["anyOf"][0];
  EXPECT_EQ(call["properties"]["name"]["const"], "get_current_weather");
  EXPECT_EQ(call["properties"]["parameters"], kTools[0]["function"]["parameters"]);
  EXPECT_EQ(call["required"], json::parse(R"(["name", "parameters"])"));
}

// Mistral's [TOOL_CALLS] is a control token: with its parser and tools, the text keeps special tokens (as
// vLLM's Mistral parser sets skip_special_tokens false); the client's skip_special_tokens decides otherwise.
TEST(SkipSpecialTokens, TheMistralParserKeepsThemAndTheClientMaySay) {
  ParseOptions options;
  json body{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", kTools}};
  options.formats.tool_calls = ToolCallFormat::mistral;
  EXPECT_FALSE(parse_completion(body.dump(), Endpoint::chat, "id", options)->intake.skip_special_tokens);
  body["tool_choice"] = "none";
  EXPECT_TRUE(parse_completion(body.dump(), Endpoint::chat, "id", options)->intake.skip_special_tokens);
  options.formats.tool_calls = ToolCallFormat::hermes;
  body.erase("tool_choice");
  EXPECT_TRUE(parse_completion(body.dump(), Endpoint::chat, "id", options)->intake.skip_special_tokens);
  body["skip_special_tokens"] = false;
  EXPECT_FALSE(parse_completion(body.dump(), Endpoint::chat, "id", options)->intake.skip_special_tokens);
  body["skip_special_tokens"] = "no";
  EXPECT_FALSE(parse_completion(body.dump(), Endpoint::chat, "id", options).ok());
}

TEST_F(OpenAiToolCallsTest, ForcedChoicesAreRefusedWhereTheyCannotHold) {
  serve("qwen3");
  const json unknown = json::parse(R"({"type": "function", "function": {"name": "get_time"}})");
  for (const auto& [request, needle] : std::vector<std::pair<json, std::string>>{
           {ask({{"tool_choice", unknown}}), "'get_time' is not one of the tools"},
           {ask({{"tool_choice", "required"}, {"response_format", {{"type", "json_object"}}}}),
            "response_format"},
           {ask({{"tool_choice", {{"type", "function"}}}}), "tool_choice.function.name"}}) {
    const Response r = call(request);
    EXPECT_EQ(r.status, 400U) << request;
    const json error = json::parse(r.body)["error"];
    EXPECT_EQ(error["param"], "tool_choice");
    EXPECT_NE(error["message"].get<std::string>().find(needle), std::string::npos) << error;
  }
  json no_tools = ask({{"tool_choice", "required"}});
  no_tools.erase("tools");
  EXPECT_EQ(call(no_tools).status, 400U);
  no_tools["tool_choice"] = "auto";
  EXPECT_EQ(call(no_tools).status, 400U);
  EXPECT_EQ(call(ask({{"parallel_tool_calls", "no"}})).status, 400U);
}

TEST_F(OpenAiToolCallsTest, ReasoningContentOnAThinkingTemplate) {
  // Qwen3-Thinking-2507 opens <think> in the prompt: the output starts inside the thinking.
  serve("qwen3-thinking-2507");
  const std::string output = "Paris is in France.\n</think>\n\nIt is sunny.";
  json request{{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"max_tokens", 200}};
  const json message = whole(request, output)["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "Paris is in France.\n");
  EXPECT_EQ(message["content"], "\n\nIt is sunny.");
  std::string finish;
  const json accumulated = accumulate(streamed(request, output), finish);
  EXPECT_EQ(finish, "stop");
  EXPECT_EQ(accumulated["reasoning_content"], "Paris is in France.\n");
  EXPECT_EQ(accumulated["content"], message["content"]);
}

TEST_F(OpenAiToolCallsTest, DeepSeekV31ThinksOnlyWhenAsked) {
  // deepseek-v3.1 (reasoning deepseek_r1, from the template) ends the prompt in "</think>" without thinking
  // and in "<think>" with chat_template_kwargs {"thinking": true}.
  serve("deepseek-v3.1");
  json request{{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"max_tokens", 200}};
  json message = whole(request, "Sunny.")["choices"][0]["message"];
  EXPECT_EQ(message["content"], "Sunny.");
  EXPECT_TRUE(message["reasoning_content"].is_null());
  request["chat_template_kwargs"] = {{"thinking", true}};
  message = whole(request, "Paris is in France.</think>Sunny.")["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "Paris is in France.");
  EXPECT_EQ(message["content"], "Sunny.");
}

}  // namespace
}  // namespace capserve::server::http
