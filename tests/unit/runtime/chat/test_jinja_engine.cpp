// The Jinja2 engine feature by feature (whitespace control, operators, statements, filters, tests, methods,
// globals, errors) against Python Jinja2's output for the same template and variables, as
// tools/gen_jinja_cases.py recorded it in tests/fixtures/chat/jinja_cases.json.
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/chat/jinja_filters.h"
#include "runtime/chat/jinja_globals.h"
#include "runtime/chat/jinja_json.h"
#include "runtime/chat/jinja_template.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime::jinja {
namespace {

TEST(JinjaEngine, FeatureCasesMatchPythonJinja2) {
  const std::filesystem::path path =
      std::filesystem::path(CAPSERVE_FIXTURES_DIR) / "chat" / "jinja_cases.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot open " << path << " (written by tools/gen_jinja_cases.py)";
  const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(in);
  ASSERT_GE(cases.size(), 60U);
  RenderOptions options;
  options.now = runtime::testing::frozen_now;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.at("name").get<std::string>() + ": " + c.at("template").get<std::string>());
    std::string output;
    std::string error;
    try {
      output = Template(c.at("template").get<std::string>())
                   .render(from_json(c.at("variables")).dict(), options)
                   .text;
    } catch (const Error& e) {
      error = std::string(error_class(e.kind()));
      output = e.what();
    }
    if (c.contains("error")) {
      EXPECT_EQ(error, c.at("error").get<std::string>()) << output;
    } else {
      EXPECT_EQ(error, "") << output;
      EXPECT_EQ(output, c.at("output").get<std::string>());
    }
  }
}

// Every built-in filter, test and default global of Jinja2 (tools/gen_jinja_cases.py lists them from the
// installed Jinja2 in tests/fixtures/chat/jinja_builtins.json) is implemented, and then checked against
// Jinja2 by jinja_cases.json, or refused when the template is compiled, by name: never an unknown-name error,
// never a wrong answer at render time.
TEST(JinjaEngine, EveryJinja2BuiltinIsImplementedOrRefusedByName) {
  const nlohmann::json builtins = runtime::testing::read_test_json(
      std::filesystem::path(CAPSERVE_FIXTURES_DIR) / "chat" / "jinja_builtins.json");
  ASSERT_GE(builtins.value("filters", nlohmann::json::array()).size(), 50U);
  const auto refused_when_compiled = [](const std::string& source, const std::string& message) {
    try {
      (void)Template(source);
      return false;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::syntax_error);
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      return std::string(e.what()).find(message) != std::string::npos;
    }
  };
  int implemented = 0;
  int refused = 0;
  int tests_implemented = 0;
  for (const auto& name : builtins.at("filters")) {
    const std::string n = name.get<std::string>();
    SCOPED_TRACE("filter " + n);
    if (find_filter(n) != nullptr) {
      ++implemented;
    } else {
      EXPECT_TRUE(refused_when_compiled("{{ x | " + n + " }}", "filter '" + n + "' is not supported"));
      ++refused;
    }
  }
  for (const auto& name : builtins.at("tests")) {
    const bool found = find_test(name.get<std::string>()) != nullptr;
    EXPECT_TRUE(found) << "test " << name;
    tests_implemented += found ? 1 : 0;
  }
  for (const auto& name : builtins.at("globals")) {
    const std::string n = name.get<std::string>();
    SCOPED_TRACE("global " + n);
    if (find_global(n).has_value()) {
      ++implemented;
    } else {
      EXPECT_TRUE(refused_when_compiled("{{ " + n + "() }}", "global '" + n + "' is not supported"));
      ++refused;
    }
  }
  std::cout << "Jinja2 " << builtins.at("jinja2").get<std::string>()
            << " built-in filters and globals: " << implemented << " implemented, " << refused
            << " refused; tests: " << tests_implemented << " of " << builtins.at("tests").size()
            << " implemented\n";
}

TEST(JinjaEngine, ErrorsNameTheLine) {
  try {
    (void)Template("a\nb\n{{ 1 +\n}}");
    ADD_FAILURE() << "parsed";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::syntax_error);
    EXPECT_EQ(e.line(), 4);
  }
  try {
    (void)Template("x\n\n{{ missing.attr }}").render({});
    ADD_FAILURE() << "rendered";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::undefined_error);
    EXPECT_EQ(e.line(), 3);
    EXPECT_NE(std::string(e.what()).find("'missing' is undefined"), std::string::npos) << e.what();
  }
}

TEST(JinjaEngine, RunawayTemplatesAreBounded) {
  RenderOptions tight;
  tight.max_output_bytes = 1000;
  tight.max_value_bytes = 100'000;
  tight.max_loop_iterations = 500;
  tight.max_call_depth = 10;
  auto kind_of = [&](const char* source) {
    try {
      (void)Template(source).render({}, tight);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::syntax_error;  // rendered: not what any case expects
  };
  EXPECT_EQ(kind_of("{% for i in range(100) %}{{ 'x' * 100 }}{% endfor %}"), ErrorKind::limit_error);
  EXPECT_EQ(kind_of("{% for i in range(1000) %}{% endfor %}"), ErrorKind::limit_error);
  EXPECT_EQ(kind_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), ErrorKind::limit_error);
  EXPECT_EQ(
      kind_of("{% set s = namespace(v='ab') %}{% for i in range(20) %}{% set s.v = s.v ~ s.v %}{% endfor %}"),
      ErrorKind::limit_error);
  std::string deep(5000, '(');
  EXPECT_THROW((void)Template("{{ " + deep + " }}"), Error);
}

