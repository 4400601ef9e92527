#include "runtime/kv_cache.h"

#include <stdexcept>

namespace capserve::runtime {

KvCache::KvCache(const KvCacheShape& shape) : shape_(shape) {
  const auto floats = static_cast<std::size_t>(shape.num_layers * shape.num_blocks * shape.block_size *
                                               shape.num_kv_heads * shape.head_dim);
  k_.assign(floats, 0.0F);
  v_.assign(floats, 0.0F);
  free_.reserve(static_cast<std::size_t>(shape.num_blocks));
  // Lowest block ids are handed out first.
  for (std::int64_t b = shape.num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
}

std::int64_t KvCache::blocks_for(std::int64_t tokens) const {
  return (tokens + shape_.block_size - 1) / shape_.block_size;
}

bool KvCache::reserve(SequenceId seq, std::int64_t tokens) {
  std::vector<std::int32_t>& table = tables_[seq];
  const std::int64_t need = blocks_for(tokens) - static_cast<std::int64_t>(table.size());
  if (need <= 0) return true;
  if (need > free_blocks()) return false;
  for (std::int64_t i = 0; i < need; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void KvCache::release(SequenceId seq) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  free_.insert(free_.end(), it->second.rbegin(), it->second.rend());
  tables_.erase(it);
}

std::span<const std::int32_t> KvCache::block_table(SequenceId seq) const {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) throw std::out_of_range("KvCache: unknown sequence");
  return it->second;
}

kernels::PagedKvLayer KvCache::layer(std::int64_t layer) {
  const auto per_layer =
      static_cast<std::size_t>(shape_.num_blocks * shape_.block_size * shape_.num_kv_heads * shape_.head_dim);
  const auto offset = static_cast<std::size_t>(layer) * per_layer;
  return {std::span<float>(k_).subspan(offset, per_layer), std::span<float>(v_).subspan(offset, per_layer),
          shape_.block_size, shape_.num_kv_heads, shape_.head_dim};
}

}  // namespace capserve::runtime
