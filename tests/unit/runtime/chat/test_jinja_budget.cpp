// The hostile-template suite: a chat template (from --chat-template or a checkpoint) and the messages and
// tools it renders are untrusted, so each case below must be refused with LimitError, or finish, within a
// bound of work and memory (RenderOptions' defaults). Memory is the peak growth of live heap bytes during the
// render, counted by this binary's operator new; time has loose bounds (the suite must pass on a loaded
// machine), and each case prints its real figures.
#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/chat/jinja_template.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace {

std::atomic<std::size_t> g_live{0};
std::atomic<std::size_t> g_peak{0};

void* counted_alloc(std::size_t size) {
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) throw std::bad_alloc();
  const std::size_t live = g_live.fetch_add(malloc_usable_size(p)) + malloc_usable_size(p);
  for (std::size_t peak = g_peak.load(); live > peak && !g_peak.compare_exchange_weak(peak, live);) {
  }
  return p;
}

void counted_free(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(malloc_usable_size(p));
  std::free(p);
}

}  // namespace

void* operator new(std::size_t size) {
  return counted_alloc(size);
}
void* operator new[](std::size_t size) {
  return counted_alloc(size);
}
void operator delete(void* p) noexcept {
  counted_free(p);
}
void operator delete[](void* p) noexcept {
  counted_free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  counted_free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  counted_free(p);
}

