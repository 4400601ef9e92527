#include "runtime/chat/jinja_strings.h"

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "runtime/chat/jinja_error.h"
#include "runtime/chat/jinja_value.h"
#include "runtime/chat/python_str.h"

namespace capserve::runtime::jinja {
namespace {

bool is_alpha(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) != 0;
}
char upper(char c) {
  return static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
}
char lower(char c) {
  return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
}

// The byte size of the line break `s` starts with, 0 when none (str.splitlines()' boundaries).
std::size_t line_break_size(std::string_view s) {
  if (s.starts_with("\r\n")) return 2;
  if (!s.empty() && std::string_view("\n\r\v\f\x1c\x1d\x1e").find(s[0]) != std::string_view::npos) return 1;
  if (s.starts_with("\xc2\x85")) return 2;
  if (s.starts_with("\xe2\x80\xa8") || s.starts_with("\xe2\x80\xa9")) return 3;
  return 0;
}

}  // namespace

std::string py_upper(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), upper);
  return out;
}

std::string py_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), lower);
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out = py_lower(s);
  if (!out.empty()) out[0] = upper(out[0]);
  return out;
}

std::string py_title(std::string_view s) {
  std::string out(s);
  bool previous_cased = false;
  for (char& c : out) {
    if (is_alpha(c)) {
      c = previous_cased ? lower(c) : upper(c);
      previous_cased = true;
    } else {
      previous_cased = false;
    }
  }
  return out;
}

std::string_view py_strip_chars(std::string_view s, const std::optional<std::string>& chars, bool left,
                                bool right) {
  if (!chars) {
    if (left) s = chat::py_lstrip(s);
    if (right) s = chat::py_rstrip(s);
    return s;
  }
  const std::vector<std::string_view> set = code_points(*chars);
  auto in_set = [&](std::string_view c) { return std::find(set.begin(), set.end(), c) != set.end(); };
  const std::vector<std::string_view> cps = code_points(s);
  std::size_t begin = 0;
  std::size_t end = cps.size();
  while (left && begin < end && in_set(cps[begin])) ++begin;
  while (right && end > begin && in_set(cps[end - 1])) --end;
  if (begin == end) return {};
  const std::size_t from = static_cast<std::size_t>(cps[begin].data() - s.data());
  const std::size_t to = static_cast<std::size_t>(cps[end - 1].data() + cps[end - 1].size() - s.data());
  return s.substr(from, to - from);
}

std::vector<std::string_view> py_split(std::string_view s, const std::optional<std::string>& sep,
                                       std::int64_t maxsplit, bool from_right) {
  std::vector<std::string_view> parts;
  if (sep && sep->empty()) throw Error(ErrorKind::value_error, "empty separator");
  if (sep) {
    if (!from_right) {
      std::size_t start = 0;
      while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
        const std::size_t at = s.find(*sep, start);
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(start, at - start));
        start = at + sep->size();
      }
      parts.emplace_back(s.substr(start));
      return parts;
    }
    std::size_t end = s.size();
    while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
      if (end < sep->size()) break;
      const std::size_t at = s.rfind(*sep, end - sep->size());
      if (at == std::string_view::npos) break;
      parts.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
      end = at;
    }
    parts.emplace_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of whitespace separate; leading and trailing whitespace yields no empty parts.
  std::vector<std::pair<std::size_t, std::size_t>> words;  // [begin, end) byte ranges
  for (std::size_t i = 0; i < s.size();) {
    if (const std::size_t w = chat::leading_whitespace_size(s.substr(i))) {
      i += w;
      continue;
    }
    const std::size_t begin = i;
    while (i < s.size() && chat::leading_whitespace_size(s.substr(i)) == 0) ++i;
    words.emplace_back(begin, i);
  }
  if (words.empty()) return parts;
  const std::size_t limit =
      maxsplit < 0 ? words.size() : std::min(words.size(), static_cast<std::size_t>(maxsplit) + 1);
  if (limit == words.size()) {
    for (const auto& [b, e] : words) parts.emplace_back(s.substr(b, e - b));
    return parts;
  }
  if (!from_right) {
    for (std::size_t i = 0; i + 1 < limit; ++i)
      parts.emplace_back(s.substr(words[i].first, words[i].second - words[i].first));
    parts.emplace_back(chat::py_rstrip(s.substr(words[limit - 1].first)));
    return parts;
  }
  const std::size_t first_whole = words.size() - (limit - 1);
  parts.emplace_back(chat::py_lstrip(s.substr(0, words[first_whole - 1].second)));
  for (std::size_t i = first_whole; i < words.size(); ++i) {
    parts.emplace_back(s.substr(words[i].first, words[i].second - words[i].first));
  }
  return parts;
}

std::vector<std::string_view> py_splitlines(std::string_view s) {
  std::vector<std::string_view> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size();) {
    if (const std::size_t n = line_break_size(s.substr(i))) {
      lines.push_back(s.substr(start, i - start));
      i += n;
      start = i;
    } else {
      ++i;
    }
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

Str py_replace(const Str& marked, std::string_view old, const Str& replacement, std::int64_t count) {
  const std::string_view s = marked.text;
  Str out;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::int64_t done = 0;
    for (const std::string_view c : code_points(s)) {
      if (count < 0 || done < count) {
        append(out, replacement);
        ++done;
      }
      append(out, substr(marked, c));
    }
    if (count < 0 || done < count) append(out, replacement);
    return out;
  }
  std::size_t start = 0;
  std::int64_t done = 0;
  while (count < 0 || done < count) {
    const std::size_t at = s.find(old, start);
    if (at == std::string_view::npos) break;
    append(out, substr(marked, s.substr(start, at - start)));
    append(out, replacement);
    start = at + old.size();
    ++done;
  }
  append(out, substr(marked, s.substr(start)));
  return out;
}

ReplaceSize py_replace_size(const Str& marked, std::string_view old, const Str& replacement,
                            std::int64_t count) {
  const std::string_view s = marked.text;
  std::size_t matches = 0;
  const auto limit = count < 0 ? SIZE_MAX : static_cast<std::size_t>(count);
  if (old.empty()) {
    matches = std::min(code_point_count(s) + 1, limit);
  } else {
    for (std::size_t at = s.find(old); at != std::string_view::npos && matches < limit;
         at = s.find(old, at + old.size())) {
      ++matches;
    }
  }
  ReplaceSize size;
  if (__builtin_mul_overflow(matches, replacement.text.size(), &size.bytes) ||
      __builtin_add_overflow(size.bytes, s.size() - matches * old.size(), &size.bytes)) {
    size.bytes = SIZE_MAX;
  }
  if (__builtin_mul_overflow(matches, replacement.client.size() + 1, &size.client_ranges) ||
      __builtin_add_overflow(size.client_ranges, marked.client.size(), &size.client_ranges)) {
    size.client_ranges = SIZE_MAX;
  }
  return size;
}

}  // namespace capserve::runtime::jinja
