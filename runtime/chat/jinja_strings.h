#pragma once
// Python str methods over UTF-8 text, shared by the str methods a template calls and Jinja's string filters.
// Case mapping is ASCII-only: chat templates apply it to role names and keywords, not to message text.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace capserve::runtime::jinja {

[[nodiscard]] std::string py_upper(std::string_view s);
[[nodiscard]] std::string py_lower(std::string_view s);
[[nodiscard]] std::string py_capitalize(std::string_view s);
// str.title(): a letter after a non-letter is upper-cased, every other letter lower-cased.
[[nodiscard]] std::string py_title(std::string_view s);
// str.strip / lstrip / rstrip with `chars` (a set of characters) or, when nullopt, Unicode whitespace.
[[nodiscard]] std::string_view py_strip_chars(std::string_view s, const std::optional<std::string>& chars,
                                              bool left, bool right);
// str.split / str.rsplit: sep nullopt splits on runs of whitespace; maxsplit < 0 is unlimited.
[[nodiscard]] std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep,
                                                std::int64_t maxsplit, bool from_right);
// str.splitlines() without keepends.
[[nodiscard]] std::vector<std::string_view> py_splitlines(std::string_view s);
// str.replace(old, new, count) with count < 0 meaning all.
[[nodiscard]] std::string py_replace(std::string_view s, std::string_view old, std::string_view replacement,
                                     std::int64_t count);
// The size py_replace's result will have, found without building it; SIZE_MAX when that overflows.
[[nodiscard]] std::size_t py_replace_size(std::string_view s, std::string_view old,
                                          std::string_view replacement, std::int64_t count);

}  // namespace capserve::runtime::jinja
