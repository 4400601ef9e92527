// Where a ChatTemplate comes from (tokenizer_config.json's chat_template, a named list, chat_template.jinja
// beside it, --chat-template FILE.jinja) and how a conversation the template rejects is reported.
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/load_error.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime {
namespace {

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// Qwen1.5-MoE-A2.7B-Chat's tokenizer_config.json chat_template: ChatML that injects a default system prompt.
constexpr const char* kQwen15Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// A scratch checkpoint directory, removed afterwards.
class ScratchDir {
 public:
  ScratchDir()
      : path_(std::filesystem::temp_directory_path() / ("capserve_chat_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::filesystem::path write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
    return path_ / name;
  }

 private:
  std::filesystem::path path_;
};

std::string render(const ChatTemplate& t, const std::vector<ChatMessage>& messages, bool generation = true) {
  std::string out;
  const Status s = t.render(messages, {.add_generation_prompt = generation}, out);
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

std::string render_error(const ChatTemplate& t, const std::vector<ChatMessage>& messages) {
  std::string out = "untouched";
  const Status s = t.render(messages, {}, out);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(out, "") << "a failed render leaves no partial prompt";
  return s.message();
}

TEST(ChatLoading, Qwen15MoeTemplateInjectsItsDefaultSystemPrompt) {
  const ScratchDir dir;
  const auto config = dir.write("tokenizer_config.json", nlohmann::json{{"chat_template", kQwen15Template},
                                                                        {"eos_token", "<|im_end|>"},
                                                                        {"pad_token", "<|endoftext|>"},
                                                                        {"bos_token", nullptr}}
                                                             .dump());
  const ChatTemplate t = ChatTemplate::load(config);
  EXPECT_EQ(render(t, {{"user", "Hi"}}),
            "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render(t, {{"system", "Be brief."}, {"user", "Hi"}}, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatLoading, RealQwen3TokenizerConfigRendersChatml) {
  const std::filesystem::path path = testing::shared_tokenizer_config("qwen3");
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: set CAPSERVE_SHARED_DATA_DIR";
  const ChatTemplate t = ChatTemplate::load(path);
  EXPECT_EQ(render(t, {{"user", "Hello"}}), "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatLoading, RealDeepseekV3TokenizerConfigUsesItsAddedTokenBos) {
  const std::filesystem::path path = testing::shared_tokenizer_config("deepseek_v3");
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: set CAPSERVE_SHARED_DATA_DIR";
  const ChatTemplate t = ChatTemplate::load(path);
  EXPECT_EQ(render(t, {{"user", "Hello"}}).rfind("<｜begin▁of▁sentence｜>", 0), 0U);
}

TEST(ChatLoading, NamedTemplateListUsesTheDefaultOne) {
  const nlohmann::json config = {{"chat_template",
                                  {{{"name", "tool_use"}, {"template", "tools"}},
                                   {{"name", "default"}, {"template", "{{ messages[0].content }}!"}}}}};
  EXPECT_EQ(render(ChatTemplate::from_tokenizer_config(config), {{"user", "hey"}}), "hey!");
  const nlohmann::json without_default = {{"chat_template", {{{"name", "tool_use"}, {"template", "x"}}}}};
  EXPECT_THROW((void)ChatTemplate::from_tokenizer_config(without_default), LoadError);
}

TEST(ChatLoading, ChatTemplateJinjaBesideTheConfigAndTheOverrideFileWin) {
  const ScratchDir dir;
  const auto config = dir.write("tokenizer_config.json",
                                nlohmann::json{{"chat_template", "config"}, {"bos_token", "<s>"}}.dump());
  EXPECT_EQ(render(ChatTemplate::load(config), {{"user", "u"}}), "config");
  dir.write("chat_template.jinja", "{{ bos_token }}beside\n");
  EXPECT_EQ(render(ChatTemplate::load(config), {{"user", "u"}}), "<s>beside");
  const auto override_file = dir.write("override.jinja", "{{ bos_token }}override {{ messages | length }}");
  EXPECT_EQ(render(ChatTemplate::load(config, override_file), {{"user", "u"}}), "<s>override 1");
}

TEST(ChatLoading, MissingOrBrokenTemplatesAreLoadErrors) {
  try {
    (void)ChatTemplate::from_tokenizer_config(nlohmann::json{{"eos_token", "</s>"}});
    ADD_FAILURE() << "a config without chat_template loaded";
  } catch (const LoadError& e) {
    EXPECT_MENTIONS(std::string(e.what()), "--chat-template");
  }
  try {
    (void)ChatTemplate::from_tokenizer_config(
        nlohmann::json{{"chat_template", "line one\n{% if x %}\n{{ y"}});
    ADD_FAILURE() << "an unterminated template loaded";
  } catch (const LoadError& e) {
    EXPECT_MENTIONS(std::string(e.what()), "TemplateSyntaxError at template line 3");
  }
  EXPECT_THROW(
      (void)ChatTemplate::from_tokenizer_config(nlohmann::json{{"chat_template", "{% frobnicate %}"}}),
      LoadError);
  EXPECT_THROW(
      (void)ChatTemplate::from_tokenizer_config(nlohmann::json{{"chat_template", "x"}, {"bos_token", 5}}),
      LoadError);
  EXPECT_THROW((void)ChatTemplate::load("/nonexistent/tokenizer_config.json"), LoadError);
}

TEST(ChatValidation, RejectionsNameTheTemplatesMessageAndLine) {
  const ChatTemplate t = ChatTemplate::from_tokenizer_config(
      nlohmann::json{{"chat_template",
                      "{% for m in messages %}\n{% if m.role == 'system' %}\n{{ raise_exception('System role "
                      "not supported') }}\n"
                      "{% endif %}{{ m.content }}{% endfor %}"}});
  const std::string error = render_error(t, {{"user", "a"}, {"system", "s"}});
  EXPECT_MENTIONS(error,
                  "TemplateError at template line 3 in call of 'raise_exception': System role not supported");
  EXPECT_MENTIONS(render_error(t, {}), "no messages to render");
}

TEST(ChatValidation, TemplateBugsAreReportedNotCrashes) {
  const ChatTemplate none_plus_text =
      ChatTemplate::from_tokenizer_config(nlohmann::json{{"chat_template", "{{ none + 'x' }}"}});
  EXPECT_MENTIONS(render_error(none_plus_text, {{"user", "u"}}),
                  "TypeError at template line 1 in operator '+'");
  const ChatTemplate missing = ChatTemplate::from_tokenizer_config(
      nlohmann::json{{"chat_template", "{{ messages[0].tool_calls.name }}"}});
  EXPECT_MENTIONS(render_error(missing, {{"user", "u"}}), "UndefinedError");
  const ChatTemplate runaway = ChatTemplate::from_tokenizer_config(
      nlohmann::json{{"chat_template", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"}});
  EXPECT_MENTIONS(render_error(runaway, {{"user", "u"}}), "nested deeper");
}

TEST(ChatValidation, ContentRangesCoverEachMessageInOrder) {
  const ChatTemplate t = ChatTemplate::from_tokenizer_config(nlohmann::json{
      {"chat_template", "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"}});
  RenderedPrompt prompt;
  ASSERT_TRUE(t.render({{{"user", " hello "}, {"assistant", "hello"}}}, {}, prompt).ok());
  EXPECT_EQ(prompt.text, "<user>hello</s><assistant>hello</s>");
  ASSERT_EQ(prompt.content.size(), 2U);
  EXPECT_EQ(prompt.content[0].begin, 6U);  // the stripped text of " hello "
  EXPECT_EQ(prompt.content[0].end, 11U);
  EXPECT_EQ(prompt.content[1].begin, 26U);
}

}  // namespace
}  // namespace capserve::runtime
