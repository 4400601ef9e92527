#include "runtime/grammar/grammar.h"

#include <algorithm>
#include <array>
#include <functional>
#include <utility>

namespace capserve::runtime::grammar {
namespace {

constexpr std::uint32_t kMaxCodepoint = 0x10FFFF;
constexpr std::uint32_t kSurrogateFirst = 0xD800;
constexpr std::uint32_t kSurrogateLast = 0xDFFF;

int utf8_length(std::uint32_t cp) {
  return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
}

std::array<std::uint8_t, 4> utf8_bytes(std::uint32_t cp) {
  switch (utf8_length(cp)) {
    case 1:
      return {static_cast<std::uint8_t>(cp), 0, 0, 0};
    case 2:
      return {static_cast<std::uint8_t>(0xC0 | (cp >> 6)), static_cast<std::uint8_t>(0x80 | (cp & 0x3F)), 0,
              0};
    case 3:
      return {static_cast<std::uint8_t>(0xE0 | (cp >> 12)),
              static_cast<std::uint8_t>(0x80 | ((cp >> 6) & 0x3F)),
              static_cast<std::uint8_t>(0x80 | (cp & 0x3F)), 0};
    default:
      return {static_cast<std::uint8_t>(0xF0 | (cp >> 18)),
              static_cast<std::uint8_t>(0x80 | ((cp >> 12) & 0x3F)),
              static_cast<std::uint8_t>(0x80 | ((cp >> 6) & 0x3F)),
              static_cast<std::uint8_t>(0x80 | (cp & 0x3F))};
  }
}

// Splits [first, last] (one encoded length, no surrogates) until each piece is a product of per-byte ranges,
// then hands each piece's byte ranges to `emit` (the UTF-8 range construction of RE2 and Rust's regex).
void utf8_pieces(std::uint32_t first, std::uint32_t last,
                 const std::function<void(std::span<const std::pair<std::uint8_t, std::uint8_t>>)>& emit) {
  const int length = utf8_length(first);
  if (length != utf8_length(last)) {
    const std::uint32_t boundary = length == 1 ? 0x7F : length == 2 ? 0x7FF : 0xFFFF;
    utf8_pieces(first, boundary, emit);
    utf8_pieces(boundary + 1, last, emit);
    return;
  }
  for (int i = 1; i < length; ++i) {
    const std::uint32_t mask = (1U << (6 * i)) - 1;
    if ((first & ~mask) != (last & ~mask)) {
      if ((first & mask) != 0) {
        utf8_pieces(first, first | mask, emit);
        utf8_pieces((first | mask) + 1, last, emit);
        return;
      }
      if ((last & mask) != mask) {
        utf8_pieces(first, (last & ~mask) - 1, emit);
        utf8_pieces(last & ~mask, last, emit);
        return;
      }
    }
  }
  const auto lo = utf8_bytes(first);
  const auto hi = utf8_bytes(last);
  std::array<std::pair<std::uint8_t, std::uint8_t>, 4> ranges{};
  for (int i = 0; i < length; ++i) ranges[i] = {lo[i], hi[i]};
  emit(std::span(ranges.data(), static_cast<std::size_t>(length)));
}

std::vector<CodepointRange> normalized(std::vector<CodepointRange> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](auto a, auto b) { return a.first < b.first; });
  std::vector<CodepointRange> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().last + 1) {
      merged.back().last = std::max(merged.back().last, r.last);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

void set_sole_returns(Grammar& grammar) {
  const auto& elements = grammar.elements;
  const std::size_t rules = grammar.alternatives.size();
  grammar.rule_of.assign(elements.size(), 0);
  for (std::size_t r = 0; r < rules; ++r) {
    for (const std::int32_t start : grammar.alternatives[r]) {
      for (auto p = static_cast<std::size_t>(start);; ++p) {
        grammar.rule_of[p] = static_cast<std::int32_t>(r);
        if (elements[p].kind == Element::Kind::end) break;
      }
    }
  }
  // Only rules the root reaches. Among those, following continuations never goes round: a continuation is a
  // position just after the one call of a rule, so a ring of rules each continuing in the next would have no
  // caller outside the ring, and the root (continuing nowhere) would not reach it.
  std::vector<bool> reachable(rules, false);
  std::vector<std::int32_t> pending{grammar.root};
  reachable[static_cast<std::size_t>(grammar.root)] = true;
  while (!pending.empty()) {
    const auto r = static_cast<std::size_t>(pending.back());
    pending.pop_back();
    for (const std::int32_t start : grammar.alternatives[r]) {
      for (auto p = static_cast<std::size_t>(start); elements[p].kind != Element::Kind::end; ++p) {
        const auto callee = static_cast<std::size_t>(elements[p].index);
        if (elements[p].kind == Element::Kind::rule && !reachable[callee]) {
          reachable[callee] = true;
          pending.push_back(elements[p].index);
        }
      }
    }
  }
  // Where each rule's text goes on: the positions after its call sites, where a call site ends its
  // alternative (a tail call) the continuation of the rule it ends instead. A fixpoint over the lattice
  // none < one position < many, so that rules calling one another last (a list's item and its separator)
  // share one continuation.
  constexpr std::int32_t kNone = -2;
  constexpr std::int32_t kMany = -1;
  std::vector<std::int32_t> continuation(rules, kNone);
  continuation[static_cast<std::size_t>(grammar.root)] =
      kMany;  // the matcher's start: complete, not a position
  const auto join = [&](std::int32_t& into, std::int32_t value) {
    if (value == kNone || into == kMany || into == value) return false;
    into = into == kNone ? value : kMany;
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t p = 0; p < elements.size(); ++p) {
      if (elements[p].kind != Element::Kind::rule || !reachable[static_cast<std::size_t>(grammar.rule_of[p])])
        continue;
      const auto callee = static_cast<std::size_t>(elements[p].index);
      const bool tail_call = elements[p + 1].kind == Element::Kind::end;
      const std::int32_t value = tail_call ? continuation[static_cast<std::size_t>(grammar.rule_of[p])]
                                           : static_cast<std::int32_t>(p + 1);
      changed = join(continuation[callee], value) || changed;
    }
  }
  grammar.sole_return.assign(rules, -1);
  for (std::size_t r = 0; r < rules; ++r) {
    if (reachable[r] && continuation[r] >= 0) grammar.sole_return[r] = continuation[r];
  }
}

}  // namespace

