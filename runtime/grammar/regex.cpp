#include "runtime/grammar/regex.h"

#include <string>
#include <utility>
#include <vector>

namespace capserve::runtime::grammar {
namespace {

using Sequence = GrammarBuilder::Sequence;
using Ranges = std::vector<CodepointRange>;

class RegexParser {
 public:
  RegexParser(std::string_view pattern, RegexText text, GrammarBuilder& builder)
      : pattern_(pattern), text_(text), builder_(builder) {}

  StatusOr<Sequence> parse() {
    if (pattern_.starts_with('^')) pos_ = 1;
    auto sequence = alternation();
    if (!error_.ok()) return std::move(error_);
    if (pos_ < pattern_.size()) fail("unbalanced ')'");
    if (!error_.ok()) return std::move(error_);
    return sequence;
  }

 private:
  // Keeps the first error; parsing unwinds on error_.
  void fail(const std::string& what) {
    if (error_.ok()) {
      error_ = Status::invalid_argument("regex " + std::string(pattern_) + ": " + what + " at offset " +
                                        std::to_string(pos_));
    }
  }
  [[nodiscard]] bool at_end() const { return pos_ >= pattern_.size(); }
  [[nodiscard]] char peek() const { return pattern_[pos_]; }

  Sequence alternation() {
    std::vector<Sequence> branches{concatenation()};
    while (error_.ok() && !at_end() && peek() == '|') {
      ++pos_;
      branches.push_back(concatenation());
    }
    if (branches.size() == 1) return std::move(branches[0]);
    return {builder_.choice("regex_alt", std::move(branches))};
  }

  Sequence concatenation() {
    Sequence out;
    while (error_.ok() && !at_end() && peek() != '|' && peek() != ')') {
      if (peek() == '$' && pos_ + 1 == pattern_.size()) {
        ++pos_;
        break;
      }
      Sequence piece = atom();
      if (!error_.ok()) break;
      piece = quantified(std::move(piece));
      out.insert(out.end(), piece.begin(), piece.end());
    }
    return out;
  }

  Sequence quantified(Sequence piece) {
    while (error_.ok() && !at_end()) {
      std::int64_t min = 0;
      std::int64_t max = -1;
      const char c = peek();
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        min = 1;
        ++pos_;
      } else if (c == '?') {
        max = 1;
        ++pos_;
      } else if (c == '{' && counted(min, max)) {
      } else {
        break;
      }
      if (!at_end() && peek() == '?') ++pos_;  // lazy: the same texts
      if (!at_end() && peek() == '+') {
        fail("possessive quantifier");
        return {};
      }
      auto repeated = builder_.repeat("regex_repeat", piece, min, max);
      if (!repeated.ok()) {
        fail(repeated.status().message());
        return {};
      }
      piece = {*repeated};
    }
    return piece;
  }

  // {n}, {n,}, {n,m}; a '{' that starts none of them is a literal, as in Python's re.
  bool counted(std::int64_t& min, std::int64_t& max) {
    std::size_t p = pos_ + 1;
    const auto number = [&](std::int64_t& value) {
      const std::size_t start = p;
      value = 0;
      while (p < pattern_.size() && pattern_[p] >= '0' && pattern_[p] <= '9' && value < (1 << 30)) {
        value = value * 10 + (pattern_[p++] - '0');
      }
      return p > start;
    };
    if (!number(min)) return false;
    max = min;
    if (p < pattern_.size() && pattern_[p] == ',') {
      ++p;
      if (!number(max)) max = -1;
    }
    if (p >= pattern_.size() || pattern_[p] != '}') return false;
    pos_ = p + 1;
    return true;
  }

  Sequence atom() {
    const char c = peek();
    if (c == '(') return group();
    if (c == '[') return {chars(char_class())};
    if (c == '.') {
      ++pos_;
      return {chars(complement({{'\n', '\n'}}))};
    }
    if (c == '\\') return {chars(escape(false))};
    if (c == '^' || c == '$') {
      fail("anchor inside the pattern");
      return {};
    }
    if (c == '*' || c == '+' || c == '?') {
      fail("quantifier without an operand");
      return {};
    }
    const std::uint32_t cp = codepoint();
    return {chars({{cp, cp}})};
  }

  Sequence group() {
    ++pos_;
    if (pattern_.substr(pos_).starts_with("?:")) {
      pos_ += 2;
    } else if (pattern_.substr(pos_).starts_with("?P<") || pattern_.substr(pos_).starts_with("?<")) {
      const std::size_t close = pattern_.find('>', pos_);
      const char after = pattern_[pos_ + (pattern_[pos_ + 1] == 'P' ? 3 : 2)];
      if (after == '=' || after == '!') {
        fail("lookbehind");
        return {};
      }
      if (close == std::string_view::npos) {
        fail("unterminated group name");
        return {};
      }
      pos_ = close + 1;
    } else if (!at_end() && peek() == '?') {
      fail(pattern_.substr(pos_).starts_with("?=") || pattern_.substr(pos_).starts_with("?!")
               ? "lookahead"
               : "group flags");
      return {};
    }
    Sequence inside = alternation();
    if (!error_.ok()) return {};
    if (at_end() || peek() != ')') {
      fail("unterminated group");
      return {};
    }
    ++pos_;
    // A group is one element, so that a quantifier after it repeats all of it.
    return {builder_.choice("regex_group", {std::move(inside)})};
  }

