#include "tools/loadgen/prefix_tokens.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace capserve::loadgen {
namespace {

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective mix, so distinct inputs stay distinct
// and neighbouring hash ids or positions give unrelated outputs.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27U)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31U);
}

}  // namespace

std::vector<std::int32_t> ordinary_token_ids(const runtime::Tokenizer& tokenizer) {
  std::vector<std::int32_t> ids;
  for (std::int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.id_to_token(id) && !tokenizer.is_special(id)) ids.push_back(id);
  }
  return ids;
}

PrefixTokens::PrefixTokens(std::vector<std::int32_t> vocabulary, std::int64_t block_tokens,
                           std::uint64_t seed)
    : vocabulary_(std::move(vocabulary)), block_tokens_(block_tokens), seed_(seed) {
  if (vocabulary_.empty()) throw std::invalid_argument("prefix tokens: empty vocabulary");
  if (block_tokens_ < 1) throw std::invalid_argument("prefix tokens: block size must be >= 1 token");
}

void PrefixTokens::append_block(std::int64_t hash_id, std::int64_t count,
                                std::vector<std::int32_t>& out) const {
  // The block's key depends on the seed and the hash id only, never on the request or its position.
  const std::uint64_t key = mix(seed_ ^ mix(static_cast<std::uint64_t>(hash_id)));
  for (std::int64_t j = 0; j < count; ++j)
    out.push_back(vocabulary_[mix(key + static_cast<std::uint64_t>(j)) % vocabulary_.size()]);
}

std::vector<std::int32_t> PrefixTokens::block(std::int64_t hash_id) const {
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(block_tokens_));
  append_block(hash_id, block_tokens_, out);
  return out;
}

std::vector<std::int32_t> PrefixTokens::prompt(std::span<const std::int64_t> hash_ids,
                                               std::int64_t tokens) const {
  if (tokens > static_cast<std::int64_t>(hash_ids.size()) * block_tokens_)
    throw std::invalid_argument("prefix tokens: " + std::to_string(tokens) + " tokens asked of " +
                                std::to_string(hash_ids.size()) + " blocks of " +
                                std::to_string(block_tokens_));
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(std::max<std::int64_t>(tokens, 0)));
  for (std::size_t b = 0; static_cast<std::int64_t>(out.size()) < tokens; ++b)
    append_block(hash_ids[b], std::min(block_tokens_, tokens - static_cast<std::int64_t>(out.size())), out);
  return out;
}

}  // namespace capserve::loadgen
