// The chat output parsers (server/chat_output/) on the formats the chat-template corpus
// (../shared/data/chat_templates) renders for an assistant turn with tool calls (scenario e1, the HF-style
// call get_current_weather({"location": "Paris, France", "unit": "celsius"})), checked against what vLLM's
// parsers of the same names return; every text also split at every byte and fed byte by byte: the deltas
// must add up to the whole.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "runtime/tokenizer/tokenizer.h"
#include "server/chat_output/chat_output_parser.h"
#include "server/chat_output/forced_tool_calls.h"

namespace capserve::server::chat_output {
namespace {

constexpr std::string_view kArguments = R"({"location": "Paris, France", "unit": "celsius"})";

using Factory = std::function<ChatOutputParser()>;

Factory tools(ToolCallFormat format, bool parallel = true) {
  return [=] { return ChatOutputParser(std::nullopt, make_tool_call_parser(format, {parallel, 7})); };
}

Factory reasoning(ReasoningFormat format, PromptThinking prompt, std::optional<ToolCallFormat> tool = {}) {
  return [=] {
    return ChatOutputParser(ReasoningParser(format, prompt),
                            tool ? make_tool_call_parser(*tool, {true, 7}) : nullptr);
  };
}

Factory forced(ForcedToolChoice choice, bool parallel = true) {
  return [=] { return ChatOutputParser(std::nullopt, make_forced_tool_call_parser(choice, {parallel, 7})); };
}

ChatMessageOut run(const Factory& make, const std::vector<std::string_view>& pieces) {
  ChatOutputParser parser = make();
  ChatMessageOut out;
  for (const std::string_view piece : pieces) out.add(parser.feed(piece));
  out.add(parser.finish());
  return out;
}

// The whole text's message, after checking that every split (and byte-by-byte feeding) gives the same.
ChatMessageOut parse(const Factory& make, std::string_view text) {
  const ChatMessageOut whole = run(make, {text});
  for (std::size_t at = 0; at <= text.size(); ++at)
    EXPECT_EQ(run(make, {text.substr(0, at), text.substr(at)}), whole) << "split at " << at << ": " << text;
  std::vector<std::string_view> bytes;
  for (std::size_t i = 0; i < text.size(); ++i) bytes.push_back(text.substr(i, 1));
  EXPECT_EQ(run(make, bytes), whole) << "byte by byte: " << text;
  return whole;
}

void expect_weather_call(const ChatMessageOut& m, std::size_t index = 0) {
  ASSERT_GT(m.tool_calls.size(), index);
  EXPECT_EQ(m.tool_calls[index].name, "get_current_weather");
  EXPECT_EQ(m.tool_calls[index].arguments, kArguments);
}

TEST(ToolCallParser, HermesAsQwen3Renders) {
  // qwen3-thinking-2507 (and every Qwen 2.5 / 3 template): the assistant's turn.
  const std::string call =
      "<tool_call>\n{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Paris, France\", "
      "\"unit\": \"celsius\"}}\n</tool_call>";
  ChatMessageOut m = parse(tools(ToolCallFormat::hermes), call);
  EXPECT_EQ(m.content, "");
  expect_weather_call(m);
  EXPECT_TRUE(m.tool_calls[0].id.starts_with("chatcmpl-tool-")) << m.tool_calls[0].id;
  EXPECT_EQ(m.tool_calls[0].id.size(), 14U + 32U);

  // Text before the first call is content; two calls; text after a call is dropped (as vLLM).
  m = parse(tools(ToolCallFormat::hermes), "Let me check. " + call + "\n" + call + " done");
  EXPECT_EQ(m.content, "Let me check. ");
  ASSERT_EQ(m.tool_calls.size(), 2U);
  expect_weather_call(m, 1);
  EXPECT_NE(m.tool_calls[0].id, m.tool_calls[1].id);

  // parallel_tool_calls false: one call.
  m = parse(tools(ToolCallFormat::hermes, false), call + "\n" + call);
  EXPECT_EQ(m.tool_calls.size(), 1U);

  // No call: all content, also text that only looks like the start of the marker.
  m = parse(tools(ToolCallFormat::hermes), "a <tool and <tool_cal");
  EXPECT_EQ(m.content, "a <tool and <tool_cal");
  EXPECT_TRUE(m.tool_calls.empty());

  // A call whose JSON does not parse stays content as written; an unclosed last call counts when whole.
  m = parse(tools(ToolCallFormat::hermes), "<tool_call>\n{\"name\": \"f\", \"arguments\": {]}\n</tool_call>");
  EXPECT_EQ(m.content, "<tool_call>\n{\"name\": \"f\", \"arguments\": {]}\n</tool_call>");
  EXPECT_TRUE(m.tool_calls.empty());
  m = parse(tools(ToolCallFormat::hermes), "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}");
  ASSERT_EQ(m.tool_calls.size(), 1U);
  EXPECT_EQ(m.tool_calls[0].arguments, "{}");

  // vLLM's serialisation: the model's key order, `, ` and `: `, non-ASCII as is, nested values.
  m = parse(
      tools(ToolCallFormat::hermes),
      "<tool_call>{\"name\":\"f\",\"arguments\":{\"z\":1,\"a\":[true,null,2.5],\"s\":\"é\\n\"}}</tool_call>");
  ASSERT_EQ(m.tool_calls.size(), 1U);
  EXPECT_EQ(m.tool_calls[0].arguments, "{\"z\": 1, \"a\": [true, null, 2.5], \"s\": \"é\\n\"}");
}

TEST(ToolCallParser, MistralAsNemoRenders) {
  // mistral-nemo-instruct-2407: the assistant's turn (the id the template adds is not the model's to pick).
  const std::string calls =
      "[TOOL_CALLS][{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Paris, France\", "
      "\"unit\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
  ChatMessageOut m = parse(tools(ToolCallFormat::mistral), calls);
  EXPECT_EQ(m.content, "");
  ASSERT_EQ(m.tool_calls.size(), 2U);
  expect_weather_call(m);
  EXPECT_EQ(m.tool_calls[1].name, "get_time");
  EXPECT_EQ(m.tool_calls[1].arguments, "{}");
  for (const ToolCall& c : m.tool_calls) {
    EXPECT_EQ(c.id.size(), 9U);  // Mistral's templates refuse other ids
    for (const char ch : c.id) EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(ch))) << c.id;
  }
  m = parse(tools(ToolCallFormat::mistral, false), calls);
  EXPECT_EQ(m.tool_calls.size(), 1U);
  m = parse(tools(ToolCallFormat::mistral), "Plain answer [TOOL");
  EXPECT_EQ(m.content, "Plain answer [TOOL");
}