  // One UTF-8 encoded code point of the pattern.
  std::uint32_t codepoint() {
    const auto lead = static_cast<unsigned char>(pattern_[pos_++]);
    const int extra = lead < 0x80 ? 0 : lead < 0xE0 ? 1 : lead < 0xF0 ? 2 : 3;
    std::uint32_t cp = extra == 0 ? lead : lead & (0x3FU >> extra);
    for (int i = 0; i < extra && !at_end(); ++i)
      cp = (cp << 6) | (static_cast<unsigned char>(pattern_[pos_++]) & 0x3FU);
    return cp;
  }

  std::uint32_t hex(int digits) {
    std::uint32_t value = 0;
    for (int i = 0; i < digits; ++i) {
      if (at_end()) {
        fail("truncated hex escape");
        return 0;
      }
      const char c = pattern_[pos_++];
      value *= 16;
      if (c >= '0' && c <= '9')
        value += static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        value += static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        value += static_cast<std::uint32_t>(c - 'A' + 10);
      else
        fail("bad hex escape");
    }
    return value;
  }

  // After a backslash: the class it names. `in_class`: inside [...], where \b is a backspace.
  Ranges escape(bool in_class) {
    ++pos_;
    if (at_end()) {
      fail("trailing backslash");
      return {};
    }
    const char c = pattern_[pos_];
    static const Ranges digit{{'0', '9'}};
    static const Ranges word{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
    static const Ranges space{{'\t', '\r'}, {' ', ' '}};
    const auto single = [](std::uint32_t cp) { return Ranges{{cp, cp}}; };
    switch (c) {
      case 'd':
        ++pos_;
        return digit;
      case 'D':
        ++pos_;
        return complement(digit);
      case 'w':
        ++pos_;
        return word;
      case 'W':
        ++pos_;
        return complement(word);
      case 's':
        ++pos_;
        return space;
      case 'S':
        ++pos_;
        return complement(space);
      case 'n':
        ++pos_;
        return single('\n');
      case 't':
        ++pos_;
        return single('\t');
      case 'r':
        ++pos_;
        return single('\r');
      case 'f':
        ++pos_;
        return single('\f');
      case 'v':
        ++pos_;
        return single('\v');
      case 'x':
        ++pos_;
        return single(hex(2));
      case 'u':
        ++pos_;
        return single(hex(4));
      default:
        break;
    }
    if (c == 'b' && in_class) {
      ++pos_;
      return single('\b');
    }
    if ((c >= '0' && c <= '9') || c == 'b' || c == 'B' || c == 'A' || c == 'Z' || c == 'z' || c == 'k') {
      fail(std::string("unsupported escape \\") + c);
      return {};
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      fail(std::string("unknown escape \\") + c);
      return {};
    }
    return single(codepoint());
  }

  // A class member: an escape or one literal code point.
  Ranges class_atom() {
    if (peek() == '\\') return escape(true);
    const std::uint32_t cp = codepoint();
    return {{cp, cp}};
  }

  Ranges char_class() {
    ++pos_;
    bool negated = false;
    if (!at_end() && peek() == '^') {
      negated = true;
      ++pos_;
    }
    Ranges ranges;
    bool first = true;
    while (error_.ok()) {
      if (at_end()) {
        fail("unterminated character class");
        return {};
      }
      if (peek() == ']' && !first) break;
      first = false;
      Ranges item = class_atom();
      const bool is_single = item.size() == 1 && item[0].first == item[0].last;
      if (is_single && pos_ + 1 < pattern_.size() && peek() == '-' && pattern_[pos_ + 1] != ']') {
        ++pos_;
        const Ranges upper = class_atom();
        if (upper.size() != 1 || upper[0].first != upper[0].last || upper[0].first < item[0].first) {
          fail("bad character range");
          return {};
        }
        item[0].last = upper[0].first;
      }
      ranges.insert(ranges.end(), item.begin(), item.end());
    }
    ++pos_;
    return negated ? complement(std::move(ranges)) : ranges;
  }

  Element chars(Ranges ranges) {
    if (text_ == RegexText::json_string) {
      Ranges allowed;
      for (const auto& r : complement({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}})) allowed.push_back(r);
      // intersection: complement of (complement(ranges) U complement(allowed))
      Ranges outside = complement(std::move(ranges));
      Ranges forbidden = complement(std::move(allowed));
      outside.insert(outside.end(), forbidden.begin(), forbidden.end());
      ranges = complement(std::move(outside));
    }
    if (ranges.empty()) {
      fail("character class that matches nothing");
      return {};
    }
    return builder_.codepoints(ranges);
  }

  std::string_view pattern_;
  RegexText text_;
  GrammarBuilder& builder_;
  std::size_t pos_ = 0;
  Status error_;
};

}  // namespace

StatusOr<GrammarBuilder::Sequence> regex_sequence(std::string_view pattern, RegexText text,
                                                  GrammarBuilder& builder) {
  return RegexParser(pattern, text, builder).parse();
}

}  // namespace capserve::runtime::grammar
