// Conversations a renderer refuses: nothing to render, unknown roles, and what the templates themselves
// reject (Llama-2 and Mistral role alternation), each naming the offending message.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/chat/chat_template.h"

namespace capserve::runtime {
namespace {

// The error message of rendering `messages`, or "" when it renders.
std::string render_error(ChatFamily family, const std::vector<ChatMessage>& messages) {
  const ChatTemplate chat_template(family, "<s>", "</s>");
  std::string out = "stale";
  const Status status = chat_template.render(messages, true, out);
  if (status.ok()) return "";
  EXPECT_EQ(status.code(), StatusCode::invalid_argument);
  EXPECT_EQ(out, "") << "a failed render leaves no partial prompt";
  return status.message();
}

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST(ChatValidation, EmptyConversationIsRefusedByEveryFamily) {
  for (ChatFamily family : {ChatFamily::chatml, ChatFamily::deepseek, ChatFamily::llama2, ChatFamily::mistral,
                            ChatFamily::tulu}) {
    EXPECT_MENTIONS(render_error(family, {}), "no messages to render");
  }
}

TEST(ChatValidation, UnknownRoleNamesTheMessage) {
  const std::string error =
      render_error(ChatFamily::chatml, {{"user", "weather?"}, {"assistant", "calling"}, {"tool", "21C"}});
  EXPECT_MENTIONS(error, "chatml chat template: message 2: unknown role 'tool'");
  EXPECT_MENTIONS(error, "system, user, assistant");
}

TEST(ChatValidation, Llama2AlternationNamesTheMessage) {
  EXPECT_MENTIONS(render_error(ChatFamily::llama2, {{"user", "a"}, {"user", "b"}}),
                  "llama2 chat template: message 1: Conversation roles must alternate user/assistant/user/"
                  "assistant/...");
  // The leading system message is outside the alternation but counts in the index.
  EXPECT_MENTIONS(render_error(ChatFamily::llama2, {{"system", "s"}, {"assistant", "a"}}), "message 1: ");
  EXPECT_MENTIONS(
      render_error(ChatFamily::llama2, {{"system", "s"}, {"user", "a"}, {"assistant", "b"}, {"system", "c"}}),
      "message 3: ");
}

TEST(ChatValidation, Llama2DropsASystemMessageInAnAssistantSlotAsItsTemplateDoes) {
  EXPECT_EQ(render_error(ChatFamily::llama2, {{"user", "a"}, {"system", "dropped"}, {"user", "b"}}), "");
}

TEST(ChatValidation, MistralRejectsALaterSystemMessage) {
  EXPECT_MENTIONS(
      render_error(ChatFamily::mistral, {{"user", "a"}, {"system", "late"}}),
      "mistral chat template: message 1: Only user and assistant roles are supported, with the exception "
      "of an initial optional system message!");
  EXPECT_MENTIONS(render_error(ChatFamily::mistral, {{"system", "s"}, {"assistant", "a"}}),
                  "message 1: After the optional system message, conversation roles must alternate");
}

TEST(ChatValidation, FamiliesWithoutRulesRenderAnyRoleOrder) {
  const std::vector<ChatMessage> odd = {
      {"assistant", "a"}, {"assistant", "b"}, {"system", "c"}, {"user", "d"}};
  for (ChatFamily family : {ChatFamily::chatml, ChatFamily::deepseek, ChatFamily::tulu}) {
    EXPECT_EQ(render_error(family, odd), "") << family_name(family);
  }
}

}  // namespace
}  // namespace capserve::runtime
