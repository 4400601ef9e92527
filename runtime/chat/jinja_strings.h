#pragma once
// Python str methods over UTF-8 text, shared by the str methods a template calls and Jinja's string filters.
// Case mapping is ASCII-only: chat templates apply it to role names and keywords, not to message text.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

[[nodiscard]] std::string py_upper(std::string_view s);
[[nodiscard]] std::string py_lower(std::string_view s);
[[nodiscard]] std::string py_capitalize(std::string_view s);
// str.title(): a letter after a non-letter is upper-cased, every other letter lower-cased.
[[nodiscard]] std::string py_title(std::string_view s);
// str.strip / lstrip / rstrip with `chars` (a set of characters) or, when nullopt, Unicode whitespace.
[[nodiscard]] std::string_view py_strip_chars(std::string_view s, const std::optional<std::string>& chars,
                                              bool left, bool right);
// str.split / str.rsplit: sep nullopt splits on runs of whitespace; maxsplit < 0 is unlimited. The parts
// are views into `s`.
[[nodiscard]] std::vector<std::string_view> py_split(std::string_view s,
                                                     const std::optional<std::string>& sep,
                                                     std::int64_t maxsplit, bool from_right);
// str.splitlines() without keepends.
[[nodiscard]] std::vector<std::string_view> py_splitlines(std::string_view s);
// str.replace(old, new, count) with count < 0 meaning all; the kept bytes of `s` and each copy of
// `replacement` keep their client marks.
[[nodiscard]] Str py_replace(const Str& s, std::string_view old, const Str& replacement, std::int64_t count);
// The size py_replace's result will have, found without building it: its bytes (SIZE_MAX when that
// overflows) and at most how many client ranges it holds (each match may split one of `s`'s and adds
// `replacement`'s).
struct ReplaceSize {
  std::size_t bytes = 0;
  std::size_t client_ranges = 0;
};
[[nodiscard]] ReplaceSize py_replace_size(const Str& s, std::string_view old, const Str& replacement,
                                          std::int64_t count);

}  // namespace capserve::runtime::jinja
