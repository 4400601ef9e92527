#pragma once
// Cache-aware rank choice (SGLang's router is the anchor): a newcomer goes to the data-parallel rank whose
// prefix cache holds most of its prompt, among the ranks with room that run at most `slack` more sequences
// than the least busy one, provided that prefix covers at least `min_share` of the prompt (SGLang's
// cache_threshold: a short common prefix such as a system prompt is not worth a busier rank); otherwise, and
// on equal prefixes, the least busy of those ranks (then the one caching more, then the lowest).
#include <cstdint>
#include <span>

#include "server/kv_ledger.h"

namespace capserve::server {

struct Placement {
  int rank = -1;            // -1: no rank has the room for the request's context
  std::int64_t cached = 0;  // prompt tokens the rank's cache holds
};

struct PlacementAsk {
  std::span<const std::int32_t> prompt;
  std::int64_t context_tokens = 0;  // what its admission reserves: prompt + max tokens within the context
  bool reuse_cache = true;          // false: its prompt is computed whole (prompt log-probabilities, ...)
};

struct AffinityPolicy {
  std::int64_t slack = 4;  // sequences a rank may run beyond the least busy one and still win by its cache
  double min_share = 0.5;  // of the prompt its cached prefix must cover to count
};

// `rank_sequences`: the sequences each rank runs now.
[[nodiscard]] Placement choose_rank(const KvLedger& kv, std::span<const std::int64_t> rank_sequences,
                                    const PlacementAsk& ask, AffinityPolicy policy);

}  // namespace capserve::server
