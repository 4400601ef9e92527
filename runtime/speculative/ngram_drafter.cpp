#include "runtime/speculative/ngram_drafter.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace capserve::runtime {

NgramDrafter::NgramDrafter(std::int64_t k, std::int64_t min_n, std::int64_t max_n)
    : k_(k), min_n_(min_n), max_n_(max_n) {
  if (k < 1 || min_n < 1 || max_n < min_n) {
    throw std::invalid_argument("n-gram drafter: needs k >= 1 and 1 <= min n <= max n (got k " +
                                std::to_string(k) + ", n " + std::to_string(min_n) + ".." +
                                std::to_string(max_n) + ")");
  }
}

void NgramDrafter::propose(std::span<const DraftSlot> slots, std::span<std::int64_t> counts) {
  for (std::size_t i = 0; i < slots.size(); ++i) counts[i] = propose_one(slots[i].history, slots[i].drafts);
}

std::int64_t NgramDrafter::propose_one(std::span<const std::int32_t> history,
                                       std::span<std::int32_t> drafts) const {
  const auto length = static_cast<std::int64_t>(history.size());
  const std::int64_t room = std::min<std::int64_t>(k_, static_cast<std::int64_t>(drafts.size()));
  if (room <= 0) return 0;
  for (std::int64_t n = std::min(max_n_, length - 1); n >= min_n_; --n) {
    const std::span<const std::int32_t> suffix = history.subspan(static_cast<std::size_t>(length - n));
    // The most recent earlier occurrence: starts from length - n - 1 down to 0.
    for (std::int64_t start = length - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), history.begin() + start)) continue;
      // Token `from + i` of history-then-drafts: from + i < length + i, so a position past the history is a
      // draft already written.
      const std::int64_t from = start + n;
      for (std::int64_t i = 0; i < room; ++i) {
        const std::int64_t at = from + i;
        drafts[static_cast<std::size_t>(i)] = at < length ? history[static_cast<std::size_t>(at)]
                                                          : drafts[static_cast<std::size_t>(at - length)];
      }
      return room;
    }
  }
  return 0;
}

}  // namespace capserve::runtime
