#pragma once
// Paged KV cache: fixed-size blocks of token slots shared by all sequences, a free list, and one block table
// per sequence. Every layer has its own K and V pools laid out [num_blocks, block_size, num_kv_heads,
// head_dim].
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"

namespace capserve::runtime {

using SequenceId = std::uint64_t;

struct KvCacheShape {
  std::int64_t num_layers = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t block_size = 16;
  std::int64_t num_blocks = 0;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheShape& shape);

  // Blocks needed for a sequence to hold `tokens` tokens in total.
  [[nodiscard]] std::int64_t blocks_for(std::int64_t tokens) const;
  [[nodiscard]] std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }
  [[nodiscard]] const KvCacheShape& shape() const { return shape_; }

  // Grows the sequence's block table to hold `tokens` tokens; false (and no change) when the pool is too
  // small.
  bool reserve(SequenceId seq, std::int64_t tokens);
  void release(SequenceId seq);
  [[nodiscard]] std::span<const std::int32_t> block_table(SequenceId seq) const;

  [[nodiscard]] kernels::PagedKvLayer layer(std::int64_t layer);

 private:
  KvCacheShape shape_;
  std::vector<float> k_;
  std::vector<float> v_;
  std::vector<std::int32_t> free_;
  std::unordered_map<SequenceId, std::vector<std::int32_t>> tables_;
};

}  // namespace capserve::runtime
