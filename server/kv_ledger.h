#pragma once
// Rank 0's record of every rank's KV blocks: one runtime::KvBlockManager per rank that performs the same
// operations in the same order as that rank's engine (so its prefix cache holds the same blocks, and a
// sequence's cached prefix can be planned here and taken there), plus the blocks each running sequence may
// still take before it ends (its reservation: admission promises prompt + max_tokens, so a running sequence
// never runs out of blocks). Operation order, which both sides follow: the plan's frees, then each prefill
// chunk in the plan's order (a new sequence adopts its cached prefix first), then the decodes; the tokens
// of all of them are recorded after every reservation (the engine records them after the step).
#include <algorithm>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "runtime/kv_block_manager.h"

namespace capserve::server {

class KvLedger {
 public:
  KvLedger(int ranks, std::int64_t blocks_per_rank, std::int64_t block_size, bool prefix_cache);

  [[nodiscard]] std::int64_t block_size() const { return block_size_; }
  [[nodiscard]] std::int64_t blocks_per_rank() const { return blocks_per_rank_; }
  [[nodiscard]] std::int64_t blocks_for(std::int64_t tokens) const {
    return runtime::KvBlockManager::blocks_for(tokens, block_size_);
  }

  // Prompt tokens whose K/V `rank`'s cache holds and a new sequence may take: whole cached blocks, leaving
  // at least one prompt token to compute (its logits start the output). 0 without the prefix cache.
  [[nodiscard]] std::int64_t cached_tokens(int rank, std::span<const std::int32_t> prompt) const;
  // Blocks a new sequence of at most `total` tokens, whose first `cached` prompt tokens come from the cache,
  // takes from `rank`'s free pool over its life; and what that pool can still promise.
  [[nodiscard]] std::int64_t blocks_needed(int rank, std::span<const std::int32_t> prompt,
                                           std::int64_t cached, std::int64_t total) const;
  [[nodiscard]] std::int64_t room(int rank) const;

  // A new sequence on `rank`: takes its cached prefix and reserves blocks for `total` tokens.
  void open(int rank, std::uint64_t seq, std::span<const std::int32_t> prompt, std::int64_t cached,
            std::int64_t total);
  // The sequence's cache grows to `tokens` tokens (within its reservation).
  void grow(std::uint64_t seq, std::int64_t tokens);
  // The tokens just placed in its cache, recorded after the step's reservations (the prefix cache keys its
  // full blocks by them).
  void record(std::uint64_t seq, std::span<const std::int32_t> tokens);
  void close(std::uint64_t seq);
  // The rank refused a step: it released that step's sequences (`seqs`, in order) and dropped its idle
  // cached blocks (RankWorker); the mirror does the same.
  void fail_step(int rank, std::span<const std::uint64_t> seqs);

  // Per rank: blocks held or promised (the cache's idle blocks are free: any reservation may evict them).
  [[nodiscard]] std::vector<std::int64_t> used() const;
  [[nodiscard]] std::int64_t cached_blocks(int rank) const;
  [[nodiscard]] std::int64_t evictions(int rank) const;

 private:
  struct Sequence {
    int rank = 0;
    std::int64_t adopted = 0;   // blocks taken from the cache at its start
    std::int64_t held = 0;      // blocks in its table (the adopted ones included)
    std::int64_t reserved = 0;  // blocks it may take from the free pool over its life
    // Blocks it has yet to take of its reservation.
    [[nodiscard]] std::int64_t pending() const {
      return std::max<std::int64_t>(0, reserved - (held - adopted));
    }
  };

  std::int64_t blocks_per_rank_;
  std::int64_t block_size_;
  std::vector<runtime::KvBlockManager> ranks_;
  std::vector<std::int64_t> pending_;  // per rank: the sum of its sequences' pending blocks
  std::unordered_map<std::uint64_t, Sequence> sequences_;
};

}  // namespace capserve::server
