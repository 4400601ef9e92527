#pragma once
// Parses Jinja2 template source into statement trees with Jinja2's grammar and operator precedence. Only what
// a chat template can use in transformers' environment is accepted: no include/extends/import, no raw blocks.
#include <string_view>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

// Throws Error(syntax_error) naming the line: bad syntax, an unknown tag, filter or test, nesting deeper than
// the parser's bound.
[[nodiscard]] Body parse_template(std::string_view source);

}  // namespace capserve::runtime::jinja
