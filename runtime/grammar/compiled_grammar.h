#pragma once
// A grammar compiled against a vocabulary, shared (immutable) by the matchers of every sequence that uses it.
//
// Mask cache (xgrammar's adaptive token mask): for every bytes element of the grammar, the vocabulary is
// walked once with that element alone on the stack. A token the element's own rule can consume whole is
// allowed in any context; one that fails inside the rule is refused in any context; only a token that leaves
// the rule before its last byte ("uncertain") depends on the stack below, and is checked against the real
// stack at mask time. In JSON most tokens are decided by the cache: a mask is a few bitmask ORs and a short
// list of token checks.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "runtime/grammar/grammar.h"
#include "runtime/grammar/token_vocabulary.h"

namespace capserve::runtime::grammar {

class CompiledGrammar {
 public:
  CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary);

  [[nodiscard]] const Grammar& grammar() const { return grammar_; }
  [[nodiscard]] const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  // The tokens allowed in any context at the bytes element at `position` (mask_words() words).
  [[nodiscard]] std::span<const std::uint32_t> allowed(std::int32_t position) const;
  // The tokens to check against the stack at `position`.
  [[nodiscard]] std::span<const std::int32_t> uncertain(std::int32_t position) const;

 private:
  void cache_position(std::int32_t position);

  Grammar grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<std::int32_t> cache_index_;  // position -> its cache entry, -1 for elements other than bytes
  std::vector<std::uint32_t> allowed_;     // entry * mask_words
  std::vector<std::int32_t> uncertain_;
  std::vector<std::int32_t> uncertain_begin_;  // entry -> start in uncertain_, plus an end marker
};

}  // namespace capserve::runtime::grammar
