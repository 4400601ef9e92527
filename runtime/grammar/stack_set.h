#pragma once
// The nondeterministic pushdown automaton of a Grammar. A parse stack is a chain of nodes in an arena, the
// top node's position being the bytes element to match next and each node below it the position to return to.
// A state is the set of stacks that the bytes so far can leave (several where the grammar is ambiguous at
// that point). Reductions are eager: a rule reference that ends its alternative is a tail call, so
// right-recursive repetitions keep the stack flat.
//
// The arena only grows; callers that explore (a mask walk) truncate it back to a mark when they are done.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/grammar/grammar.h"

namespace capserve::runtime::grammar {

struct StackNode {
  std::int32_t position = 0;  // into Grammar::elements
  std::int32_t parent = 0;    // a node, or kBottom / kContext
};

// Below every stack of a matcher: popping it means the grammar's text is complete.
inline constexpr std::int32_t kBottom = -1;
// Below the one-frame stacks a compiled grammar explores alone: popping it means the text goes on in whatever
// context encloses that frame, unknown then.
inline constexpr std::int32_t kContext = -2;

struct StackSet {
  std::vector<std::int32_t> tops;  // nodes at a bytes element
  bool complete = false;           // a stack popped kBottom
  bool left_context = false;       // a stack popped kContext
  void clear() {
    tops.clear();
    complete = false;
    left_context = false;
  }
  [[nodiscard]] bool empty() const { return tops.empty() && !complete && !left_context; }
};

class StackArena {
 public:
  explicit StackArena(const Grammar& grammar) : grammar_(&grammar) {}

  // The stacks that start at `position` above `parent` (adds them to `out`).
  void expand(std::int32_t position, std::int32_t parent, StackSet& out);
  // The stacks `in` leaves after `byte` (clears `out` first).
  void advance(const StackSet& in, std::uint8_t byte, StackSet& out);

  [[nodiscard]] const StackNode& node(std::int32_t id) const { return nodes_[static_cast<std::size_t>(id)]; }
  [[nodiscard]] std::size_t size() const { return nodes_.size(); }
  void truncate(std::size_t size) { nodes_.resize(size); }
  void reserve(std::size_t size) { nodes_.reserve(size); }
  std::int32_t push(std::int32_t position, std::int32_t parent);

 private:
  [[nodiscard]] bool same_stack(std::int32_t a, std::int32_t b) const;

  const Grammar* grammar_;
  std::vector<StackNode> nodes_;
};

}  // namespace capserve::runtime::grammar
