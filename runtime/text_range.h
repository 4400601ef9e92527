#pragma once
#include <algorithm>
#include <cstddef>
#include <span>

namespace capserve::runtime {

// The bytes [begin, end) of a text.
struct TextRange {
  std::size_t begin = 0;
  std::size_t end = 0;
};

// Whether any of `ranges` shares a byte with [begin, end).
inline bool overlaps_any(std::span<const TextRange> ranges, std::size_t begin, std::size_t end) {
  return std::any_of(ranges.begin(), ranges.end(),
                     [&](const TextRange& r) { return r.begin < end && begin < r.end; });
}

}  // namespace capserve::runtime
