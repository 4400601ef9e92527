#include "runtime/kv_block_manager.h"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>

namespace capserve::runtime {

std::uint64_t KvBlockManager::default_block_hash(std::uint64_t parent_key,
                                                 std::span<const std::int32_t> tokens) {
  constexpr std::uint64_t kPrime = 0x100000001b3ULL;
  std::uint64_t h = 0xcbf29ce484222325ULL;
  const auto mix = [&h](std::uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) {
      h ^= (value >> (8 * i)) & 0xffU;
      h *= kPrime;
    }
  };
  mix(parent_key, 8);
  for (const std::int32_t t : tokens) mix(static_cast<std::uint32_t>(t), 4);
  return h;
}

KvBlockManager::KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, bool prefix_cache,
                               BlockHash hash)
    : num_blocks_(num_blocks), block_size_(block_size), prefix_cache_(prefix_cache), hash_(hash) {
  if (num_blocks < 0 || block_size <= 0 || num_blocks > INT32_MAX)
    throw std::invalid_argument("KvBlockManager: bad block count or size");
  if (hash == nullptr) throw std::invalid_argument("KvBlockManager: no block hash");
  free_.reserve(static_cast<std::size_t>(num_blocks));
  // Lowest block ids are handed out first.
  for (std::int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
  blocks_.resize(static_cast<std::size_t>(num_blocks));
  if (prefix_cache) {
    tokens_.resize(static_cast<std::size_t>(num_blocks * block_size));
    buckets_.assign(std::bit_ceil(static_cast<std::size_t>(std::max<std::int64_t>(num_blocks, 1))), kNone);
  }
}

std::span<const std::int32_t> KvBlockManager::block_tokens(std::int32_t block) const {
  return std::span(tokens_).subspan(static_cast<std::size_t>(block * block_size_),
                                    static_cast<std::size_t>(block_size_));
}

std::size_t KvBlockManager::bucket_of(std::uint64_t parent_key, std::span<const std::int32_t> tokens) const {
  return static_cast<std::size_t>(hash_(parent_key, tokens)) & (buckets_.size() - 1);
}

std::int32_t KvBlockManager::find(std::uint64_t parent_key, std::span<const std::int32_t> tokens) const {
  for (std::int32_t b = buckets_[bucket_of(parent_key, tokens)]; b != kNone;
       b = blocks_[static_cast<std::size_t>(b)].bucket_next) {
    const Block& block = blocks_[static_cast<std::size_t>(b)];
    if (block.parent_key == parent_key && std::ranges::equal(block_tokens(b), tokens)) return b;
  }
  return kNone;
}

void KvBlockManager::index(std::int32_t b, std::uint64_t parent_key) {
  Block& block = blocks_[static_cast<std::size_t>(b)];
  std::int32_t& head = buckets_[bucket_of(parent_key, block_tokens(b))];
  block.indexed = true;
  block.key = next_key_++;
  block.parent_key = parent_key;
  block.bucket_next = head;
  head = b;
  ++cached_;
}

void KvBlockManager::unindex(std::int32_t b) {
  Block& block = blocks_[static_cast<std::size_t>(b)];
  std::int32_t* link = &buckets_[bucket_of(block.parent_key, block_tokens(b))];
  while (*link != b) link = &blocks_[static_cast<std::size_t>(*link)].bucket_next;
  *link = block.bucket_next;
  block.indexed = false;
  block.key = block.parent_key = 0;
  block.bucket_next = kNone;
  --cached_;
}

void KvBlockManager::idle_push(std::int32_t b) {
  Block& block = blocks_[static_cast<std::size_t>(b)];
  block.lru_prev = lru_tail_;
  block.lru_next = kNone;
  if (lru_tail_ != kNone) {
    blocks_[static_cast<std::size_t>(lru_tail_)].lru_next = b;
  } else {
    lru_head_ = b;
  }
  lru_tail_ = b;
  ++idle_;
}

void KvBlockManager::idle_remove(std::int32_t b) {
  Block& block = blocks_[static_cast<std::size_t>(b)];
  if (block.lru_prev != kNone) {
    blocks_[static_cast<std::size_t>(block.lru_prev)].lru_next = block.lru_next;
  } else {
    lru_head_ = block.lru_next;
  }
  if (block.lru_next != kNone) {
    blocks_[static_cast<std::size_t>(block.lru_next)].lru_prev = block.lru_prev;
  } else {
    lru_tail_ = block.lru_prev;
  }
  block.lru_prev = block.lru_next = kNone;
  --idle_;
}

void KvBlockManager::free_block(std::int32_t b) {
  Block& block = blocks_[static_cast<std::size_t>(b)];
  if (block.indexed) {
    idle_push(b);
  } else {
    block = Block{};
    free_.push_back(b);
  }
}

bool KvBlockManager::reserve(SequenceId seq, std::int64_t tokens) {
  const auto it = tables_.find(seq);
  const std::int64_t have = it == tables_.end() ? 0 : static_cast<std::int64_t>(it->second.table.size());
  const std::int64_t need = blocks_for(tokens) - have;
  if (need > free_blocks()) return false;
  std::vector<std::int32_t>& table = it == tables_.end() ? tables_[seq].table : it->second.table;
  for (std::int64_t i = 0; i < need; ++i) {
    std::int32_t b = kNone;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = lru_head_;
      idle_remove(b);
      unindex(b);
      ++evictions_;
    }
    blocks_[static_cast<std::size_t>(b)].refs = 1;
    table.push_back(b);
  }
  return true;
}