TEST(ToolCallParser, Llama3JsonAsLlama31Renders) {
  // llama3.1-instruct: the assistant's turn (after its header).
  const std::string call =
      "{\"name\": \"get_current_weather\", \"parameters\": {\"location\": \"Paris, France\", \"unit\": "
      "\"celsius\"}}";
  ChatMessageOut m = parse(tools(ToolCallFormat::llama3_json), call);
  EXPECT_EQ(m.content, "");
  expect_weather_call(m);
  m = parse(tools(ToolCallFormat::llama3_json), call + "; {\"name\": \"get_time\", \"parameters\": {}}");
  ASSERT_EQ(m.tool_calls.size(), 2U);
  EXPECT_EQ(m.tool_calls[1].name, "get_time");
  m = parse(tools(ToolCallFormat::llama3_json), "It is sunny {\"name\": \"x\"}");
  EXPECT_EQ(m.content, "It is sunny {\"name\": \"x\"}");
  EXPECT_TRUE(m.tool_calls.empty());
  m = parse(tools(ToolCallFormat::llama3_json), "{\"answer\": 42}");  // JSON that is no call: content
  EXPECT_EQ(m.content, "{\"answer\": 42}");
  EXPECT_TRUE(m.tool_calls.empty());
}

TEST(ToolCallParser, DeepSeekV3AsItsTemplatesRender) {
  // deepseek-v3-0324 (and R1-0528): the assistant's turn.
  const std::string v3 =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n{"
      "\"location\": "
      "\"Paris, France\", \"unit\": \"celsius\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  ChatMessageOut m = parse(tools(ToolCallFormat::deepseek_v3), "Checking.\n\n" + v3);
  EXPECT_EQ(m.content, "Checking.\n\n");
  expect_weather_call(m);
  // deepseek-v3.1: name<sep>arguments.
  const std::string v31 =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{\"location\": \"Paris, "
      "France\", \"unit\": \"celsius\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  m = parse(tools(ToolCallFormat::deepseek_v3), v31);
  ASSERT_EQ(m.tool_calls.size(), 2U);
  expect_weather_call(m);
  EXPECT_EQ(m.tool_calls[1].name, "get_time");
}

TEST(ToolCallParser, FormatsByNameAndFromTheTemplate) {
  for (const auto f : {ToolCallFormat::hermes, ToolCallFormat::mistral, ToolCallFormat::llama3_json,
                       ToolCallFormat::deepseek_v3})
    EXPECT_EQ(tool_call_format_named(format_name(f)), f);
  EXPECT_EQ(tool_call_format_named("pythonic"), std::nullopt);
  EXPECT_EQ(detect_tool_call_format("{{- '<tool_call>\\n' }}"), ToolCallFormat::hermes);
  EXPECT_EQ(detect_tool_call_format("{{- \"[TOOL_CALLS][\" }}"), ToolCallFormat::mistral);
  EXPECT_EQ(detect_tool_call_format("{{'<｜tool▁calls▁begin｜>'}}"), ToolCallFormat::deepseek_v3);
  EXPECT_EQ(detect_tool_call_format("{{- '<|python_tag|>' }}"), ToolCallFormat::llama3_json);
  EXPECT_EQ(detect_tool_call_format("{{ message.content }}"), std::nullopt);
  EXPECT_EQ(tool_call_format_for("none", "<tool_call>"), std::nullopt);
  EXPECT_EQ(tool_call_format_for("auto", "<tool_call>"), ToolCallFormat::hermes);
  EXPECT_EQ(tool_call_format_for("mistral", "<tool_call>"), ToolCallFormat::mistral);
}

// tool_choice with a named function: the constrained output is the arguments, streamed as they come (vLLM's
// named tool choice), and the choice ends "stop"; an empty output is a call without arguments.
TEST(ForcedToolCalls, ANamedFunctionsOutputIsItsArguments) {
  const ChatMessageOut m = parse(forced({"get_current_weather"}), kArguments);
  ASSERT_EQ(m.tool_calls.size(), 1U);
  expect_weather_call(m);
  EXPECT_TRUE(m.content.empty());
  ChatOutputParser parser = forced({"get_current_weather"})();
  const ChatDelta first = parser.feed(R"({"loc)");
  ASSERT_EQ(first.tool_calls.size(), 1U);
  EXPECT_EQ(first.tool_calls[0].name, "get_current_weather");
  EXPECT_FALSE(first.tool_calls[0].id.empty());
  EXPECT_EQ(first.tool_calls[0].arguments, R"({"loc)");
  const ChatDelta next = parser.feed(R"(ation": "Oslo"})");
  ASSERT_EQ(next.tool_calls.size(), 1U);
  EXPECT_TRUE(next.tool_calls[0].id.empty());
  EXPECT_EQ(next.tool_calls[0].arguments, R"(ation": "Oslo"})");
  EXPECT_FALSE(parser.ends_in_tool_calls());
  const ChatMessageOut empty = run(forced({"get_current_weather"}), {});
  ASSERT_EQ(empty.tool_calls.size(), 1U);
  EXPECT_EQ(empty.tool_calls[0].arguments, "");
}

