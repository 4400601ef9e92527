#pragma once
// One sequence's position in a compiled grammar: which tokens may come next (a bitmask over the vocabulary,
// xgrammar's layout: bit id % 32 of word id / 32 set = allowed), and the tokens the sequence took. Once the
// grammar is complete only a stop token remains allowed (alongside any continuation the grammar still has);
// accepting it terminates the matcher.
//
// Not thread-safe; one matcher per sequence. The CompiledGrammar it holds is shared.
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "runtime/grammar/compiled_grammar.h"
#include "runtime/grammar/stack_set.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Takes the token and returns true, or returns false and leaves the matcher as it was.
  bool accept_token(std::int32_t id);
  // Writes the next token's mask into `words` (at least vocabulary().mask_words() of them; words beyond are
  // zeroed: ids past the tokenizer's vocabulary, e.g. an lm_head padded to a multiple of 64, are never
  // allowed).
  Status fill_next_token_bitmask(std::span<std::int32_t> words);
  // A stop token was accepted.
  [[nodiscard]] bool is_terminated() const { return states_.back().terminated; }
  // The text so far is a complete sentence of the grammar (a stop token is allowed).
  [[nodiscard]] bool can_terminate() const { return states_.back().complete; }
  // Undoes the last `tokens` accepted tokens (speculative decoding's rejected drafts).
  Status rollback(std::int32_t tokens);
  [[nodiscard]] std::int32_t accepted_tokens() const { return static_cast<std::int32_t>(states_.size()) - 1; }

 private:
  struct State {
    std::size_t tops_begin = 0;  // into tops_
    std::size_t tops_end = 0;
    std::size_t arena_size = 0;
    bool complete = false;
    bool terminated = false;
  };
  // Whether `bytes` can follow the stack whose top is `top`.
  bool stack_accepts(std::int32_t top, std::string_view bytes);
  // Advances scratch_a_ (the start) over `bytes`: the stacks left, or nullptr when none is.
  const StackSet* walk(std::string_view bytes);

  std::shared_ptr<const CompiledGrammar> grammar_;
  StackArena arena_;
  std::vector<State> states_;       // the start state, then one per accepted token
  std::vector<std::int32_t> tops_;  // every state's stack tops, back to back
  StackSet scratch_a_;
  StackSet scratch_b_;
};

}  // namespace capserve::runtime::grammar
