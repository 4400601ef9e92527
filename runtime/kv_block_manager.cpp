#include "runtime/kv_block_manager.h"

#include <algorithm>
#include <stdexcept>

namespace capserve::runtime {

KvBlockManager::KvBlockManager(std::int64_t num_blocks, std::int64_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  if (num_blocks < 0 || block_size <= 0)
    throw std::invalid_argument("KvBlockManager: bad block count or size");
  free_.reserve(static_cast<std::size_t>(num_blocks));
  // Lowest block ids are handed out first.
  for (std::int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
}

bool KvBlockManager::reserve(SequenceId seq, std::int64_t tokens) {
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

void KvBlockManager::truncate(SequenceId seq, std::int64_t tokens) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  std::vector<std::int32_t>& table = it->second;
  const auto keep = static_cast<std::size_t>(std::max<std::int64_t>(blocks_for(tokens), 0));
  while (table.size() > keep) {
    free_.push_back(table.back());
    table.pop_back();
  }
}

void KvBlockManager::release(SequenceId seq) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  free_.insert(free_.end(), it->second.rbegin(), it->second.rend());
  tables_.erase(it);
}

std::span<const std::int32_t> KvBlockManager::block_table(SequenceId seq) const {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) throw std::out_of_range("KvBlockManager: unknown sequence");
  return it->second;
}

}  // namespace capserve::runtime
