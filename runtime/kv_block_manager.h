#pragma once
// The host side of the paged KV cache: which fixed-size blocks of token slots each sequence holds, and which
// are free. It owns the one formula for how many blocks a sequence of n tokens needs, which the server's
// admission accounting uses too (server/scheduler.cpp plans every rank's blocks with it). The pools the
// blocks index are device memory (runtime/kv_cache.h); this class never touches them.
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace capserve::runtime {

using SequenceId = std::uint64_t;

class KvBlockManager {
 public:
  KvBlockManager(std::int64_t num_blocks, std::int64_t block_size);

  // Blocks a sequence of `tokens` tokens in total occupies.
  [[nodiscard]] static std::int64_t blocks_for(std::int64_t tokens, std::int64_t block_size) {
    return (tokens + block_size - 1) / block_size;
  }
  [[nodiscard]] std::int64_t blocks_for(std::int64_t tokens) const { return blocks_for(tokens, block_size_); }

  [[nodiscard]] std::int64_t block_size() const { return block_size_; }
  [[nodiscard]] std::int64_t num_blocks() const { return num_blocks_; }
  [[nodiscard]] std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }

  // Grows the sequence's block table to hold `tokens` tokens; false (and no change) when too few blocks are
  // free.
  bool reserve(SequenceId seq, std::int64_t tokens);
  // Shrinks the sequence's block table to what `tokens` tokens occupy and frees the rest (speculative
  // decoding's rollback of rejected draft tokens); a table already that small is left as it is.
  void truncate(SequenceId seq, std::int64_t tokens);
  void release(SequenceId seq);
  [[nodiscard]] std::span<const std::int32_t> block_table(SequenceId seq) const;

 private:
  std::int64_t num_blocks_;
  std::int64_t block_size_;
  std::vector<std::int32_t> free_;
  std::unordered_map<SequenceId, std::vector<std::int32_t>> tables_;
};

}  // namespace capserve::runtime
