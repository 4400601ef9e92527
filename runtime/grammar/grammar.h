#pragma once
// A context-free grammar over bytes, the form every structured-output format (JSON schema, regex, choice
// list) is compiled to. A rule is a list of alternatives, an alternative a sequence of elements, and an
// element a byte set or a reference to a rule. Unicode classes are spelled as alternatives of UTF-8 byte
// sequences, so a matcher never decodes text and tokens that end inside a character are handled like any
// other prefix.
//
// The finished Grammar is flat: every alternative's elements back to back, each closed by an `end` element,
// so a matcher position is one index into `elements`.
#include <bitset>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"

namespace capserve::runtime::grammar {

using ByteSet = std::bitset<256>;

struct Element {
  enum class Kind : std::uint8_t { bytes, rule, end };
  Kind kind = Kind::end;
  std::int32_t index = 0;  // bytes: into Grammar::byte_sets; rule: the rule id
};

struct Grammar {
  std::vector<Element> elements;
  std::vector<std::vector<std::int32_t>>
      alternatives;  // rule -> the position of each alternative's first element
  std::vector<ByteSet> byte_sets;
  std::vector<std::string> rule_names;  // for errors and debugging
  std::int32_t root = 0;
  // Per position, the rule it belongs to.
  std::vector<std::int32_t> rule_of;
  // Per rule, the one position where the text goes on after it, whichever place called it (a single caller,
  // or callers that all end their rules into the same continuation: a repetition's tail call to itself, a
  // list's item and separator calling each other last), else -1. A stack's frame of such a rule returns there
  // whatever the stack below, which lets the mask cache (compiled_grammar.h) look past the end of small
  // rules.
  std::vector<std::int32_t> sole_return;
};

// A closed range of Unicode code points.
struct CodepointRange {
  std::uint32_t first = 0;
  std::uint32_t last = 0;
};

// The code points of `ranges` absent from [0, U+10FFFF] (surrogates excluded), sorted; `ranges` may overlap.
std::vector<CodepointRange> complement(std::vector<CodepointRange> ranges);

// Builds a Grammar rule by rule. Helpers that need a rule (repetition, choice) create one and return a
// reference to it, so any sequence can be nested anywhere.
class GrammarBuilder {
 public:
  using Sequence = std::vector<Element>;

  std::int32_t new_rule(std::string name);
  void add_alternative(std::int32_t rule, Sequence sequence);

  Element bytes(const ByteSet& set);
  Element byte(std::uint8_t value);
  static Element ref(std::int32_t rule) { return {Element::Kind::rule, rule}; }
  Sequence literal(std::string_view text);
  // One code point of the (sorted or not) ranges, as UTF-8.
  Element codepoints(std::span<const CodepointRange> ranges);

  Element choice(std::string name, std::vector<Sequence> alternatives);
  Element optional(std::string name, Sequence sequence);
  Element star(std::string name, Sequence sequence);
  // `sequence` repeated min..max times (max < 0: unbounded); refused above kMaxRepetition copies.
  StatusOr<Element> repeat(std::string name, const Sequence& sequence, std::int64_t min, std::int64_t max);

  // The grammar rooted at `root`. Fails on a rule without alternatives or a left-recursive rule (a matcher
  // would expand it forever), naming the rule, and on a grammar past kMaxElements.
  StatusOr<Grammar> finish(std::int32_t root) &&;
  // Past kMaxElements: loops that add elements by the thousand (repetitions, bounded strings) stop early.
  [[nodiscard]] bool over_budget() const { return elements_ > kMaxElements; }
  [[nodiscard]] static Status too_large();

  static constexpr std::int64_t kMaxRepetition = 4096;
  // A client's constraint is compiled on a server thread: a grammar's size bounds its build and compile time
  // (a schema of many long bounded strings would otherwise take seconds before any other check).
  static constexpr std::int64_t kMaxElements = std::int64_t{1} << 19;

 private:
  std::vector<std::vector<Sequence>> rules_;
  std::vector<std::string> names_;
  std::vector<ByteSet> byte_sets_;
  std::int64_t elements_ = 0;  // added so far, each alternative's end included
};

}  // namespace capserve::runtime::grammar
