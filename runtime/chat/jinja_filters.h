#pragma once
// Jinja2's built-in filters and tests, with Jinja2 3.1's behaviour (tojson is transformers' json.dumps
// version), but for a few filters refused by name (runtime/README.md). Looked up once, when the template is
// parsed.
#include <string>
#include <string_view>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

// nullptr when there is no such filter / test.
[[nodiscard]] FilterFn find_filter(std::string_view name);
[[nodiscard]] TestFn find_test(std::string_view name);
// Why this engine refuses a Jinja2 built-in filter (runtime/README.md lists them); nullptr for any other
// name.
[[nodiscard]] const char* refused_filter_reason(std::string_view name);
// The error for a filter find_filter() lacks: "filter 'x' is not supported (why)" for a refused built-in,
// Jinja2's "No filter named 'x'." otherwise.
[[nodiscard]] std::string unknown_filter_message(const std::string& name);

}  // namespace capserve::runtime::jinja
