#pragma once
// What a grammar needs to know about a tokenizer, computed once per tokenizer and shared by every compiled
// grammar: each token's bytes, the stop tokens, and a byte trie of the vocabulary in preorder, over which a
// mask is one walk that shares the work of tokens with a common prefix.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace capserve::runtime::grammar {

struct TrieNode {
  std::int32_t depth = 0;        // bytes from the root
  std::uint8_t byte = 0;         // the byte on the edge from the parent
  std::int32_t subtree_end = 0;  // one past the last node of the subtree (nodes are in preorder)
  std::int32_t tokens_begin =
      0;  // the tokens spelled by this node start here in TokenVocabulary::trie_tokens
};

class TokenVocabulary {
 public:
  // Token bytes: byte-level BPE tokens through GPT-2's byte alphabet; sentencepiece-style vocabularies (those
  // with byte-fallback tokens, "<0x0A>") with U+2581 as a space and "<0xHH>" as the byte. Special tokens
  // spell nothing: a grammar never allows them, except the stop tokens once the grammar is complete.
  static TokenVocabulary from_tokenizer(const Tokenizer& tokenizer, std::vector<std::int32_t> stop_tokens);
  // For tests: the bytes of each id (nullopt: a special token).
  TokenVocabulary(std::vector<std::optional<std::string>> token_bytes, std::vector<std::int32_t> stop_tokens);

  [[nodiscard]] std::int32_t size() const { return static_cast<std::int32_t>(bytes_.size()); }
  // The number of int32 words of a bitmask over the vocabulary.
  [[nodiscard]] std::int32_t mask_words() const { return (size() + 31) / 32; }
  [[nodiscard]] const std::optional<std::string>& bytes(std::int32_t id) const {
    return bytes_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] bool is_stop(std::int32_t id) const;
  [[nodiscard]] std::span<const std::int32_t> stop_tokens() const { return stop_tokens_; }
  [[nodiscard]] std::span<const TrieNode> trie() const { return trie_; }
  // Token ids in trie preorder: node i spells trie_tokens[tokens_begin(i), tokens_begin(i + 1)), and its
  // subtree spells trie_tokens[tokens_begin(i), tokens_begin(subtree_end)).
  [[nodiscard]] std::span<const std::int32_t> trie_tokens() const { return trie_tokens_; }
  [[nodiscard]] std::int32_t tokens_begin(std::int32_t node) const;

 private:
  std::vector<std::optional<std::string>> bytes_;
  std::vector<std::int32_t> stop_tokens_;
  std::vector<TrieNode> trie_;
  std::vector<std::int32_t> trie_tokens_;
};

}  // namespace capserve::runtime::grammar
