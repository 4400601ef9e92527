// Tool calls, tools and template kwargs through the API path (message_from_json, ChatInputs,
// ChatTemplate::render) against the Python Jinja2 goldens of the chat-template corpus
// (../shared/data/chat_templates): the two tool-call message shapes and enable_thinking=False render
// byte-identical to transformers' apply_chat_template.
#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime {
namespace {

using Json = nlohmann::ordered_json;

using testing::corpus_dir;
using testing::corpus_template;
using testing::find_record;

// The scenario's kwargs as an API request carries them: messages, tools, add_generation_prompt, and the rest
// as chat_template_kwargs.
Status render_scenario(const ChatTemplate& chat_template, const std::string& name, std::string& out) {
  std::ifstream in(corpus_dir() / "scenarios.json");
  const Json spec = Json::parse(in);
  for (const Json& scenario : spec.at("scenarios")) {
    if (scenario.at("name") != name) continue;
    std::vector<ChatMessage> messages;
    ChatInputs inputs;
    for (const auto& [key, value] : scenario.at("kwargs").items()) {
      if (key == "messages") {
        for (const Json& m : value) {
          ChatMessage message;
          const std::optional<std::string> error = message_from_json(m, message);
          EXPECT_FALSE(error) << *error;
          messages.push_back(std::move(message));
        }
      } else if (key == "tools") {
        inputs.tools = spec.at("tools");
      } else if (key == "add_generation_prompt") {
        inputs.add_generation_prompt = value.get<bool>();
      } else {
        inputs.kwargs[key] = value;
      }
    }
    return chat_template.render(messages, inputs, out);
  }
  ADD_FAILURE() << "no scenario " << name;
  return Status::invalid_argument("no scenario");
}

struct Case {
  const char* template_id;
  const char* scenario;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.template_id << " / " << c.scenario;
}

class ChatToolsGolden : public ::testing::TestWithParam<Case> {};

TEST_P(ChatToolsGolden, RendersLikeApplyChatTemplate) {
  const Case c = GetParam();
  const Json golden = find_record("renders.jsonl", c.template_id, c.scenario);
  ASSERT_FALSE(golden.is_null());
  ASSERT_TRUE(golden.at("ok").get<bool>());
  std::string out;
  const Status status = render_scenario(corpus_template(c.template_id), c.scenario, out);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(out, golden.at("output").get<std::string>());
}

INSTANTIATE_TEST_SUITE_P(Corpus, ChatToolsGolden,
                         ::testing::Values(Case{"qwen2.5-instruct", "e1_tool_call_hf_style"},
                                           Case{"qwen2.5-instruct", "e2_tool_call_openai_style"},
                                           Case{"hermes2-pro-llama3-tool-use", "e1_tool_call_hf_style"},
                                           Case{"hermes2-pro-llama3-tool-use", "e2_tool_call_openai_style"},
                                           Case{"qwen3", "f_enable_thinking_false"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = std::string(info.param.template_id) + "_" + info.param.scenario;
                           for (char& ch : name) {
                             if (std::isalnum(static_cast<unsigned char>(ch)) == 0) ch = '_';
                           }
                           return name;
                         });

ChatTemplate inline_template(const char* source) {
  return ChatTemplate::from_tokenizer_config(
      nlohmann::json{{"chat_template", source}, {"eos_token", "</s>"}});
}

TEST(ChatInputs, KwargsOverrideSpecialTokensButNotReservedVariables) {
  const ChatTemplate t = inline_template("{{ eos_token }}|{{ greeting }}|{{ add_generation_prompt }}");
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  std::string out;
  ASSERT_TRUE(t.render(messages, {.kwargs = {{"greeting", "hello"}, {"eos_token", "<e>"}}}, out).ok());
  EXPECT_EQ(out, "<e>|hello|True");
  for (const char* reserved : {"messages", "tools", "documents", "add_generation_prompt"}) {
    const Status s = t.render(messages, {.kwargs = {{reserved, 1}}}, out);
    ASSERT_FALSE(s.ok()) << reserved;
    EXPECT_NE(s.message().find(reserved), std::string::npos) << s.message();
  }
  EXPECT_FALSE(t.render(messages, {.kwargs = Json::array()}, out).ok());
  EXPECT_FALSE(t.render(messages, {.tools = Json::object()}, out).ok());
}

// A render whose client has gone is cancelled at the renderer's next bound check, not run to its end.
TEST(ChatInputs, ARequestedStopCancelsTheRender) {
  // Loops of 10^9 iterations that build a 1 MB string in each: hours of work, with the work budget and the
  // loop bound raised so that only the stop can end it.
  ChatTemplate slow = inline_template(
      "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% set x = 'a' * "
      "1000000 %}"
      "{% endfor %}{% endfor %}{% endfor %}{{ messages[0].content }}");
  jinja::RenderOptions unbounded = slow.limits();
  unbounded.max_steps = std::uint64_t{1} << 50;
  unbounded.max_loop_iterations = std::size_t{1} << 40;
  slow.set_limits(unbounded);
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  std::string out;
  std::stop_source stopped;
  stopped.request_stop();
  const Status at_once = slow.render(messages, {}, out, stopped.get_token());
  ASSERT_FALSE(at_once.ok());
  EXPECT_NE(at_once.message().find("cancelled"), std::string::npos) << at_once.message();

  std::stop_source stop;
  const auto start = std::chrono::steady_clock::now();
  std::jthread canceller([&stop] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stop.request_stop();
  });
  const Status midway = slow.render(messages, {}, out, stop.get_token());
  EXPECT_FALSE(midway.ok());
  EXPECT_NE(midway.message().find("cancelled"), std::string::npos) << midway.message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // Output alone is checked too.
  EXPECT_FALSE(inline_template("{{ messages[0].content }}").render(messages, {}, out, stop.get_token()).ok());
  std::stop_source unused;
  ASSERT_TRUE(
      inline_template("{{ messages[0].content }}").render(messages, {}, out, unused.get_token()).ok());
  EXPECT_EQ(out, "hi");
}

// The limits a deployment sets apply to every render: the default work budget refuses a loop that a raised
// one lets finish.
TEST(ChatInputs, TheTemplatesLimitsApplyToEveryRender) {
  ChatTemplate t =
      inline_template("{% for i in range(200000) %}{% set x = i %}{% endfor %}{{ messages[0].content }}");
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  jinja::RenderOptions tight = t.limits();
  tight.max_steps = 1000;
  t.set_limits(tight);
  std::string out;
  const Status refused = t.render(messages, {}, out);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("work budget (1000 steps)"), std::string::npos) << refused.message();
  tight.max_steps = 10'000'000;
  t.set_limits(tight);
  ASSERT_TRUE(t.render(messages, {}, out).ok());
  EXPECT_EQ(out, "hi");
}

