#pragma once
// Python's operators on template values: arithmetic, "in", and slicing, raising the TypeError /
// UndefinedError Python and Jinja2 raise for the same operands.
#include <cstddef>
#include <optional>

#include "runtime/chat/jinja_ast.h"

namespace capserve::runtime::jinja {

// `max_size` bounds the size of a string or list the operator builds (LimitError beyond it).
[[nodiscard]] Value binary_op(BinaryOp op, const Value& a, const Value& b, std::size_t max_size);
[[nodiscard]] bool compare(CompareOp op, const Value& a, const Value& b);
// Python `item in container`.
[[nodiscard]] bool contains(const Value& container, const Value& item);
// Python obj[start:stop:step] on a str or list; null bounds are None.
[[nodiscard]] Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step);
// Python "format" % args (printf-style) for the conversions templates use: %s %r %d %i %f %%. The format's
// text and each %s keep their client marks; a %r of client data is the client's.
[[nodiscard]] Str percent_format(const Str& format, const Value& args);

}  // namespace capserve::runtime::jinja
