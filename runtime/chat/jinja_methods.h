#pragma once
// The Python methods of str, list and dict that the sandbox lets a template call ("text".strip(),
// message.get("content"), tools.items(), ...). Methods that would modify a list or dict are refused with
// SecurityError, as the immutable sandbox does.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

// Calls self.name(args); nullopt when `self` has no such attribute at all. What the method builds is checked
// against `r`'s bounds first.
[[nodiscard]] std::optional<Value> call_method(Renderer& r, const Value& self, std::string_view name,
                                               const Args& args);

// py_replace within `r`'s bounds: the result's size, its client ranges included, is checked before it is
// built (str.replace and the replace filter).
[[nodiscard]] Str replace(Renderer& r, const Str& s, std::string_view old, const Str& replacement,
                          std::int64_t count);

// self.name as a value (a bound method), or nullopt when `self` has no such method.
[[nodiscard]] std::optional<Value> bound_method(const Value& self, std::string_view name);

// The (key, value) tuple of a dict's items().
[[nodiscard]] Value pair(const Value& key, const Value& value);

}  // namespace capserve::runtime::jinja