// tool_choice "required": the constrained output is a list of {"name", "parameters"}; each element is a call
// once complete (braces and brackets inside strings do not count), arguments in vLLM's serialisation; the
// choice ends "tool_calls". With parallel_tool_calls false the first is kept; an element cut by max_tokens
// is none.
TEST(ForcedToolCalls, RequiredOutputIsAListOfCalls) {
  const std::string first =
      R"({"name": "get_current_weather", "parameters": )" + std::string(kArguments) + "}";
  const std::string text = "[" + first + R"(,{"name":"get_time","parameters":{"zone":"a \"}{[\\ b"}}])";
  const ChatMessageOut m = parse(forced({}), text);
  ASSERT_EQ(m.tool_calls.size(), 2U);
  expect_weather_call(m);
  EXPECT_EQ(m.tool_calls[1].name, "get_time");
  EXPECT_EQ(m.tool_calls[1].arguments, R"({"zone": "a \"}{[\\ b"})");
  EXPECT_NE(m.tool_calls[0].id, m.tool_calls[1].id);
  EXPECT_TRUE(m.content.empty());
  ChatOutputParser parser = forced({})();
  static_cast<void>(parser.feed(text));
  EXPECT_TRUE(parser.ends_in_tool_calls());
  EXPECT_EQ(parse(forced({}, false), text).tool_calls.size(), 1U);
  const ChatMessageOut cut = parse(forced({}), "[" + first + R"(, {"name": "get_time", "parameters": {"zo)");
  ASSERT_EQ(cut.tool_calls.size(), 1U);
  expect_weather_call(cut);
}

