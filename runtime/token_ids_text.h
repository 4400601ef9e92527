#pragma once
// Token ids written as text ("1 2 3"), as the command-line tools read them.
#include <charconv>
#include <cstdint>
#include <string_view>
#include <vector>

namespace capserve::runtime {

// Parses whitespace-separated non-negative int32 ids into `ids`; false on anything else.
inline bool parse_token_ids(std::string_view text, std::vector<std::int32_t>& ids) {
  ids.clear();
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    if (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') {
      ++p;
      continue;
    }
    std::int32_t id = 0;
    const auto [next, error] = std::from_chars(p, end, id);
    if (error != std::errc() || id < 0) return false;
    ids.push_back(id);
    p = next;
  }
  return true;
}

}  // namespace capserve::runtime