namespace capserve::runtime::jinja {
namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// Loose bounds: a hostile render is refused within about a second and 64 MiB on a quiet machine.
constexpr double kMaxSeconds = 15.0;
constexpr std::size_t kMaxPeakBytes = std::size_t{96} << 20;

struct Figures {
  double seconds = 0;
  std::size_t peak_bytes = 0;
};

template <typename F>
Figures measure(const char* name, F&& run) {
  const std::size_t base = g_live.load();
  g_peak.store(base);
  const auto start = Clock::now();
  run();
  Figures f{std::chrono::duration<double>(Clock::now() - start).count(), g_peak.load() - base};
  std::printf("[budget] %-36s %8.3f s  peak +%7.1f MiB\n", name, f.seconds,
              static_cast<double>(f.peak_bytes) / (1 << 20));
  return f;
}

struct HostileCase {
  const char* name;
  const char* source;
};

// Each is refused: before allocating (sizes checked with overflow-checked arithmetic) or by the work budget.
constexpr HostileCase kHostile[] = {
    {"repeat_overflowing_count", "{{ '0123456789abcdef' * 1152921504606846976 }}"},
    {"list_repeat_overflow", "{{ ([0, 1] * 4611686018427387904) | length }}"},
    {"repeat_50mb_300_times", "{% for i in range(300) %}{% set s = 'a' * 50000000 %}{% endfor %}"},
    {"replace_method_bomb", "{% set s = 'a' * 4096 %}{{ s.replace('a', s).replace('a', s) | length }}"},
    {"replace_filter_doubling",
     "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s | replace('a', 'aa') %}"
     "{% endfor %}{{ ns.s | length }}"},
    {"huge_list_repeat", "{{ ([0] * 30000000) | length }}"},
    {"huge_range", "{{ range(10**9) | length }}"},
    {"huge_range_loop", "{% for i in range(10**9) %}{% endfor %}"},
    {"tojson_wide_indent",
     "{% set d = {'a': [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]} %}{{ ([d] * 40) | tojson(indent=500000) }}"},
    {"tojson_shared_nesting",
     "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l | tojson }}"},
    {"print_shared_nesting",
     "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l }}"},
    {"print_deep_nesting",
     "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l "
     "}}"},
    {"print_namespace_holding_itself", "{% set ns = namespace() %}{% set ns.x = [ns] %}{{ ns }}"},
    {"string_of_namespace_holding_itself", "{% set ns = namespace() %}{% set ns.x = ns %}{{ ns | string }}"},
    {"format_namespace_holding_itself", "{% set ns = namespace() %}{% set ns.x = ns %}{{ '%s' % ns }}"},
    {"join_wide_separator", "{{ (['a' * 1000] * 10000) | join('x' * 1000000) }}"},
    {"string_to_list", "{% set s = 'a' * 10000000 %}{{ s | list | length }}"},
    {"split_bomb", "{{ ('a' * 10000000).split('a') | length }}"},
    {"loop_of_large_values", "{% for i in range(100000) %}{% set s = 'a' * 10000000 %}{% endfor %}"},
    {"nested_loops",
     "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{{ k }}"
     "{% endfor %}{% endfor %}{% endfor %}"},
    {"loop_sorting_big_list",
     "{% set l = range(300000) | list %}{% for i in range(1000) %}{{ l | sort | length }}{% endfor %}"},
    {"loop_membership_scan",
     "{% set l = range(300000) | list %}{% for i in range(300000) %}{% if -1 in l %}{% endif %}{% endfor %}"},
    {"macro_fan_out_recursion",
     "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}"},
    {"macro_string_doubling",
     "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('0123456789abcdef0123456789abcdef') }}"},
    // `c` is one byte of the client's: each copy below is a client range of its own (16 bytes), which counts
    // in the value bound as its text does.
    {"client_ranges_by_repetition", "{{ ((c ~ '.') * 4000000) | length }}"},
    {"client_ranges_by_replace", "{% set s = '.' * 4000000 %}{{ s.replace('.', c ~ '.') | length }}"},
    {"client_ranges_by_join",
     "{% set u = (c ~ '.') * 100000 %}{{ [u, u, u, u, u, u, u, u, u, u, u, u] | join | length }}"},
    {"client_ranges_in_output", "{% set u = (c ~ '.') * 500000 %}{% for i in range(4) %}{{ u }}{% endfor %}"},
};

// What the hostile cases render with: `c`, a str of the client's.
Dict hostile_context() {
  Dict context;
  context.set("c", client_str("a"));
  return context;
}

TEST(JinjaBudget, HostileTemplatesAreRefusedWithinBounds) {
  const Dict context = hostile_context();
  for (const HostileCase& c : kHostile) {
    const Template t(c.source);
    std::string error;
    ErrorKind kind = ErrorKind::syntax_error;  // rendered: no case expects that
    const Figures f = measure(c.name, [&] {
      try {
        (void)t.render(context);
      } catch (const Error& e) {
        kind = e.kind();
        error = e.what();
      }
    });
    EXPECT_EQ(kind, ErrorKind::limit_error) << c.name << ": " << error;
    EXPECT_LT(f.seconds, kMaxSeconds) << c.name;
    EXPECT_LT(f.peak_bytes, kMaxPeakBytes) << c.name;
  }
}

TEST(JinjaBudget, ErrorsSayWhichBound) {
  auto message = [](const char* source) {
    try {
      (void)Template(source).render({});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("rendered");
  };
  const std::string budget = message(
      "{% for i in range(30) %}{% for j in range(30) %}{% for k in range(30) %}"
      "{{ (range(30000) | list | sort)[0] }}{% endfor %}{% endfor %}{% endfor %}");
  EXPECT_NE(budget.find("LimitError at template line 1 in "), std::string::npos) << budget;
  EXPECT_NE(budget.find("the chat template exceeded its work budget (40000000 steps)"), std::string::npos)
      << budget;
  EXPECT_NE(message("{{ 'ab' * 1152921504606846976 }}").find("a value would exceed 16777216 bytes"),
            std::string::npos);
}

// A smaller budget stops sooner: the bounds are the options', not constants.
TEST(JinjaBudget, BoundsComeFromTheOptions) {
  RenderOptions tight;
  tight.max_steps = 1000;
  tight.max_value_bytes = 10'000;
  EXPECT_THROW(
      (void)Template("{% for i in range(30) %}{% for j in range(30) %}{{ j }}{% endfor %}{% endfor %}")
          .render({}, tight),
      Error);
  EXPECT_THROW((void)Template("{{ 'x' * 10001 }}").render({}, tight), Error);
  EXPECT_EQ(Template("{{ ('x' * 1000) | length }}").render({}, tight).text, "1000");
  EXPECT_EQ(Template("{% for i in range(100) %}{% endfor %}ok").render({}, tight).text, "ok");
}

std::vector<ChatMessage> conversation(std::size_t n) {
  std::vector<ChatMessage> messages;
  messages.reserve(n);
  messages.push_back({"system", "You are a helpful assistant."});
  for (std::size_t i = 1; i < n; ++i) {
    messages.push_back({i % 2 == 1 ? "user" : "assistant", "message " + std::to_string(i)});
  }
  return messages;
}

ChatTemplate default_model_template() {
  return ChatTemplate::load(std::filesystem::path(CAPSERVE_SOURCE_DIR) / "deploy/models/capserve-moe-tiny" /
                            "tokenizer_config.json");
}

ChatTemplate qwen3_template() {
  return ChatTemplate::load(testing::shared_tokenizer_config("qwen3"));
}

// 200k messages (about a 4 MiB request) render in linear time: 38 s before.
TEST(JinjaBudget, TwoHundredThousandMessagesRenderInLinearTime) {
  const std::vector<ChatMessage> messages = conversation(200'000);
  for (const auto& [name, chat] : {std::pair{"200k_messages_default_model", default_model_template()},
                                   std::pair{"200k_messages_qwen3", qwen3_template()}}) {
    RenderedPrompt prompt;
    Status status;
    const Figures f = measure(name, [&] { status = chat.render(messages, ChatInputs{}, prompt); });
    ASSERT_TRUE(status.ok()) << name << ": " << status.message();
    EXPECT_NE(prompt.text.find("message 199999"), std::string::npos);
    EXPECT_EQ(prompt.content.size(), messages.size()) << name;
    EXPECT_LT(f.seconds, kMaxSeconds) << name;
    // The rendered text and its content ranges are ~8 MB; the message values about as much again.
    EXPECT_LT(f.peak_bytes, std::size_t{160} << 20) << name;
  }
}

// One tool with 60k properties (about a 4 MiB request) through a tool-using template: 13 s before.
TEST(JinjaBudget, SixtyThousandPropertyToolRenders) {
  // Appended to the ordered map's vector: its emplace looks every key up first (quadratic).
  Json properties = Json::object();
  auto& entries =
      static_cast<std::vector<std::pair<const std::string, Json>>&>(properties.get_ref<Json::object_t&>());
  for (int i = 0; i < 60'000; ++i) {
    entries.emplace_back("property_" + std::to_string(i),
                         Json{{"type", "string"}, {"description", "a property"}});
  }
  ChatInputs inputs;
  inputs.tools =
      Json::array({Json{{"type", "function"},
                        {"function",
                         {{"name", "wide"},
                          {"description", "a tool with many properties"},
                          {"parameters", {{"type", "object"}, {"properties", std::move(properties)}}}}}}});
  const std::vector<ChatMessage> messages = conversation(3);
  const ChatTemplate chat = qwen3_template();
  RenderedPrompt prompt;
  Status status;
  const Figures f =
      measure("60k_property_tool_qwen3", [&] { status = chat.render(messages, inputs, prompt); });
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_NE(prompt.text.find("property_59999"), std::string::npos);
  EXPECT_LT(f.seconds, kMaxSeconds);
  EXPECT_LT(f.peak_bytes, kMaxPeakBytes);
}

// The server maps a render's failure to 400 invalid_argument: a bound is a Status, never an exception.
TEST(JinjaBudget, ChatTemplateReturnsInvalidArgumentPastABound) {
  const ChatTemplate chat("{% for m in messages %}{{ m.content * 1152921504606846976 }}{% endfor %}", {},
                          "test");
  std::string out;
  const Status status = chat.render(conversation(2), ChatInputs{}, out);
  EXPECT_EQ(status.code(), StatusCode::invalid_argument);
  EXPECT_NE(status.message().find("LimitError"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace capserve::runtime::jinja
