#pragma once
// The Python str methods the reference templates call on message contents, over UTF-8 text, so the renderers
// reproduce them exactly (Jinja runs them as Python).
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

// str.strip('\n'), str.lstrip('\n'), str.rstrip('\n').
[[nodiscard]] std::string_view strip_newlines(std::string_view s);
[[nodiscard]] std::string_view lstrip_newlines(std::string_view s);
[[nodiscard]] std::string_view rstrip_newlines(std::string_view s);

// s.split(sep)[0] and s.split(sep)[-1]: the text before the first and after the last `sep`, or all of `s`
// when it has none.
[[nodiscard]] std::string_view before_first(std::string_view s, std::string_view sep);
[[nodiscard]] std::string_view after_last(std::string_view s, std::string_view sep);

}  // namespace capserve::runtime::chat
