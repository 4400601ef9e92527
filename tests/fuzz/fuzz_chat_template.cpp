// libFuzzer target for the chat-template renderers and tokenizer_config.json handling.
//
// Build and run (clang; a 30 s smoke run):
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_chat_template.cpp \
//       runtime/chat/*.cpp -o /tmp/fuzz_chat_template && /tmp/fuzz_chat_template -max_total_time=30
// or configure with -DCMAKE_CXX_COMPILER=clang++ -DCAPSERVE_FUZZ=ON and build the fuzz_chat_template target.
//
// Input: byte 0 picks the mode. Mode 0 renders a conversation: byte 1 is the family, byte 2 bit 0 is
// add_generation_prompt, then messages separated by 0xFF, each a role byte (system, user, assistant or an
// unknown role) followed by the content. Mode 1 reads the rest as a tokenizer_config.json, detecting the
// family from its chat_template. Any bytes must give a rendering or an error, never a crash or an exception
// other than LoadError; a rendering must be deterministic and a failed one must leave no output.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/load_error.h"

namespace {

using capserve::runtime::ChatFamily;
using capserve::runtime::ChatMessage;
using capserve::runtime::ChatTemplate;

constexpr ChatFamily kFamilies[] = {ChatFamily::chatml, ChatFamily::deepseek, ChatFamily::llama2,
                                    ChatFamily::mistral, ChatFamily::tulu};
constexpr const char* kRoles[] = {"system", "user", "assistant", "tool"};

void check(bool condition) {
  if (!condition) std::abort();
}

void render_conversation(std::string_view data) {
  if (data.size() < 2) return;
  const ChatFamily family = kFamilies[static_cast<unsigned char>(data[0]) % std::size(kFamilies)];
  const bool add_generation_prompt = (static_cast<unsigned char>(data[1]) & 1U) != 0;
  data.remove_prefix(2);

  std::vector<ChatMessage> messages;
  while (!data.empty()) {
    const std::size_t end = std::min(data.find('\xff'), data.size());
    const std::string_view message = data.substr(0, end);
    if (!message.empty()) {
      messages.push_back({kRoles[static_cast<unsigned char>(message[0]) % std::size(kRoles)],
                          std::string(message.substr(1))});
    }
    data.remove_prefix(std::min(end + 1, data.size()));
  }

  const ChatTemplate chat_template(family, "<s>", "</s>");
  std::string first;
  std::string second;
  const bool ok = chat_template.render(messages, add_generation_prompt, first).ok();
  check(chat_template.render(messages, add_generation_prompt, second).ok() == ok);
  check(first == second);
  check(ok || first.empty());
}

void load_tokenizer_config(std::string_view data) {
  const nlohmann::json config = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return;
  try {
    const ChatTemplate chat_template = ChatTemplate::from_tokenizer_config(config);
    std::string out;
    (void)chat_template.render({{{"system", "s"}, {"user", "u"}, {"assistant", "a"}}}, true, out);
  } catch (const capserve::runtime::LoadError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view data(reinterpret_cast<const char*>(bytes), size);
  if ((bytes[0] & 1U) == 0) {
    render_conversation(data.substr(1));
  } else {
    load_tokenizer_config(data.substr(1));
  }
  return 0;
}
