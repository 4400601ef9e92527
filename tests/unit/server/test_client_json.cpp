// The depth-bounded parser of client JSON (server/client_json.h) and its use by the shared intake: the limit
// exact, a refusal naming the field, a deep document refused before anything is built (at the depth of the
// issue-24 crash too), and every accepted document within what the chat template engine renders.
#include "server/client_json.h"

#include "server/request_intake.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

std::string nested_arrays(int levels, const std::string& inner = "1") {
  return std::string(levels, '[') + inner + std::string(levels, ']');
}

// {"a": {"a": ... inner ...}}: `levels` objects.
std::string nested_objects(int levels, const std::string& inner = "1") {
  std::string out;
  for (int i = 0; i < levels; ++i) out += R"({"a":)";
  return out + inner + std::string(levels, '}');
}

template <typename Json>
void expect_limit_exact(const std::string& what, std::string (*nested)(int, const std::string&)) {
  const runtime::StatusOr<Json> out = parse_client_json<Json>(nested(kMaxClientJsonDepth, "1"), "f");
  ASSERT_TRUE(out.ok()) << what;
  EXPECT_FALSE(out->is_null()) << what;
  const runtime::StatusOr<Json> refused = parse_client_json<Json>(nested(kMaxClientJsonDepth + 1, "1"), "f");
  ASSERT_FALSE(refused.ok()) << what;
  EXPECT_EQ(refused.status().code(), runtime::StatusCode::invalid_argument);
  EXPECT_EQ(refused.status().field(), "f");
  EXPECT_NE(refused.status().message().find("deeper than 64 levels"), std::string::npos)
      << refused.status().message();
}

TEST(ClientJson, TheDepthLimitIsExactForArraysAndObjects) {
  expect_limit_exact<json>("arrays", nested_arrays);
  expect_limit_exact<ordered_json>("arrays", nested_arrays);
  expect_limit_exact<json>("objects", nested_objects);
  expect_limit_exact<ordered_json>("objects", nested_objects);
  // Scalars and empty containers count their own level only.
  EXPECT_TRUE(parse_client_json<json>("3", "f").ok());
  EXPECT_TRUE(parse_client_json<json>(nested_arrays(kMaxClientJsonDepth - 1, "[]"), "f").ok());
  EXPECT_FALSE(parse_client_json<json>(nested_arrays(kMaxClientJsonDepth, "{}"), "f").ok());
  // Siblings do not add up: depth is nesting, not the number of containers.
  std::string wide = "[";
  for (int i = 0; i < 1000; ++i) wide += nested_arrays(kMaxClientJsonDepth - 1) + ",";
  wide += "1]";
  EXPECT_TRUE(parse_client_json<json>(wide, "f").ok());
}

TEST(ClientJson, BracketsInsideStringsAreText) {
  const std::string text = "[\"" + std::string(200000, '[') + std::string(200000, '{') + "\"]";
  const runtime::StatusOr<ordered_json> out = parse_client_json<ordered_json>(text, "f");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].get_ref<const std::string&>().size(), 400000U);
}

// The issue-24 crash: a deep object in an unknown key before another key (ordered_json copied the deep value
// recursively when the outer object grew) killed rank 0 with SIGSEGV. 200k levels are refused at level 65.
TEST(ClientJson, AVeryDeepDocumentIsRefusedQuicklyBeforeAnythingIsBuilt) {
  const std::string body = R"({"x":)" + nested_objects(200000) + R"(,"messages":[]})";
  const auto start = std::chrono::steady_clock::now();
  const runtime::StatusOr<ordered_json> ordered = parse_client_json<ordered_json>(body, "");
  const runtime::StatusOr<json> plain = parse_client_json<json>(nested_arrays(200000), "tools");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(ordered.ok());
  EXPECT_EQ(ordered.status().field(), "x");
  EXPECT_EQ(ordered.status().message(), "x.a.a.a...: JSON nests deeper than 64 levels of arrays and objects");
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.status().message(),
            "tools[0][0][0][0]...: JSON nests deeper than 64 levels of arrays and objects");
  // The scan stops at level 65 of 200k: microseconds; the bound only guards against a full parse.
  EXPECT_LT(seconds, 1.0);
}

TEST(ClientJson, ErrorsNameTheFieldAndThePath) {
  const std::string deep_call = R"({"model":"m","messages":[{"role":"assistant","tool_calls":[)" +
                                nested_objects(kMaxClientJsonDepth) + "]}]}";
  runtime::StatusOr<json> e = parse_client_json<json>(deep_call, "");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().field(), "messages");
  EXPECT_EQ(e.status().message().rfind("messages[0].tool_calls[0]...: JSON nests deeper", 0), 0U)
      << e.status().message();

  // A body that is not an object names the body.
  e = parse_client_json<json>(nested_arrays(kMaxClientJsonDepth + 1), "");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().field(), "");
  EXPECT_EQ(e.status().message().rfind("the request body[0][0][0][0]...: ", 0), 0U) << e.status().message();

  // A long key is cut in the message.
  const std::string key(1000, 'k');
  e = parse_client_json<json>("{\"" + key + "\":" + nested_arrays(kMaxClientJsonDepth) + "}", "");
  ASSERT_FALSE(e.ok());
  EXPECT_LT(e.status().message().size(), 200U) << e.status().message();

  // Syntax errors keep nlohmann's words and position.
  const runtime::StatusOr<ordered_json> field =
      parse_client_json<ordered_json>(R"({"a": [1, 2}")", "chat_template_kwargs");
  ASSERT_FALSE(field.ok());
  EXPECT_EQ(field.status().field(), "chat_template_kwargs");
  EXPECT_EQ(field.status().message().rfind("chat_template_kwargs: not valid JSON (", 0), 0U)
      << field.status().message();
  e = parse_client_json<json>("{} {}", "");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().message().rfind("the request body: not valid JSON (", 0), 0U) << e.status().message();
  EXPECT_FALSE(parse_client_json<json>("", "").ok());
}

