#include "server/rank_choice.h"

#include <cstddef>

namespace capserve::server {

Placement choose_rank(const KvLedger& kv, std::span<const std::int64_t> rank_sequences,
                      const PlacementAsk& ask, AffinityPolicy policy) {
  const auto ranks = static_cast<int>(rank_sequences.size());
  const auto busy = [&](int r) { return rank_sequences[static_cast<std::size_t>(r)]; };
  const auto fits = [&](int r, std::int64_t cached) {
    return kv.blocks_needed(r, ask.prompt, cached, ask.context_tokens) <= kv.room(r);
  };
  const auto cached_on = [&](int r) { return ask.reuse_cache ? kv.cached_tokens(r, ask.prompt) : 0; };
  std::int64_t least_busy = -1;
  for (int r = 0; r < ranks; ++r) {
    if (fits(r, cached_on(r)) && (least_busy < 0 || busy(r) < least_busy)) least_busy = busy(r);
  }
  const auto worth = static_cast<double>(ask.prompt.size()) * policy.min_share;
  Placement best;
  std::int64_t best_affinity = 0;
  for (int r = 0; r < ranks; ++r) {
    if (least_busy < 0 || busy(r) > least_busy + policy.slack) continue;
    const std::int64_t cached = cached_on(r);
    if (!fits(r, cached)) continue;
    const std::int64_t affinity = static_cast<double>(cached) >= worth ? cached : 0;
    const bool better = best.rank < 0 || affinity > best_affinity ||
                        (affinity == best_affinity &&
                         (busy(r) < busy(best.rank) || (busy(r) == busy(best.rank) && cached > best.cached)));
    if (better) {
      best = {r, cached};
      best_affinity = affinity;
    }
  }
  return best;
}

}  // namespace capserve::server