TEST(ChatInputs, MessageKeysReachTheTemplateAsSent) {
  const ChatTemplate t = inline_template(
      "{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:{{ m.content is none }}:"
      "{{ m.tool_calls[0].function.arguments | tojson if m.tool_calls else '' }}:{{ m.tool_call_id }};"
      "{% endfor %}");
  std::vector<ChatMessage> messages(3);
  ASSERT_FALSE(
      message_from_json(Json::parse(R"({"role": "developer", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "b"}]})"),
                        messages[0]));
  EXPECT_EQ(messages[0].role, "system");
  EXPECT_EQ(messages[0].content, "a\nb");  // vLLM joins text parts with newlines
  ASSERT_FALSE(message_from_json(Json::parse(R"({"role": "assistant", "content": null, "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": 2}}}]})"),
                                 messages[1]));
  ASSERT_FALSE(message_from_json(Json::parse(R"({"role": "tool", "tool_call_id": "c1", "content": "3"})"),
                                 messages[2]));
  std::string out;
  ASSERT_TRUE(t.render(messages, {}, out).ok());
  EXPECT_EQ(out, "system:True:False::;assistant:True:True:{\"z\": 1, \"a\": 2}:;tool:True:False::c1;");

  ChatMessage bad;
  EXPECT_EQ(message_from_json(Json::parse(R"({"content": "x"})"), bad), ".role: required, a string");
  EXPECT_TRUE(message_from_json(Json::parse(R"({"role": "user", "content": [{"type": "image_url"}]})"), bad));
  EXPECT_TRUE(message_from_json(Json::parse(R"({"role": "user", "content": 3})"), bad));
}

TEST(ChatInputs, ContinueFinalMessageEndsAfterItsContent) {
  const ChatTemplate t = inline_template(
      "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}");
  const std::vector<ChatMessage> messages = {{"user", "Hi"}, {"assistant", "The answer is "}};
  RenderedPrompt prompt;
  ASSERT_TRUE(
      t.render(messages, {.add_generation_prompt = false, .continue_final_message = true}, prompt).ok());
  EXPECT_EQ(prompt.text, "<|user|>Hi<|end|><|assistant|>The answer is");
  ASSERT_EQ(prompt.content.size(), 2U);
  EXPECT_EQ(prompt.content[1].end, prompt.text.size());
  // Leading whitespace: transformers keeps only the stripped text.
  const ChatTemplate verbatim = inline_template("{% for m in messages %}[{{ m.content }}]{% endfor %}");
  const ChatInputs continuing{.add_generation_prompt = false, .continue_final_message = true};
  ASSERT_TRUE(verbatim.render({{{"user", "Hi"}, {"assistant", " go on "}}}, continuing, prompt).ok());
  EXPECT_EQ(prompt.text, "[Hi][ go on");
  ASSERT_TRUE(verbatim.render({{{"user", "Hi"}, {"assistant", "go on "}}}, continuing, prompt).ok());
  EXPECT_EQ(prompt.text, "[Hi][go on ");
  const std::vector<ChatMessage> no_text = {{"user", "Hi"}, {"assistant", std::nullopt}};
  EXPECT_FALSE(t.render(no_text, continuing, prompt).ok());
  const ChatTemplate drops = inline_template("{% for m in messages %}{{ m.role }}{% endfor %}");
  EXPECT_FALSE(drops.render(messages, continuing, prompt).ok());
}

}  // namespace
}  // namespace capserve::runtime