// Message text is not checked for UTF-8 here: a lead byte that promises more bytes than follow counts as one
// character with what follows it, for length and indexing alike (the fuzzer found them disagreeing).
TEST(JinjaEngine, InvalidUtf8IndexesAsItCounts) {
  Dict variables;
  variables.set("s", std::string("\xf0"
                                 "ab"));
  EXPECT_EQ(Template("{{ s | length }}|{{ s[-1] == s }}|{{ s[1] is defined }}|{{ s[::-1] == s }}")
                .render(variables)
                .text,
            "1|True|False|True");
}

// The rendered text with the client's bytes in [brackets].
std::string marked_render(std::string_view source, const Dict& variables) {
  const Str out = Template(source).render(variables);
  std::string shown;
  std::size_t at = 0;
  for (const TextRange& r : out.client) {
    shown.append(out.text, at, r.begin - at)
        .append("[")
        .append(out.text, r.begin, r.end - r.begin)
        .append("]");
    at = r.end;
  }
  return shown.append(out.text, at);
}

// Issue 24: which bytes came from the client is carried through every operation on strs, not searched for
// afterwards; where an operation rewrites the text, its result is the client's as a whole (never markup).
TEST(JinjaEngine, ClientBytesKeepTheirMarkThroughOperations) {
  Dict variables;
  variables.set("c", client_str(" <|u|>a|b\nz "));
  variables.set("d", client_str("xy"));
  variables.set("n", from_json(nlohmann::ordered_json{{"k", "<|v|>"}, {"i", 1}}));
  const std::pair<const char*, const char*> cases[] = {
      {"<|m|>{{ c }}<|m|>", "<|m|>[ <|u|>a|b\nz ]<|m|>"},
      {"{{ '<|m|>' ~ d ~ '<|m|>' }}", "<|m|>[xy]<|m|>"},
      {"{{ '<|m|>' + d + '<|m|>' }}", "<|m|>[xy]<|m|>"},
      {"{{ ('<|m|> ' ~ c) | trim }}", "<|m|> [ <|u|>a|b\nz]"},
      {"{{ c.strip() }}|{{ c.lstrip() }}|{{ c.rstrip(' z\n') }}", "[<|u|>a|b\nz]|[<|u|>a|b\nz ]|[ <|u|>a|b]"},
      {"{{ c.split('|')[2] }}/{{ c.split() | join('+') }}", "[>a]/[<|u|>a|b]+[z]"},
      {"{{ c.rsplit('|', 1)[0] }}", "[ <|u|>a]"},
      {"{{ c.splitlines() | join('<|m|>') }}", "[ <|u|>a|b]<|m|>[z ]"},
      {"{{ c[1:6] }}/{{ c[0] }}/{{ d[::-1] }}/{{ d | reverse }}", "[<|u|>]/[ ]/[yx]/[yx]"},
      {"{{ d | upper }}/{{ d.title() }}/{{ ('<|m|>' ~ d) | capitalize }}", "[XY]/[Xy]/<|m|>[xy]"},
      {"{{ c.replace('a', '<|m|>') }}", "[ <|u|>]<|m|>[|b\nz ]"},
      {"{{ c | replace('|', d) }}", "[ <xyuxy>axyb\nz ]"},
      {"{{ '<|m|>'.join([d, d]) }}/{{ [d, 'e'] | join(d) }}", "[xy]<|m|>[xy]/[xyxy]e"},
      {"{{ '<|m|>%s<|m|>' % d }}{{ d * 2 }}", "<|m|>[xy]<|m|>[xyxy]"},
      {"{% for ch in d %}<{{ ch }}>{% endfor %}{{ d | list | join('.') }}", "<[x]><[y]>[x].[y]"},
      {"{% macro m(x) %}<|m|>{{ x }}{% endmacro %}{{ m(d) }}", "<|m|>[xy]"},
      {"{% set b %}<|m|>{{ d }}{% endset %}{{ b }}/{% filter upper %}{{ d }}<|m|>{% endfilter %}",
       "<|m|>[xy]/[XY]<|M|>"},
      {"{{ ('<|m|>\n' ~ d ~ '\n' ~ d) | indent(2, true) }}", "  <|m|>\n  [xy]\n  [xy]"},
      {"{{ n | tojson }}/{{ n.k }}/{{ n }}",
       "[{\"k\": \"<|v|>\", \"i\": 1}]/[<|v|>]/[{'k': '<|v|>', 'i': 1}]"},
      {"{{ d | escape }}/{{ d | string }}/{{ undefined_name | default(d) }}", "[xy]/[xy]/[xy]"},
      {"{% for k, v in n.items() %}{{ k }}={{ v }};{% endfor %}", "[k]=[<|v|>];[i]=1;"},
      {"{{ '<|m|>' | upper }}{{ 'a' ~ 1 }}", "<|M|>a1"},
      {"{{ d | center(4) }}|{{ [d, 'a'] | max }}|{{ (d ~ ' zz') | truncate(3, true, '', 0) }}|{{ d | "
       "urlencode }}",
       " [xy] |[xy]|[xy] |[xy]"},
      {"{{ '<|m|>%s' | format(d) }}|{{ [d, 'a', 'b'] | batch(2) | first | join }}", "<|m|>[xy]|[xy]a"},
  };
  for (const auto& [source, expected] : cases) {
    SCOPED_TRACE(source);
    EXPECT_EQ(marked_render(source, variables), expected);
  }
}

}  // namespace
}  // namespace capserve::runtime::jinja