TEST(ReasoningParser, DeepSeekR1StartsInsideTheThinking) {
  // R1's template opens <think> in the prompt: the output starts inside it.
  ChatMessageOut m = parse(reasoning(ReasoningFormat::deepseek_r1, PromptThinking::neither),
                           "Paris is in France.\n</think>\n\nSunny.");
  EXPECT_EQ(m.reasoning, "Paris is in France.\n");
  EXPECT_EQ(m.content, "\n\nSunny.");
  m = parse(reasoning(ReasoningFormat::deepseek_r1, PromptThinking::neither),
            "<think>Hmm</think>Yes");  // a <think> of its own
  EXPECT_EQ(m.reasoning, "Hmm");
  EXPECT_EQ(m.content, "Yes");
  // DeepSeek-V3.1 without thinking: its template closes the thinking in the prompt
  // ("<｜Assistant｜></think>").
  m = parse(reasoning(ReasoningFormat::deepseek_r1, PromptThinking::closed), "Sunny.");
  EXPECT_EQ(m.reasoning, "");
  EXPECT_EQ(m.content, "Sunny.");
  m = parse(reasoning(ReasoningFormat::deepseek_r1, PromptThinking::neither),
            "still thinking </thi");  // cut by max_tokens
  EXPECT_EQ(m.reasoning, "still thinking </thi");
  EXPECT_EQ(m.content, "");
}

