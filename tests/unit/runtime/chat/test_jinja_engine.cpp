// The Jinja2 engine feature by feature (whitespace control, operators, statements, filters, tests, methods,
// globals, errors) against Python Jinja2's output for the same template and variables, as
// tools/gen_jinja_cases.py recorded it in tests/fixtures/chat/jinja_cases.json.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

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
      output =
          Template(c.at("template").get<std::string>()).render(from_json(c.at("variables")).dict(), options);
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
                .render(variables),
            "1|True|False|True");
}

}  // namespace
}  // namespace capserve::runtime::jinja
