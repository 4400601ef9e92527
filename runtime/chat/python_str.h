#pragma once
// Python's idea of whitespace (str.isspace()) over UTF-8 text, for the str methods and filters the Jinja
// engine runs (jinja_strings.h) and for locating stripped message content in a rendered prompt.
#include <cstddef>
#include <string_view>

namespace capserve::runtime::chat {

// str.strip() with no argument: removes the characters for which str.isspace() is true, Unicode ones
// included (U+00A0, U+2028, U+3000, ...). Bytes that are not valid UTF-8 are never whitespace.
[[nodiscard]] std::string_view py_strip(std::string_view s);
[[nodiscard]] std::string_view py_lstrip(std::string_view s);
[[nodiscard]] std::string_view py_rstrip(std::string_view s);
// The byte size of the whitespace character `s` starts with (str.isspace()), 0 when it starts with none.
[[nodiscard]] std::size_t leading_whitespace_size(std::string_view s);

}  // namespace capserve::runtime::chat
