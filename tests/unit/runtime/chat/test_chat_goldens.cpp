// Every conversation Jinja2 rendered with the reference templates of six families (tests/fixtures/chat)
// renders byte for byte the same through ChatTemplate, and every conversation the template rejected is
// rejected with the template's message.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/chat/chat_template.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime {
namespace {

std::vector<ChatMessage> messages_of(const nlohmann::json& golden_case) {
  std::vector<ChatMessage> messages;
  for (const nlohmann::json& m : golden_case.at("messages")) {
    messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  }
  return messages;
}

class ChatGoldens : public ::testing::TestWithParam<const char*> {};

TEST_P(ChatGoldens, MatchJinjaRendering) {
  const nlohmann::json golden = testing::read_test_json(testing::chat_golden_path(GetParam()));
  ASSERT_TRUE(golden.contains("cases"));
  // The golden file reads like a tokenizer_config.json: its chat_template and special tokens.
  const ChatTemplate chat_template = ChatTemplate::from_tokenizer_config(golden);

  const nlohmann::json& cases = golden.at("cases");
  EXPECT_GE(cases.size(), 50U);
  for (const nlohmann::json& c : cases) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    std::string out;
    const Status status = chat_template.render(
        messages_of(c), {.add_generation_prompt = c.at("add_generation_prompt").get<bool>()}, out);
    if (c.contains("error")) {
      ASSERT_FALSE(status.ok()) << "rendered " << out;
      EXPECT_NE(status.message().find(c.at("error").get<std::string>()), std::string::npos)
          << status.message();
    } else {
      ASSERT_TRUE(status.ok()) << status.message();
      EXPECT_EQ(out, c.at("rendered").get<std::string>());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ChatGoldens,
                         ::testing::Values("chatml", "deepseek", "deepseek_v2", "llama2", "mistral", "tulu"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace capserve::runtime