std::vector<CodepointRange> complement(std::vector<CodepointRange> ranges) {
  ranges.push_back({kSurrogateFirst, kSurrogateLast});
  std::vector<CodepointRange> out;
  std::uint32_t next = 0;
  for (const auto& r : normalized(std::move(ranges))) {
    if (r.first > next) out.push_back({next, r.first - 1});
    next = std::max(next, r.last + 1);
  }
  if (next <= kMaxCodepoint) out.push_back({next, kMaxCodepoint});
  return out;
}

std::int32_t GrammarBuilder::new_rule(std::string name) {
  rules_.emplace_back();
  names_.push_back(std::move(name));
  return static_cast<std::int32_t>(rules_.size() - 1);
}

void GrammarBuilder::add_alternative(std::int32_t rule, Sequence sequence) {
  elements_ += static_cast<std::int64_t>(sequence.size()) + 1;
  rules_[static_cast<std::size_t>(rule)].push_back(std::move(sequence));
}

Status GrammarBuilder::too_large() {
  return Status::invalid_argument("the constraint is too large: more than " + std::to_string(kMaxElements) +
                                  " grammar elements");
}

Element GrammarBuilder::bytes(const ByteSet& set) {
  const auto found = std::find(byte_sets_.begin(), byte_sets_.end(), set);
  if (found != byte_sets_.end())
    return {Element::Kind::bytes, static_cast<std::int32_t>(found - byte_sets_.begin())};
  byte_sets_.push_back(set);
  return {Element::Kind::bytes, static_cast<std::int32_t>(byte_sets_.size() - 1)};
}

Element GrammarBuilder::byte(std::uint8_t value) {
  ByteSet set;
  set.set(value);
  return bytes(set);
}

GrammarBuilder::Sequence GrammarBuilder::literal(std::string_view text) {
  Sequence out;
  out.reserve(text.size());
  for (const char c : text) out.push_back(byte(static_cast<std::uint8_t>(c)));
  return out;
}

Element GrammarBuilder::codepoints(std::span<const CodepointRange> ranges) {
  // Surrogates are not characters: drop them from the ranges.
  std::vector<CodepointRange> valid;
  for (const auto& r : normalized({ranges.begin(), ranges.end()})) {
    const std::uint32_t last = std::min(r.last, kMaxCodepoint);
    if (r.first > last) continue;
    if (r.first < kSurrogateFirst && last >= kSurrogateFirst) {
      valid.push_back({r.first, kSurrogateFirst - 1});
      if (last > kSurrogateLast) valid.push_back({kSurrogateLast + 1, last});
    } else if (r.first >= kSurrogateFirst && r.first <= kSurrogateLast) {
      if (last > kSurrogateLast) valid.push_back({kSurrogateLast + 1, last});
    } else {
      valid.push_back({r.first, last});
    }
  }
  std::vector<Sequence> alternatives;
  ByteSet ascii;
  for (const auto& r : valid) {
    utf8_pieces(r.first, r.last, [&](std::span<const std::pair<std::uint8_t, std::uint8_t>> pieces) {
      if (pieces.size() == 1) {
        for (int b = pieces[0].first; b <= pieces[0].second; ++b) ascii.set(static_cast<std::size_t>(b));
        return;
      }
      Sequence sequence;
      for (const auto& [lo, hi] : pieces) {
        ByteSet set;
        for (int b = lo; b <= hi; ++b) set.set(static_cast<std::size_t>(b));
        sequence.push_back(bytes(set));
      }
      alternatives.push_back(std::move(sequence));
    });
  }
  if (ascii.any()) alternatives.insert(alternatives.begin(), Sequence{bytes(ascii)});
  if (alternatives.size() == 1 && alternatives[0].size() == 1) return alternatives[0][0];
  return choice("char", std::move(alternatives));
}

