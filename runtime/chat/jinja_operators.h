#pragma once
// Python's operators on template values: arithmetic, "in", and slicing, raising the TypeError /
// UndefinedError Python and Jinja2 raise for the same operands.
#include <cstddef>
#include <optional>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

// A string or list the operator builds is first checked against the render's bounds (Renderer::produce).
[[nodiscard]] Value binary_op(Renderer& r, BinaryOp op, const Value& a, const Value& b);
[[nodiscard]] bool compare(CompareOp op, const Value& a, const Value& b);
// Python `item in container`.
[[nodiscard]] bool contains(const Value& container, const Value& item);
// Python obj[start:stop:step] on a str or list; a None bound is absent.
[[nodiscard]] Value slice(Renderer& r, const Value& obj, const Value& start, const Value& stop,
                          const Value& step);
// Python "format" % args (printf-style) for the conversions templates use: %s %r %d %i %f %%. The format's
// text and each %s keep their client marks; a %r of client data is the client's.
[[nodiscard]] Str percent_format(const Str& format, const Value& args);

}  // namespace capserve::runtime::jinja
