#pragma once
// The host side of the paged KV cache: which fixed-size blocks of token slots each sequence holds, and which
// are free. It owns the one formula for how many blocks a sequence of n tokens needs, which the server's
// admission accounting uses too (server/scheduler.cpp plans every rank's blocks with it). The pools the
// blocks index are device memory (runtime/kv_cache.h); this class never touches them.
//
// With the prefix cache on (runtime/README.md, "Prefix cache") it also keeps every full block it was told
// the tokens of, identified by its content: its parent block's key and its exact token ids. Sequences on the
// same cache share such blocks (reference counts), freed ones stay cached until memory is needed, and a new
// sequence can start holding a cached prefix. Its state is a function of its operation sequence only (no
// addresses, no unordered iteration, no clocks): the server keeps one mirror per rank that performs the
// rank engine's operations in the same order and must reach the same answers.
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace capserve::runtime {

using SequenceId = std::uint64_t;

class KvBlockManager {
 public:
  // Picks a block's index bucket from its parent's key and its token ids. Only a bucket: matching compares
  // the parent key and every token id, so a hash that collides (a test's seam) costs time, never correctness.
  using BlockHash = std::uint64_t (*)(std::uint64_t parent_key, std::span<const std::int32_t> tokens);
  // FNV-1a over the parent key and the token ids.
  static std::uint64_t default_block_hash(std::uint64_t parent_key, std::span<const std::int32_t> tokens);

  KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, bool prefix_cache = false,
                 BlockHash hash = default_block_hash);

  // Blocks a sequence of `tokens` tokens in total occupies.
  [[nodiscard]] static std::int64_t blocks_for(std::int64_t tokens, std::int64_t block_size) {
    return (tokens + block_size - 1) / block_size;
  }
  [[nodiscard]] std::int64_t blocks_for(std::int64_t tokens) const { return blocks_for(tokens, block_size_); }

  [[nodiscard]] std::int64_t block_size() const { return block_size_; }
  [[nodiscard]] std::int64_t num_blocks() const { return num_blocks_; }
  [[nodiscard]] bool prefix_cache() const { return prefix_cache_; }
  // Blocks free for a reservation: never used or freed blocks, plus cached blocks no sequence holds (a
  // reservation evicts those when the others run out).
  [[nodiscard]] std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()) + idle_; }

  // Grows the sequence's block table to hold `tokens` tokens; false (and no change) when too few blocks are
  // free. Plain free blocks go first (the most recently freed); then the least recently released idle cached
  // block is evicted (it leaves the index). A sequence's blocks become idle tail first, so its tail is
  // evicted before its head and prefixes outlive their suffixes (vLLM's order).
  bool reserve(SequenceId seq, std::int64_t tokens);
  // Shrinks the sequence's block table to what `tokens` tokens occupy and frees the rest (speculative
  // decoding's rollback of rejected draft tokens); a table already that small is left as it is. Recorded
  // tokens past `tokens` are forgotten. The freed blocks hold only this sequence's rejected positions: one no
  // other sequence holds leaves the index. A kept block the cut leaves partial leaves the index too, since
  // the sequence will overwrite its tail; std::logic_error if another sequence holds it (a truncate must
  // follow the step that appended the rejected tokens before any adopt_prefix, and never cut into an
  // adopted prefix another sequence shares).
  void truncate(SequenceId seq, std::int64_t tokens);
  // Drops the sequence's references. A block no sequence holds any more goes back to the free blocks:
  // cached (idle, the most recently used) when it is in the index, plain otherwise.
  void release(SequenceId seq);
  [[nodiscard]] std::span<const std::int32_t> block_table(SequenceId seq) const;
  // Evicts every cached block no sequence holds (they become plain free blocks; counted as evictions): after
  // a failed step, whose released sequences may have left blocks whose K/V was never written, this brings
  // the cache back to the blocks running sequences hold, on the rank and in rank 0's mirror alike.
  void drop_idle();

  // Tokens at the start of `tokens` whose K/V the cache holds: whole blocks, the longest chain from the start
  // whose content equals a cached block's. Can be all of `tokens`; a step must compute at least one token,
  // so a caller starting a sequence takes at most the whole blocks before its last token. 0 without the
  // cache. Changes nothing.
  [[nodiscard]] std::int64_t cached_prefix(std::span<const std::int32_t> tokens) const;
  // Of the cached blocks of the first `cached_tokens` tokens (a multiple of the block size, at most
  // cached_prefix(tokens)), how many no sequence holds now: adopting them takes them out of free_blocks().
  [[nodiscard]] std::int64_t idle_cached_blocks(std::span<const std::int32_t> tokens,
                                                std::int64_t cached_tokens) const;
  // Starts the unknown sequence `seq` holding the cached blocks of its first `cached_tokens` tokens (a
  // multiple of the block size, at most cached_prefix(tokens)) and records those tokens; the blocks'
  // reference counts go up. false, and no change, if `seq` is known or the blocks are not all cached.
  bool adopt_prefix(SequenceId seq, std::span<const std::int32_t> tokens, std::int64_t cached_tokens);
  // Records the token ids of the sequence's next positions (their K/V now written, i.e. after a successful
  // step); its table must already hold them (std::logic_error otherwise). Every block this fills enters the
  // index under its content, unless an equal block is already there: then this one stays out (duplicates
  // are allowed, never merged) and the sequence's later blocks chain on the cached one's key. Nothing
  // without the cache.
  void append_tokens(SequenceId seq, std::span<const std::int32_t> tokens);
  // Blocks in the index, held or idle.
  [[nodiscard]] std::int64_t cached_blocks() const { return cached_; }
  // Cached blocks reused for other content since construction.
  [[nodiscard]] std::int64_t evictions() const { return evictions_; }

 private:
  static constexpr std::int32_t kNone = -1;
  // Per block id. `key` names the content of the chain ending at this block: its own when in the index
  // (`indexed`), else the key of the equal indexed block it duplicates (0: nothing recorded). Keys come from
  // a counter and are never reused, unlike block ids, so a child's parent key can never come to mean other
  // content after its parent is evicted.
  struct Block {
    std::int32_t refs = 0;
    bool indexed = false;
    std::uint64_t key = 0;
    std::uint64_t parent_key = 0;
    std::int32_t bucket_next = kNone;  // the index's chain
    std::int32_t lru_prev = kNone;     // the idle list, least recently released first
    std::int32_t lru_next = kNone;
  };
  struct Sequence {
    std::vector<std::int32_t> table;
    std::int64_t recorded = 0;  // tokens whose ids are recorded, from position 0
  };

  [[nodiscard]] std::span<const std::int32_t> block_tokens(std::int32_t block) const;
  [[nodiscard]] std::size_t bucket_of(std::uint64_t parent_key, std::span<const std::int32_t> tokens) const;
  // The indexed block with this content, or kNone.
  [[nodiscard]] std::int32_t find(std::uint64_t parent_key, std::span<const std::int32_t> tokens) const;
  void index(std::int32_t block, std::uint64_t parent_key);
  void unindex(std::int32_t block);
  void idle_push(std::int32_t block);
  void idle_remove(std::int32_t block);
  // A block no sequence holds any more: idle cached when indexed, plain free otherwise.
  void free_block(std::int32_t block);

  std::int64_t num_blocks_;
  std::int64_t block_size_;
  bool prefix_cache_;
  BlockHash hash_;
  std::vector<std::int32_t> free_;  // plain free blocks, the next one handed out at the back
  std::vector<Block> blocks_;
  std::vector<std::int32_t> tokens_;   // [num_blocks, block_size]: each block's token ids (with the cache)
  std::vector<std::int32_t> buckets_;  // first block of each index chain (with the cache)
  std::int32_t lru_head_ = kNone;      // the idle cached block evicted next
  std::int32_t lru_tail_ = kNone;
  std::int64_t idle_ = 0;
  std::int64_t cached_ = 0;
  std::int64_t evictions_ = 0;
  std::uint64_t next_key_ = 1;  // 0 is the parent key of a sequence's first block
  std::unordered_map<SequenceId, Sequence> tables_;
};

}  // namespace capserve::runtime
