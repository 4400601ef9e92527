#pragma once
// Token-id prompts for a Mooncake trace: each hash id stands for one block of token ids drawn from the
// model's ordinary vocabulary by a generator seeded by the hash id (and the run's seed) alone, and a prompt
// is its blocks concatenated, cut to its length. Requests sharing hash ids 0..k therefore share exactly that
// token prefix, in every request and every run with the same seed, and different hash ids give different
// blocks.
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace capserve::loadgen {

// The ids a synthesised prompt may use: every id below the tokenizer's vocabulary size that has a token and
// is not special (so no BOS/EOS or chat marker inside a prompt).
std::vector<std::int32_t> ordinary_token_ids(const runtime::Tokenizer& tokenizer);

class PrefixTokens {
 public:
  // Throws std::invalid_argument on an empty vocabulary or a block size below 1.
  PrefixTokens(std::vector<std::int32_t> vocabulary, std::int64_t block_tokens, std::uint64_t seed);

  // The block `hash_id` stands for (block_tokens ids).
  [[nodiscard]] std::vector<std::int32_t> block(std::int64_t hash_id) const;
  // The first `tokens` ids of the blocks of `hash_ids`. Throws std::invalid_argument when they hold fewer.
  [[nodiscard]] std::vector<std::int32_t> prompt(std::span<const std::int64_t> hash_ids,
                                                 std::int64_t tokens) const;
  [[nodiscard]] std::int64_t block_tokens() const { return block_tokens_; }

 private:
  void append_block(std::int64_t hash_id, std::int64_t count, std::vector<std::int32_t>& out) const;

  std::vector<std::int32_t> vocabulary_;
  std::int64_t block_tokens_;
  std::uint64_t seed_;
};

}  // namespace capserve::loadgen