Element GrammarBuilder::choice(std::string name, std::vector<Sequence> alternatives) {
  const std::int32_t rule = new_rule(std::move(name));
  for (auto& alternative : alternatives) add_alternative(rule, std::move(alternative));
  return ref(rule);
}

Element GrammarBuilder::optional(std::string name, Sequence sequence) {
  return choice(std::move(name), {std::move(sequence), {}});
}

Element GrammarBuilder::star(std::string name, Sequence sequence) {
  // Right recursion: the recursive reference is the alternative's last element, so a matcher tail-calls it
  // and its stack does not grow with the repetitions.
  const std::int32_t rule = new_rule(std::move(name));
  sequence.push_back(ref(rule));
  add_alternative(rule, std::move(sequence));
  add_alternative(rule, {});
  return ref(rule);
}

StatusOr<Element> GrammarBuilder::repeat(std::string name, const Sequence& sequence, std::int64_t min,
                                         std::int64_t max) {
  if (min < 0 || (max >= 0 && max < min)) return Status::invalid_argument("invalid repetition bounds");
  if (min > kMaxRepetition || max > kMaxRepetition) {
    return Status::invalid_argument("repetition count above " + std::to_string(kMaxRepetition));
  }
  // Copies share one rule rather than the rules inside the sequence, which keeps those single-caller.
  const Sequence one = sequence.size() == 1 ? sequence : Sequence{choice(name + "_item", {sequence})};
  // The optional copies nest (x (x (x)?)?)? so that each count has one parse.
  Element tail;
  if (max < 0) {
    tail = star(name + "_star", one);
  } else {
    const std::int32_t none = new_rule(name + "_end");
    add_alternative(none, {});
    tail = ref(none);
    for (std::int64_t i = min; i < max; ++i) {
      if (over_budget()) return too_large();
      Sequence more = one;
      more.push_back(tail);
      tail = optional(name + "_opt", std::move(more));
    }
  }
  Sequence all;
  for (std::int64_t i = 0; i < min; ++i) all.insert(all.end(), one.begin(), one.end());
  all.push_back(tail);
  return choice(std::move(name), {std::move(all)});
}

StatusOr<Grammar> GrammarBuilder::finish(std::int32_t root) && {
  if (over_budget()) return too_large();
  const std::size_t n = rules_.size();
  for (std::size_t r = 0; r < n; ++r) {
    if (rules_[r].empty())
      return Status::invalid_argument("grammar rule '" + names_[r] + "' has no alternatives");
  }
  // Nullable rules (fixpoint), then the rules each rule can start with without consuming a byte: a cycle
  // among those is left recursion.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const auto& alternative : rules_[r]) {
        const bool empty = std::all_of(alternative.begin(), alternative.end(), [&](const Element& e) {
          return e.kind == Element::Kind::rule && nullable[static_cast<std::size_t>(e.index)];
        });
        if (empty) {
          nullable[r] = true;
          changed = true;
          break;
        }
      }
    }
  }
  std::vector<std::vector<std::int32_t>> starts(n);
  for (std::size_t r = 0; r < n; ++r) {
    for (const auto& alternative : rules_[r]) {
      for (const auto& e : alternative) {
        if (e.kind != Element::Kind::rule) break;
        starts[r].push_back(e.index);
        if (!nullable[static_cast<std::size_t>(e.index)]) break;
      }
    }
  }
  std::vector<int> color(n, 0);  // 0 unvisited, 1 on the path, 2 done
  std::function<bool(std::size_t)> cyclic = [&](std::size_t r) {
    color[r] = 1;
    for (const auto next : starts[r]) {
      const auto s = static_cast<std::size_t>(next);
      if (color[s] == 1 || (color[s] == 0 && cyclic(s))) return true;
    }
    color[r] = 2;
    return false;
  };
  for (std::size_t r = 0; r < n; ++r) {
    if (color[r] == 0 && cyclic(r))
      return Status::invalid_argument("grammar rule '" + names_[r] + "' is left-recursive");
  }

  Grammar grammar;
  grammar.root = root;
  grammar.byte_sets = std::move(byte_sets_);
  grammar.rule_names = std::move(names_);
  grammar.alternatives.resize(n);
  for (std::size_t r = 0; r < n; ++r) {
    for (const auto& alternative : rules_[r]) {
      grammar.alternatives[r].push_back(static_cast<std::int32_t>(grammar.elements.size()));
      grammar.elements.insert(grammar.elements.end(), alternative.begin(), alternative.end());
      grammar.elements.push_back({Element::Kind::end, 0});
    }
  }
  set_sole_returns(grammar);
  return grammar;
}

}  // namespace capserve::runtime::grammar