TEST(ClientJson, KeysKeepTheClientsOrder) {
  const runtime::StatusOr<ordered_json> out =
      parse_client_json<ordered_json>(R"({"z": 1, "a": {"y": 2, "b": 3}})", "f");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->dump(), R"({"z":1,"a":{"y":2,"b":3}})");
}

// Repeated keys: the last value at the first one's place, as nlohmann's own parser (and Python's json) keep
// them, in small objects (searched) and large ones (indexed).
TEST(ClientJson, RepeatedKeysAsNlohmannParsesThem) {
  for (const int keys : {3, 40}) {
    std::string text = "{";
    for (int i = 0; i < keys; ++i)
      text += "\"k" + std::to_string(i % (keys / 2 + 1)) + "\": [" + std::to_string(i) + "],";
    text += R"("last": {"x": 1, "x": {"y": 2}}})";
    const runtime::StatusOr<ordered_json> out = parse_client_json<ordered_json>(text, "f");
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(out->dump(), ordered_json::parse(text).dump()) << keys;
  }
}

// One object of many keys (a tool schema of 300k properties) costs time linear in its size; before, each key
// was inserted by a linear search (nlohmann's ordered_map), about 27 s for a 3.7 MB body of 60k keys on a
// loaded machine, and this one would take many minutes. The bound is loose: the linear parse takes well under
// 1 s.
TEST(ClientJson, AnObjectOfManyKeysParsesInLinearTime) {
  constexpr int kKeys = 300000;
  std::string text = R"({"properties": {)";
  for (int i = 0; i < kKeys; ++i) text += "\"p" + std::to_string(i) + R"(": {"type": "string"},)";
  text.back() = '}';
  text += '}';
  const auto start = std::chrono::steady_clock::now();
  runtime::StatusOr<ordered_json> parsed = parse_client_json<ordered_json>(text, "tools");
  ASSERT_TRUE(parsed.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ordered_json& out = *parsed;
  ASSERT_EQ(out["properties"].size(), static_cast<std::size_t>(kKeys));
  EXPECT_EQ(out["properties"].begin().key(), "p0");
  EXPECT_EQ((--out["properties"].end()).key(), "p" + std::to_string(kKeys - 1));
}

// Every document the parser accepts renders through the template engine (whose tojson and value conversion
// stop at 256 levels); before, a 300-level tools list was accepted and the template's ValueError escaped the
// intake as an HTTP 500 / gRPC UNKNOWN.
TEST(ClientJson, EveryAcceptedDocumentRendersAndDeeperOnesAreTheClientsError) {
  const runtime::Tokenizer tokenizer = load_tiny_tokenizer();
  Scheduler scheduler({}, 1, &tokenizer, nullptr, nullptr);
  ServiceLimits limits;
  limits.model_id = "tiny";
  limits.vocab_size = tokenizer.vocab_size();
  runtime::ChatTemplate chat_template(
      "{{ messages | tojson }}{{ tools | tojson(indent=1) }}{{ deep | tojson }}{{ {'w': [messages, tools]} | "
      "tojson }}",
      {}, "test");
  RequestIntake intake(scheduler, &tokenizer, std::move(chat_template), limits, nullptr);

  // The deepest documents each gRPC field accepts.
  const std::string tool = R"({"type":"function","function":{"name":"f","parameters":)";
  runtime::StatusOr<ordered_json> tools =
      parse_json_field("[" + tool + nested_objects(kMaxClientJsonDepth - 3) + "}}]", "tools");
  ASSERT_TRUE(tools.ok());
  runtime::StatusOr<ordered_json> kwargs =
      parse_json_field(R"({"deep":)" + nested_arrays(kMaxClientJsonDepth - 1) + "}", "chat_template_kwargs");
  ASSERT_TRUE(kwargs.ok());
  runtime::ChatMessage call{"assistant", "", ordered_json::object()};
  runtime::StatusOr<ordered_json> calls =
      parse_json_field(R"([{"type":"function","function":{"name":"f","arguments":)" +
                           nested_objects(kMaxClientJsonDepth - 3) + "}}]",
                       "messages[1].tool_calls");
  ASSERT_TRUE(calls.ok());
  call.fields["tool_calls"] = std::move(*calls);
  IntakeRequest request;
  ChatPrompt chat{{{"user", "hi", ordered_json::object()}, std::move(call)}, {}};
  chat.inputs.tools = std::move(*tools);
  chat.inputs.kwargs = std::move(*kwargs);
  request.prompts.push_back({std::move(chat), "messages"});
  const runtime::StatusOr<RequestIntake::Admitted> rendered = intake.admit(request, [] {});
  ASSERT_TRUE(rendered.ok()) << rendered.status().message();
  EXPECT_FALSE(rendered->requests.at(0)->prompt().empty());

  // Past the template engine's own limit: refused at the parser, naming the field.
  const runtime::StatusOr<ordered_json> refused =
      parse_json_field("[" + tool + nested_objects(300) + "}}]", "tools");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), runtime::StatusCode::invalid_argument);
  EXPECT_EQ(refused.status().field(), "tools");
  EXPECT_EQ(
      refused.status().message().rfind("tools[0].function.parameters.a...: JSON nests deeper than 64", 0), 0U)
      << refused.status().message();
}

}  // namespace
}  // namespace capserve::server
