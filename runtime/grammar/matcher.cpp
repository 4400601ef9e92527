#include "runtime/grammar/matcher.h"

#include <algorithm>
#include <string>
#include <utility>

namespace capserve::runtime::grammar {

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)), arena_(grammar_->grammar()) {
  const Grammar& g = grammar_->grammar();
  StackSet start;
  for (const std::int32_t alternative : g.alternatives[static_cast<std::size_t>(g.root)]) {
    arena_.expand(alternative, kBottom, start);
  }
  tops_ = start.tops;
  states_.push_back({0, tops_.size(), arena_.size(), start.complete, false});
}

bool GrammarMatcher::accept_token(std::int32_t id) {
  const State current = states_.back();
  const TokenVocabulary& vocab = grammar_->vocabulary();
  if (current.terminated || id < 0 || id >= vocab.size()) return false;
  if (vocab.is_stop(id)) {
    if (!current.complete) return false;
    states_.push_back({tops_.size(), tops_.size(), arena_.size(), true, true});
    return true;
  }
  const auto& bytes = vocab.bytes(id);
  if (!bytes || bytes->empty()) return false;
  scratch_a_.clear();
  scratch_a_.tops.assign(tops_.begin() + static_cast<std::ptrdiff_t>(current.tops_begin),
                         tops_.begin() + static_cast<std::ptrdiff_t>(current.tops_end));
  const StackSet* end = walk(*bytes);
  if (end == nullptr) {
    arena_.truncate(current.arena_size);
    return false;
  }
  const std::size_t begin = tops_.size();
  tops_.insert(tops_.end(), end->tops.begin(), end->tops.end());
  states_.push_back({begin, tops_.size(), arena_.size(), end->complete, false});
  return true;
}

const StackSet* GrammarMatcher::walk(std::string_view bytes) {
  StackSet* in = &scratch_a_;
  StackSet* out = &scratch_b_;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    arena_.advance(*in, static_cast<std::uint8_t>(bytes[i]), *out);
    std::swap(in, out);
    // A complete parse with bytes left over is no parse.
    if (in->tops.empty() && (!in->complete || i + 1 < bytes.size())) return nullptr;
  }
  return in;
}

bool GrammarMatcher::stack_accepts(std::int32_t top, std::string_view bytes) {
  const std::size_t mark = arena_.size();
  scratch_a_.clear();
  scratch_a_.tops.push_back(top);
  const bool ok = walk(bytes) != nullptr;
  arena_.truncate(mark);
  return ok;
}

Status GrammarMatcher::fill_next_token_bitmask(std::span<std::int32_t> words) {
  const TokenVocabulary& vocab = grammar_->vocabulary();
  if (words.size() < static_cast<std::size_t>(vocab.mask_words())) {
    return Status::invalid_argument("token bitmask has " + std::to_string(words.size()) +
                                    " words, the vocabulary needs " + std::to_string(vocab.mask_words()));
  }
  std::fill(words.begin(), words.end(), 0);
  const State& current = states_.back();
  if (current.terminated) return {};
  const auto set = [&](std::int32_t id) {
    words[static_cast<std::size_t>(id) / 32] |=
        static_cast<std::int32_t>(1U << (static_cast<unsigned>(id) % 32));
  };
  for (std::size_t t = current.tops_begin; t < current.tops_end; ++t) {
    const std::int32_t top = tops_[t];
    const std::int32_t position = arena_.node(top).position;
    const auto allowed = grammar_->allowed(position);
    for (std::size_t w = 0; w < allowed.size(); ++w) words[w] |= static_cast<std::int32_t>(allowed[w]);
    for (const std::int32_t id : grammar_->uncertain(position)) {
      const bool already = (static_cast<std::uint32_t>(words[static_cast<std::size_t>(id) / 32]) >>
                            (static_cast<unsigned>(id) % 32)) &
                           1U;
      if (!already && stack_accepts(top, *vocab.bytes(id))) set(id);
    }
  }
  if (current.complete) {
    for (const std::int32_t id : vocab.stop_tokens()) set(id);
  }
  return {};
}

Status GrammarMatcher::rollback(std::int32_t tokens) {
  if (tokens < 0 || tokens > accepted_tokens()) {
    return Status::invalid_argument("cannot roll back " + std::to_string(tokens) + " tokens of " +
                                    std::to_string(accepted_tokens()));
  }
  states_.resize(states_.size() - static_cast<std::size_t>(tokens));
  tops_.resize(states_.back().tops_end);
  arena_.truncate(states_.back().arena_size);
  return {};
}

}  // namespace capserve::runtime::grammar