TEST(ReasoningParser, Qwen3ThinksWhereTheOutputOrThePromptOpensIt) {
  ChatMessageOut m = parse(reasoning(ReasoningFormat::qwen3, PromptThinking::neither),
                           "<think>\nLet me see.\n</think>\n\nHi!");
  EXPECT_EQ(m.reasoning, "\nLet me see.\n");
  EXPECT_EQ(m.content, "\n\nHi!");
  m = parse(reasoning(ReasoningFormat::qwen3, PromptThinking::neither),
            "Hi! No </think> here");  // enable_thinking false
  EXPECT_EQ(m.reasoning, "");
  EXPECT_EQ(m.content, "Hi! No </think> here");
  // qwen3-thinking-2507 ends its prompt in "<think>\n" (the corpus' render of scenario e1).
  EXPECT_EQ(prompt_thinking("<|im_start|>assistant\n<think>\n"), PromptThinking::opened);
  EXPECT_EQ(prompt_thinking("<|im_start|>assistant\n"), PromptThinking::neither);
  EXPECT_EQ(prompt_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"), PromptThinking::closed);
  m = parse(reasoning(ReasoningFormat::qwen3, PromptThinking::opened), "Paris.\n</think>\n\nSunny.");
  EXPECT_EQ(m.reasoning, "Paris.\n");
  EXPECT_EQ(m.content, "\n\nSunny.");
  EXPECT_EQ(detect_reasoning_format("{{'<｜Assistant｜>'}}{{'</think>'}}"), ReasoningFormat::deepseek_r1);
  EXPECT_EQ(detect_reasoning_format("content.split('</think>')"), ReasoningFormat::qwen3);
  EXPECT_EQ(detect_reasoning_format("{{ message.content }}"), std::nullopt);
}

TEST(ChatOutputParser, ReasoningThenToolCalls) {
  // Qwen3 thinks, then calls a tool: reasoning_content, and the call; no content.
  const std::string text =
      "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_current_weather\", "
      "\"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}\n</tool_call>";
  const ChatMessageOut m =
      parse(reasoning(ReasoningFormat::qwen3, PromptThinking::neither, ToolCallFormat::hermes), text);
  EXPECT_EQ(m.reasoning, "\nThe user wants the weather.\n");
  EXPECT_EQ(m.content, "\n\n");
  expect_weather_call(m);
}

// The markers must survive the server's decoding (skip_special_tokens, token by token): in the real Qwen3 and
// DeepSeek-V3 tokenizers they are single added tokens that are not special, and the parser fed the
// incremental decoder's pieces gives the message of the whole text.
TEST(ChatOutputParser, RealTokenizersKeepTheMarkersThroughIncrementalDecoding) {
  const std::filesystem::path tokenizers = std::filesystem::path(CAPSERVE_SHARED_DATA_DIR) / "tokenizers";
  struct Case {
    const char* tokenizer;
    Factory make;
    std::string text;
    std::vector<std::string> markers;
  };
  const std::vector<Case> cases = {
      {"qwen3",
       reasoning(ReasoningFormat::qwen3, PromptThinking::neither, ToolCallFormat::hermes),
       "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_current_weather\", "
       "\"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}\n</tool_call>",
       {"<think>", "</think>", "<tool_call>", "</tool_call>"}},
      {"deepseek_v3",
       reasoning(ReasoningFormat::deepseek_r1, PromptThinking::neither, ToolCallFormat::deepseek_v3),
       "Paris.\n</"
       "think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```"
       "json\n{\"location\": \"Paris, France\", \"unit\": "
       "\"celsius\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tokenizer);
    const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(tokenizers / c.tokenizer);
    for (const std::string& marker : c.markers) {
      const std::optional<std::int32_t> id = tokenizer.token_to_id(marker);
      ASSERT_TRUE(id.has_value()) << marker;
      EXPECT_FALSE(tokenizer.is_special(*id)) << marker;
    }
    std::vector<std::int32_t> ids;
    ASSERT_TRUE(tokenizer.encode(c.text, false, ids).ok());
    runtime::IncrementalDecoder decoder(tokenizer, true);
    std::vector<std::string> pieces;
    for (const std::int32_t id : ids) pieces.emplace_back(decoder.feed(id));
    pieces.emplace_back(decoder.finish());
    const ChatMessageOut streamed = run(c.make, std::vector<std::string_view>(pieces.begin(), pieces.end()));
    EXPECT_EQ(streamed, parse(c.make, c.text));
    expect_weather_call(streamed);
    EXPECT_FALSE(streamed.reasoning.empty());
  }
}

}  // namespace
}  // namespace capserve::server::chat_output