void KvBlockManager::truncate(SequenceId seq, std::int64_t tokens) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  Sequence& s = it->second;
  const auto keep = static_cast<std::size_t>(std::max<std::int64_t>(blocks_for(tokens), 0));
  // The kept block the cut leaves partial is written again from the cut on: it may not stay cached.
  const bool cut_inside = keep > 0 && keep <= s.table.size() && tokens % block_size_ != 0;
  if (cut_inside) {
    Block& partial = blocks_[static_cast<std::size_t>(s.table[keep - 1])];
    if (partial.indexed && partial.refs > 1) {
      throw std::logic_error("KvBlockManager::truncate: sequence " + std::to_string(seq) + " to " +
                             std::to_string(tokens) +
                             " tokens would overwrite a block another sequence holds");
    }
    if (partial.indexed) unindex(s.table[keep - 1]);
    partial.key = 0;  // a duplicate's borrowed key no longer names its content either
  }
  while (s.table.size() > keep) {
    const std::int32_t b = s.table.back();
    s.table.pop_back();
    Block& block = blocks_[static_cast<std::size_t>(b)];
    if (--block.refs > 0) continue;  // another sequence's too: its content stays valid and cached
    if (block.indexed) unindex(b);
    free_block(b);
  }
  s.recorded = std::min(s.recorded, std::max<std::int64_t>(tokens, 0));
}

void KvBlockManager::release(SequenceId seq) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  // Tail first: the plain free list then hands the head's id out first, and among idle cached blocks the
  // tail is evicted first.
  const std::vector<std::int32_t>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) {
    if (--blocks_[static_cast<std::size_t>(*b)].refs == 0) free_block(*b);
  }
  tables_.erase(it);
}

void KvBlockManager::drop_idle() {
  while (lru_head_ != kNone) {
    const std::int32_t b = lru_head_;
    idle_remove(b);
    unindex(b);
    ++evictions_;
    blocks_[static_cast<std::size_t>(b)] = Block{};
    free_.push_back(b);
  }
}

std::span<const std::int32_t> KvBlockManager::block_table(SequenceId seq) const {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) throw std::out_of_range("KvBlockManager: unknown sequence");
  return it->second.table;
}

std::int64_t KvBlockManager::cached_prefix(std::span<const std::int32_t> tokens) const {
  if (!prefix_cache_) return 0;
  const auto size = static_cast<std::int64_t>(tokens.size());
  std::uint64_t parent = 0;
  std::int64_t n = 0;
  for (; (n + 1) * block_size_ <= size; ++n) {
    const std::int32_t b = find(parent, tokens.subspan(static_cast<std::size_t>(n * block_size_),
                                                       static_cast<std::size_t>(block_size_)));
    if (b == kNone) break;
    parent = blocks_[static_cast<std::size_t>(b)].key;
  }
  return n * block_size_;
}

std::int64_t KvBlockManager::idle_cached_blocks(std::span<const std::int32_t> tokens,
                                                std::int64_t cached_tokens) const {
  if (!prefix_cache_) return 0;
  std::uint64_t parent = 0;
  std::int64_t idle = 0;
  for (std::int64_t n = 0; (n + 1) * block_size_ <= cached_tokens; ++n) {
    const std::int32_t b = find(parent, tokens.subspan(static_cast<std::size_t>(n * block_size_),
                                                       static_cast<std::size_t>(block_size_)));
    if (b == kNone) break;
    const Block& block = blocks_[static_cast<std::size_t>(b)];
    if (block.refs == 0) ++idle;
    parent = block.key;
  }
  return idle;
}

bool KvBlockManager::adopt_prefix(SequenceId seq, std::span<const std::int32_t> tokens,
                                  std::int64_t cached_tokens) {
  if (tables_.contains(seq) || cached_tokens < 0 || cached_tokens % block_size_ != 0 ||
      cached_tokens > static_cast<std::int64_t>(tokens.size()) || cached_prefix(tokens) < cached_tokens)
    return false;
  Sequence& s = tables_[seq];
  std::uint64_t parent = 0;
  for (std::int64_t n = 0; n < cached_tokens / block_size_; ++n) {
    const std::int32_t b = find(parent, tokens.subspan(static_cast<std::size_t>(n * block_size_),
                                                       static_cast<std::size_t>(block_size_)));
    Block& block = blocks_[static_cast<std::size_t>(b)];
    if (block.refs++ == 0) idle_remove(b);
    parent = block.key;
    s.table.push_back(b);
  }
  s.recorded = cached_tokens;
  return true;
}

void KvBlockManager::append_tokens(SequenceId seq, std::span<const std::int32_t> tokens) {
  if (!prefix_cache_) return;
  const auto it = tables_.find(seq);
  if (it == tables_.end()) throw std::logic_error("KvBlockManager::append_tokens: unknown sequence");
  Sequence& s = it->second;
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (s.recorded + n > static_cast<std::int64_t>(s.table.size()) * block_size_) {
    throw std::logic_error("KvBlockManager::append_tokens: sequence " + std::to_string(seq) +
                           " holds no slots for " + std::to_string(s.recorded + n) + " tokens");
  }
  for (const std::int32_t t : tokens) {
    const std::int64_t pos = s.recorded++;
    const std::int64_t n_block = pos / block_size_;
    const std::int32_t b = s.table[static_cast<std::size_t>(n_block)];
    tokens_[static_cast<std::size_t>(b * block_size_ + pos % block_size_)] = t;
    if (pos % block_size_ != block_size_ - 1) continue;
    const std::uint64_t parent =
        n_block == 0 ? 0
                     : blocks_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(n_block - 1)])].key;
    const std::int32_t equal = find(parent, block_tokens(b));
    if (equal == kNone) {
      index(b, parent);
    } else {
      blocks_[static_cast<std::size_t>(b)].key = blocks_[static_cast<std::size_t>(equal)].key;
    }
  }
}

}  // namespace capserve::runtime
