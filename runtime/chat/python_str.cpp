#include "runtime/chat/python_str.h"

#include <algorithm>

namespace capserve::runtime::chat {
namespace {

// The UTF-8 encodings of every code point for which Python's str.isspace() is true. None of them starts with
// a continuation byte, so in valid UTF-8 a match at either end of a string is always a whole character.
constexpr std::string_view kWhitespace[] = {
    "\t",           "\n",           "\v",           "\f",           "\r",
    "\x1c",         "\x1d",         "\x1e",         "\x1f",         " ",
    "\xc2\x85",     "\xc2\xa0",     "\xe1\x9a\x80", "\xe2\x80\x80", "\xe2\x80\x81",
    "\xe2\x80\x82", "\xe2\x80\x83", "\xe2\x80\x84", "\xe2\x80\x85", "\xe2\x80\x86",
    "\xe2\x80\x87", "\xe2\x80\x88", "\xe2\x80\x89", "\xe2\x80\x8a", "\xe2\x80\xa8",
    "\xe2\x80\xa9", "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe3\x80\x80",
};

std::size_t trailing_whitespace_size(std::string_view s) {
  const auto* it = std::find_if(std::begin(kWhitespace), std::end(kWhitespace),
                                [s](std::string_view w) { return s.ends_with(w); });
  return it == std::end(kWhitespace) ? 0 : it->size();
}

}  // namespace

std::size_t leading_whitespace_size(std::string_view s) {
  const auto* it = std::find_if(std::begin(kWhitespace), std::end(kWhitespace),
                                [s](std::string_view w) { return s.starts_with(w); });
  return it == std::end(kWhitespace) ? 0 : it->size();
}

std::string_view py_lstrip(std::string_view s) {
  while (const std::size_t n = leading_whitespace_size(s)) s.remove_prefix(n);
  return s;
}

std::string_view py_rstrip(std::string_view s) {
  while (const std::size_t n = trailing_whitespace_size(s)) s.remove_suffix(n);
  return s;
}

std::string_view py_strip(std::string_view s) {
  return py_rstrip(py_lstrip(s));
}

}  // namespace capserve::runtime::chat
