#pragma once
// Jinja2's built-in filters and tests that chat templates use, with Jinja2 3.1's behaviour (tojson is
// transformers' json.dumps version). Looked up once, when the template is parsed.
#include <string_view>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

// nullptr when there is no such filter / test.
[[nodiscard]] FilterFn find_filter(std::string_view name);
[[nodiscard]] TestFn find_test(std::string_view name);

}  // namespace capserve::runtime::jinja
