// libFuzzer target for the Jinja2 chat-template engine and tokenizer_config.json handling.
//
// Build and run (clang; a 30 s smoke run):
//   configure with -DCMAKE_CXX_COMPILER=clang++ -DCAPSERVE_FUZZ=ON, build the fuzz_chat_template target, then
//   build-fuzz/tests/fuzz/fuzz_chat_template -max_total_time=30
//
// Input: byte 0 bit 0 picks the mode. Mode 0 is a template and a conversation: the template source up to the
// first NUL byte, then messages separated by 0xFF, each a role byte (system, user, assistant, tool) and the
// content; the template is parsed, then rendered with and without a generation prompt. Mode 1 reads the rest
// as a tokenizer_config.json and renders a fixed conversation with its chat_template. Any bytes must give a
// rendering or a jinja::Error / LoadError, never a crash or any other exception; a rendering must be
// deterministic and within the output bound, and a failed one must leave no output.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/chat/jinja_template.h"
#include "runtime/load_error.h"

namespace {

using capserve::runtime::ChatTemplate;
namespace jinja = capserve::runtime::jinja;

constexpr const char* kRoles[] = {"system", "user", "assistant", "tool"};

void check(bool condition) {
  if (!condition) std::abort();
}

// Tight bounds, so that a runaway template fails fast instead of slowing the fuzzer down.
jinja::RenderOptions options() {
  jinja::RenderOptions o;
  o.max_output_bytes = 1 << 20;
  o.max_call_depth = 32;
  o.max_loop_iterations = 100'000;
  o.now = [] { return std::tm{}; };
  return o;
}

jinja::List parse_messages(std::string_view data) {
  jinja::List messages;
  while (!data.empty()) {
    const std::size_t end = std::min(data.find('\xff'), data.size());
    const std::string_view message = data.substr(0, end);
    if (!message.empty()) {
      jinja::Dict m;
      m.set("role", kRoles[static_cast<unsigned char>(message[0]) % std::size(kRoles)]);
      m.set("content", message.substr(1));
      messages.emplace_back(std::move(m));
    }
    data.remove_prefix(std::min(end + 1, data.size()));
  }
  return messages;
}

void render_template(std::string_view data) {
  const std::size_t nul = std::min(data.find('\0'), data.size());
  const std::string_view source = data.substr(0, nul);
  data.remove_prefix(std::min(nul + 1, data.size()));

  std::optional<jinja::Template> compiled;
  try {
    compiled.emplace(source);
  } catch (const jinja::Error&) {
    return;
  }
  jinja::Dict context;
  context.set("messages", parse_messages(data));
  context.set("bos_token", "<s>");
  context.set("eos_token", "</s>");
  context.set("tools", jinja::None{});
  const jinja::RenderOptions o = options();
  for (const bool generation : {false, true}) {
    context.set("add_generation_prompt", generation);
    std::string first;
    std::string second;
    bool first_ok = true;
    bool second_ok = true;
    try {
      first = compiled->render(context, o).text;
    } catch (const jinja::Error&) {
      first_ok = false;
    }
    try {
      second = compiled->render(context, o).text;
    } catch (const jinja::Error&) {
      second_ok = false;
    }
    check(first_ok == second_ok);
    check(first == second);
    check(first.size() <= o.max_output_bytes);
  }
}

void load_tokenizer_config(std::string_view data) {
  const nlohmann::json config = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return;
  try {
    const ChatTemplate chat_template = ChatTemplate::from_tokenizer_config(config);
    std::string out;
    const bool ok =
        chat_template.render({{{"system", "s"}, {"user", "u"}, {"assistant", "a"}}}, {}, out).ok();
    check(ok || out.empty());
  } catch (const capserve::runtime::LoadError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view data(reinterpret_cast<const char*>(bytes), size);
  if ((bytes[0] & 1U) == 0) {
    render_template(data.substr(1));
  } else {
    load_tokenizer_config(data.substr(1));
  }
  return 0;
}
