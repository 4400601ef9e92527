#include "server/kv_ledger.h"

#include <algorithm>
#include <stdexcept>

namespace capserve::server {

KvLedger::KvLedger(int ranks, std::int64_t blocks_per_rank, std::int64_t block_size, bool prefix_cache)
    : blocks_per_rank_(blocks_per_rank),
      block_size_(block_size),
      pending_(static_cast<std::size_t>(ranks), 0) {
  ranks_.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) ranks_.emplace_back(blocks_per_rank, block_size, prefix_cache);
}

std::int64_t KvLedger::cached_tokens(int rank, std::span<const std::int32_t> prompt) const {
  const runtime::KvBlockManager& m = ranks_[static_cast<std::size_t>(rank)];
  if (!m.prefix_cache() || prompt.empty()) return 0;
  const auto computable = static_cast<std::int64_t>(prompt.size()) - 1;
  return std::min(m.cached_prefix(prompt), computable / block_size_ * block_size_);
}

std::int64_t KvLedger::blocks_needed(int rank, std::span<const std::int32_t> prompt, std::int64_t cached,
                                     std::int64_t total) const {
  const runtime::KvBlockManager& m = ranks_[static_cast<std::size_t>(rank)];
  // Its own blocks, plus the cached ones no sequence holds now: taking them leaves the free pool too.
  const std::int64_t idle = cached > 0 ? m.idle_cached_blocks(prompt, cached) : 0;
  return blocks_for(total) - cached / block_size_ + idle;
}

std::int64_t KvLedger::room(int rank) const {
  const auto r = static_cast<std::size_t>(rank);
  return ranks_[r].free_blocks() - pending_[r];
}

void KvLedger::open(int rank, std::uint64_t seq, std::span<const std::int32_t> prompt, std::int64_t cached,
                    std::int64_t total) {
  runtime::KvBlockManager& m = ranks_[static_cast<std::size_t>(rank)];
  if (cached > 0 && !m.adopt_prefix(seq, prompt, cached))
    throw std::logic_error("KvLedger: a planned cached prefix is not in the cache");
  const std::int64_t adopted = cached / block_size_;
  const Sequence s{
      .rank = rank, .adopted = adopted, .held = adopted, .reserved = blocks_for(total) - adopted};
  sequences_.insert_or_assign(seq, s);
  pending_[static_cast<std::size_t>(rank)] += s.pending();
}

void KvLedger::grow(std::uint64_t seq, std::int64_t tokens) {
  Sequence& s = sequences_.at(seq);
  const auto r = static_cast<std::size_t>(s.rank);
  // Within the reservation the free pool always has the blocks: admission promised them.
  if (!ranks_[r].reserve(seq, tokens))
    throw std::logic_error("KvLedger: a sequence outgrew the blocks its rank promised");
  const std::int64_t before = s.pending();
  s.held = std::max(s.held, blocks_for(tokens));
  pending_[r] += s.pending() - before;
}

void KvLedger::record(std::uint64_t seq, std::span<const std::int32_t> tokens) {
  ranks_[static_cast<std::size_t>(sequences_.at(seq).rank)].append_tokens(seq, tokens);
}

void KvLedger::close(std::uint64_t seq) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end()) return;
  const auto r = static_cast<std::size_t>(it->second.rank);
  pending_[r] -= it->second.pending();
  ranks_[r].release(seq);
  sequences_.erase(it);
}

void KvLedger::fail_step(int rank, std::span<const std::uint64_t> seqs) {
  for (const std::uint64_t seq : seqs) close(seq);
  ranks_[static_cast<std::size_t>(rank)].drop_idle();
}

std::vector<std::int64_t> KvLedger::used() const {
  std::vector<std::int64_t> out(ranks_.size());
  for (std::size_t r = 0; r < ranks_.size(); ++r)
    out[r] = blocks_per_rank_ - ranks_[r].free_blocks() + pending_[r];
  return out;
}

std::int64_t KvLedger::cached_blocks(int rank) const {
  return ranks_[static_cast<std::size_t>(rank)].cached_blocks();
}

std::int64_t KvLedger::evictions(int rank) const {
  return ranks_[static_cast<std::size_t>(rank)].evictions();
}

}  // namespace capserve::server
