// Which family a tokenizer_config.json gets: detection from the real files and from the reference templates,
// look-alike templates that render differently are refused, forcing by name, and the tokens each family
// needs.
#include <gtest/gtest.h>

#include <string>

#include "runtime/chat/chat_template.h"
#include "runtime/load_error.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime {
namespace {

constexpr const char* kFamilies[] = {"chatml", "deepseek", "deepseek_v2", "llama2", "mistral", "tulu"};

// The LoadError message of `make`, or "" when it does not throw.
template <typename Make>
std::string load_error(Make make) {
  try {
    (void)make();
  } catch (const LoadError& e) {
    return e.what();
  }
  return "";
}

void expect_lists_supported_families(const std::string& message) {
  ASSERT_FALSE(message.empty());
  for (const char* family : kFamilies) EXPECT_NE(message.find(family), std::string::npos) << message;
}

std::string render(const ChatTemplate& chat_template, std::string_view user) {
  std::string out;
  const Status status = chat_template.render({{{"user", std::string(user)}}}, true, out);
  EXPECT_TRUE(status.ok()) << status.message();
  return out;
}

TEST(ChatDetection, RealQwen3TokenizerConfigIsChatml) {
  const auto path = testing::shared_tokenizer_config("qwen3");
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ../shared/data/tokenizers must sit beside "
      << "the checkout";
  const ChatTemplate chat_template = ChatTemplate::load(path);
  EXPECT_EQ(chat_template.family(), ChatFamily::chatml);
  EXPECT_EQ(render(chat_template, "Hi"), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatDetection, RealDeepseekV3TokenizerConfigIsDeepseekWithAddedTokenBos) {
  const auto path = testing::shared_tokenizer_config("deepseek_v3");
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ../shared/data/tokenizers must sit beside "
      << "the checkout";
  const ChatTemplate chat_template = ChatTemplate::load(path);
  EXPECT_EQ(chat_template.family(), ChatFamily::deepseek);
  EXPECT_EQ(render(chat_template, "Hi"), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>");
}

TEST(ChatDetection, TokenizerConfigWithoutChatTemplateNeedsForcing) {
  const auto path = testing::shared_tokenizer_config("llama2");
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ../shared/data/tokenizers must sit beside "
      << "the checkout";
  const std::string error = load_error([&] { return ChatTemplate::load(path); });
  EXPECT_NE(error.find("has no chat_template"), std::string::npos) << error;
  expect_lists_supported_families(error);

  const ChatTemplate forced = ChatTemplate::load(path, ChatFamily::llama2);
  EXPECT_EQ(render(forced, " Hi "), "<s>[INST] Hi [/INST]");
}

TEST(ChatDetection, EveryReferenceTemplateIsDetected) {
  for (const char* family : kFamilies) {
    const nlohmann::json golden = testing::read_test_json(testing::chat_golden_path(family));
    const std::optional<ChatFamily> detected = detect_family(golden.value("chat_template", ""));
    ASSERT_TRUE(detected.has_value()) << family;
    EXPECT_EQ(family_name(*detected), family);
  }
}

TEST(ChatDetection, LookAlikeTemplatesThatRenderDifferentlyAreRefused) {
  const char* const look_alikes[] = {
      // Qwen1.5/Qwen2 ChatML: injects a default system prompt.
      R"({% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})",
      // Mixtral-8x7B-Instruct's first template: no system prompt, no space before [INST].
      R"({{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %})",
      // Zephyr: Tulu's markers, eos_token after every turn.
      R"({% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %})",
      // DeepSeek-V2-Chat's turns without eos after the assistant's, and a generation prompt with a space.
      R"({% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: '  + message['content'] }}{% if not loop.last %}{{ '\n\n' }}{% endif %}{% endif %}{% endfor %}{{ 'Assistant: ' }})",
      "",
  };
  for (const char* source : look_alikes) {
    EXPECT_FALSE(detect_family(source).has_value()) << source;
    const std::string error = load_error([&] {
      return ChatTemplate::from_tokenizer_config({{"chat_template", source}, {"bos_token", "<s>"}});
    });
    EXPECT_NE(error.find("none of the built-in chat templates"), std::string::npos) << error;
    expect_lists_supported_families(error);
  }
}

TEST(ChatDetection, ReasoningVariantsOfDetectedFamiliesAreRefused) {
  const nlohmann::json deepseek = testing::read_test_json(testing::chat_golden_path("deepseek"));
  // DeepSeek-R1 strips "...</think>" from earlier assistant turns.
  EXPECT_FALSE(
      detect_family(deepseek.value("chat_template", "") + "{% if '</think>' in content %}{% endif %}"));
  const nlohmann::json tulu = testing::read_test_json(testing::chat_golden_path("tulu"));
  // open-instruct's tulu_thinker opens <think> in the generation prompt.
  EXPECT_FALSE(detect_family(tulu.value("chat_template", "") + "{{ '<|assistant|>\\n<think>' }}"));
}

TEST(ChatDetection, NamedTemplateListUsesTheDefaultOne) {
  const nlohmann::json qwen = testing::read_test_json(testing::chat_golden_path("chatml"));
  const nlohmann::json config = {{"chat_template",
                                  {{{"name", "tool_use"}, {"template", "{{ tools }}"}},
                                   {{"name", "default"}, {"template", qwen.value("chat_template", "")}}}}};
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config).family(), ChatFamily::chatml);

  const std::string error = load_error([] {
    return ChatTemplate::from_tokenizer_config({{"chat_template", {{{"name", "rag"}, {"template", "x"}}}}});
  });
  EXPECT_NE(error.find("no template named \"default\""), std::string::npos) << error;
}

TEST(ChatFamilyNames, ParseEveryFamilyName) {
  for (const char* family : kFamilies) EXPECT_EQ(family_name(parse_family(family)), family);
}

TEST(ChatFamilyNames, UnknownNameListsSupportedFamilies) {
  const std::string error = load_error([] { return parse_family("olmoe"); });
  EXPECT_NE(error.find("unknown chat template family 'olmoe'"), std::string::npos) << error;
  expect_lists_supported_families(error);
}

TEST(ChatForcing, ForcedFamilyOverridesDetection) {
  const nlohmann::json deepseek = testing::read_test_json(testing::chat_golden_path("deepseek"));
  const ChatTemplate forced = ChatTemplate::from_tokenizer_config(deepseek, ChatFamily::tulu);
  EXPECT_EQ(forced.family(), ChatFamily::tulu);
  EXPECT_EQ(render(forced, "Hi"), "<｜begin▁of▁sentence｜><|user|>\nHi\n<|assistant|>\n");
}

TEST(ChatForcing, FamilyNeedingAMissingTokenIsALoadError) {
  // Qwen3's tokenizer_config.json has bos_token null; the Llama-2 template starts every turn with it.
  const nlohmann::json qwen = testing::read_test_json(testing::chat_golden_path("chatml"));
  const std::string error =
      load_error([&] { return ChatTemplate::from_tokenizer_config(qwen, ChatFamily::llama2); });
  EXPECT_NE(error.find("bos_token is missing, and the llama2 chat template needs it"), std::string::npos)
      << error;
}

TEST(ChatTokens, MalformedTokenIsALoadError) {
  const std::string error = load_error([] {
    return ChatTemplate::from_tokenizer_config({{"bos_token", 5}, {"eos_token", "</s>"}},
                                               ChatFamily::mistral);
  });
  EXPECT_NE(error.find("bos_token must be a string or an object"), std::string::npos) << error;
}

TEST(ChatTokens, UnreadableFileIsALoadError) {
  const std::string error =
      load_error([] { return ChatTemplate::load("/nonexistent/tokenizer_config.json"); });
  EXPECT_NE(error.find("cannot open /nonexistent/tokenizer_config.json"), std::string::npos) << error;
}

}  // namespace
}  // namespace capserve::runtime
