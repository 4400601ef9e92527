#include "runtime/grammar/stack_set.h"

#include <algorithm>

namespace capserve::runtime::grammar {

std::int32_t StackArena::push(std::int32_t position, std::int32_t parent) {
  nodes_.push_back({position, parent});
  return static_cast<std::int32_t>(nodes_.size() - 1);
}

bool StackArena::same_stack(std::int32_t a, std::int32_t b) const {
  while (a != b) {
    if (a < 0 || b < 0) return false;
    const StackNode& x = node(a);
    const StackNode& y = node(b);
    if (x.position != y.position) return false;
    a = x.parent;
    b = y.parent;
  }
  return true;
}

void StackArena::expand(std::int32_t position, std::int32_t parent, StackSet& out) {
  const auto& elements = grammar_->elements;
  const Element& element = elements[static_cast<std::size_t>(position)];
  switch (element.kind) {
    case Element::Kind::bytes: {
      for (const std::int32_t top : out.tops) {
        const StackNode& n = node(top);
        if (n.position == position && same_stack(n.parent, parent)) return;
      }
      out.tops.push_back(push(position, parent));
      return;
    }
    case Element::Kind::end:
      if (parent == kBottom) {
        out.complete = true;
      } else if (parent == kContext) {
        const std::int32_t next = grammar_->sole_return[static_cast<std::size_t>(
            grammar_->rule_of[static_cast<std::size_t>(position)])];
        if (next >= 0) {
          expand(next, kContext, out);
        } else {
          out.left_context = true;
        }
      } else {
        const StackNode up = node(parent);
        expand(up.position, up.parent, out);
      }
      return;
    case Element::Kind::rule: {
      const std::int32_t next = position + 1;
      const bool tail_call = elements[static_cast<std::size_t>(next)].kind == Element::Kind::end;
      const std::int32_t return_to = tail_call ? parent : push(next, parent);
      for (const std::int32_t start : grammar_->alternatives[static_cast<std::size_t>(element.index)]) {
        expand(start, return_to, out);
      }
      return;
    }
  }
}

void StackArena::advance(const StackSet& in, std::uint8_t byte, StackSet& out) {
  out.clear();
  for (const std::int32_t top : in.tops) {
    const StackNode n = node(top);
    const Element& element = grammar_->elements[static_cast<std::size_t>(n.position)];
    if (grammar_->byte_sets[static_cast<std::size_t>(element.index)].test(byte)) {
      expand(n.position + 1, n.parent, out);
    }
  }
}

}  // namespace capserve::runtime::grammar
