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

// Whether any of `ranges` (sorted, not overlapping) shares a byte with [begin, end). A binary search: a
// prompt of many messages has as many ranges, and the tokenizer asks once per special-token match.
inline bool overlaps_any(std::span<const TextRange> ranges, std::size_t begin, std::size_t end) {
  const auto first_ending_after =
      std::partition_point(ranges.begin(), ranges.end(), [&](const TextRange& r) { return r.end <= begin; });
  return first_ending_after != ranges.end() && first_ending_after->begin < end;
}

}  // namespace capserve::runtime
