#include "runtime/grammar/compiled_grammar.h"

#include <utility>

#include "runtime/grammar/stack_set.h"

namespace capserve::runtime::grammar {
namespace {

void set_bit(std::span<std::uint32_t> words, std::int32_t id) {
  words[static_cast<std::size_t>(id) / 32] |= 1U << (static_cast<unsigned>(id) % 32);
}

}  // namespace

CompiledGrammar::CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {
  cache_index_.assign(grammar_.elements.size(), -1);
  uncertain_begin_.push_back(0);
  for (std::size_t p = 0; p < grammar_.elements.size(); ++p) {
    if (grammar_.elements[p].kind != Element::Kind::bytes) continue;
    cache_index_[p] = static_cast<std::int32_t>(uncertain_begin_.size() - 1);
    cache_position(static_cast<std::int32_t>(p));
  }
}

void CompiledGrammar::cache_position(std::int32_t position) {
  const TokenVocabulary& vocab = *vocabulary_;
  const auto words = static_cast<std::size_t>(vocab.mask_words());
  allowed_.resize(allowed_.size() + words, 0);
  const std::span<std::uint32_t> allowed(allowed_.data() + allowed_.size() - words, words);

  const auto trie = vocab.trie();
  const auto trie_tokens = vocab.trie_tokens();
  StackArena arena(grammar_);
  std::vector<StackSet> sets(1);
  std::vector<std::size_t> marks(1, 0);
  // left_before[d]: some path left the element's rule before the d-th byte.
  std::vector<bool> left_before(1, false);
  sets[0].tops.push_back(arena.push(position, kContext));
  marks[0] = arena.size();

  const auto add_range = [&](std::int32_t begin, std::int32_t end, bool is_allowed, bool is_uncertain) {
    for (std::int32_t i = begin; i < end; ++i) {
      const std::int32_t id = trie_tokens[static_cast<std::size_t>(i)];
      if (is_allowed)
        set_bit(allowed, id);
      else if (is_uncertain)
        uncertain_.push_back(id);
    }
  };

  for (auto i = std::int32_t{1}; i < static_cast<std::int32_t>(trie.size());) {
    const TrieNode& node = trie[static_cast<std::size_t>(i)];
    const auto d = static_cast<std::size_t>(node.depth);
    if (sets.size() <= d) {
      sets.resize(d + 1);
      marks.resize(d + 1);
      left_before.resize(d + 1);
    }
    arena.truncate(marks[d - 1]);
    arena.advance(sets[d - 1], node.byte, sets[d]);
    marks[d] = arena.size();
    left_before[d] = left_before[d - 1] || sets[d - 1].left_context;
    const StackSet& here = sets[d];
    add_range(vocab.tokens_begin(i), vocab.tokens_begin(i + 1), !here.tops.empty() || here.left_context,
              left_before[d]);
    if (here.tops.empty()) {
      // No path continues inside the rule: longer tokens are uncertain if one left it on the way, else
      // refused.
      add_range(vocab.tokens_begin(i + 1), vocab.tokens_begin(node.subtree_end), false,
                left_before[d] || here.left_context);
      i = node.subtree_end;
    } else {
      ++i;
    }
  }
  uncertain_begin_.push_back(static_cast<std::int32_t>(uncertain_.size()));
}

std::span<const std::uint32_t> CompiledGrammar::allowed(std::int32_t position) const {
  const auto words = static_cast<std::size_t>(vocabulary_->mask_words());
  const auto entry = static_cast<std::size_t>(cache_index_[static_cast<std::size_t>(position)]);
  return {allowed_.data() + entry * words, words};
}

std::span<const std::int32_t> CompiledGrammar::uncertain(std::int32_t position) const {
  const auto entry = static_cast<std::size_t>(cache_index_[static_cast<std::size_t>(position)]);
  const auto begin = static_cast<std::size_t>(uncertain_begin_[entry]);
  const auto end = static_cast<std::size_t>(uncertain_begin_[entry + 1]);
  return {uncertain_.data() + begin, end - begin};
}

}  // namespace capserve::runtime::grammar
