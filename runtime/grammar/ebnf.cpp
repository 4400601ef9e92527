#include "runtime/grammar/ebnf.h"

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/grammar/regex.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime::grammar {
namespace {

using Sequence = GrammarBuilder::Sequence;

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
         c == '.';
}

class EbnfParser {
 public:
  explicit EbnfParser(std::string_view text) : text_(text) {}

  StatusOr<Grammar> parse() {
    skip_space(true);
    while (ok() && !at_end()) {
      rule();
      skip_space(true);
    }
    if (!ok()) return std::move(error_);
    for (const auto& [name, id] : rules_) {
      if (!defined_.contains(name))
        return Status::invalid_argument("EBNF grammar: rule '" + name + "' is not defined");
    }
    const auto root = rules_.find("root");
    if (root == rules_.end()) return Status::invalid_argument("EBNF grammar: no rule named root");
    auto grammar = std::move(builder_).finish(root->second);
    if (!grammar.ok()) return Status::invalid_argument("EBNF grammar: " + grammar.status().message());
    return grammar;
  }

 private:
  [[nodiscard]] bool ok() const { return error_.ok(); }
  [[nodiscard]] bool at_end() const { return pos_ >= text_.size(); }
  void fail(const std::string& what) {
    if (ok())
      error_ = Status::invalid_argument("EBNF grammar: " + what + " at offset " + std::to_string(pos_));
  }

  // Spaces and comments; newlines too where `newlines` (between rules, and inside one after an operator).
  void skip_space(bool newlines) {
    while (!at_end()) {
      const char c = text_[pos_];
      if (c == '#') {
        while (!at_end() && text_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }
  // A rule's body goes on over a newline only when the next line does not start a new rule.
  void skip_space_in_rule() {
    const std::size_t save = pos_;
    skip_space(true);
    std::size_t p = pos_;
    while (p < text_.size() && is_name_char(text_[p])) ++p;
    std::size_t q = p;
    while (q < text_.size() && (text_[q] == ' ' || text_[q] == '\t')) ++q;
    if (p > pos_ && text_.substr(q).starts_with("::=") &&
        text_.substr(save, pos_ - save).find('\n') != std::string_view::npos) {
      pos_ = save;
      skip_space(false);
    }
  }

  std::string name() {
    const std::size_t start = pos_;
    while (!at_end() && is_name_char(text_[pos_])) ++pos_;
    if (pos_ == start) fail("expected a rule name");
    return std::string(text_.substr(start, pos_ - start));
  }

  std::int32_t rule_id(const std::string& name) {
    const auto [it, added] = rules_.emplace(name, 0);
    if (added) it->second = builder_.new_rule(name);
    return it->second;
  }

  void rule() {
    const std::string n = name();
    if (!ok()) return;
    skip_space(false);
    if (!text_.substr(pos_).starts_with("::=")) return fail("expected ::= after '" + n + "'");
    pos_ += 3;
    if (!defined_.insert(n).second) return fail("rule '" + n + "' defined twice");
    const std::int32_t id = rule_id(n);
    for (auto& alternative : alternatives()) builder_.add_alternative(id, std::move(alternative));
  }

  std::vector<Sequence> alternatives() {
    std::vector<Sequence> out{sequence()};
    while (ok() && !at_end() && text_[pos_] == '|') {
      ++pos_;
      out.push_back(sequence());
    }
    return out;
  }

  Sequence sequence() {
    Sequence out;
    while (ok()) {
      skip_space_in_rule();
      if (at_end()) break;
      const char c = text_[pos_];
      if (c == '|' || c == ')' || (c == '\n')) break;
      if (is_name_char(c) && starts_rule_definition()) break;
      Sequence item = element();
      if (!ok()) break;
      item = quantified(std::move(item));
      out.insert(out.end(), item.begin(), item.end());
    }
    return out;
  }

  [[nodiscard]] bool starts_rule_definition() const {
    std::size_t p = pos_;
    while (p < text_.size() && is_name_char(text_[p])) ++p;
    while (p < text_.size() && (text_[p] == ' ' || text_[p] == '\t')) ++p;
    return text_.substr(p).starts_with("::=");
  }

  Sequence element() {
    const char c = text_[pos_];
    if (c == '"') return literal();
    if (c == '[') return char_class();
    if (c == '(') {
      ++pos_;
      skip_space(true);
      if (!at_end() && text_[pos_] == '=') {
        fail("lookahead assertion (= ...) not supported");
        return {};
      }
      std::vector<Sequence> inside = alternatives();
      skip_space(true);
      if (at_end() || text_[pos_] != ')') {
        fail("unterminated group");
        return {};
      }
      ++pos_;
      return {builder_.choice("group", std::move(inside))};
    }
    if (is_name_char(c)) return {GrammarBuilder::ref(rule_id(name()))};
    fail(std::string("unexpected '") + c + "'");
    return {};
  }

  Sequence literal() {
    ++pos_;
    std::string bytes;
    while (ok()) {
      if (at_end() || text_[pos_] == '\n') {
        fail("unterminated string");
        return {};
      }
      const char c = text_[pos_++];
      if (c == '"') break;
      if (c != '\\') {
        bytes += c;
        continue;
      }
      if (at_end()) return fail("trailing backslash"), Sequence{};
      const char e = text_[pos_++];
      switch (e) {
        case 'n':
          bytes += '\n';
          break;
        case 't':
          bytes += '\t';
          break;
        case 'r':
          bytes += '\r';
          break;
        case '"':
        case '\\':
        case '\'':
        case '[':
        case ']':
          bytes += e;
          break;
        case 'x':
        case 'u':
        case 'U': {
          const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          std::uint32_t cp = 0;
          for (int i = 0; i < digits; ++i) {
            const char h = at_end() ? 'g' : text_[pos_++];
            const int v = h >= '0' && h <= '9'   ? h - '0'
                          : h >= 'a' && h <= 'f' ? h - 'a' + 10
                          : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                 : -1;
            if (v < 0) return fail("bad hex escape"), Sequence{};
            cp = cp * 16 + static_cast<std::uint32_t>(v);
          }
          utf8::append(bytes, static_cast<char32_t>(cp));
          break;
        }
        default:
          return fail(std::string("unknown escape \\") + e), Sequence{};
      }
    }
    if (bytes.empty()) return {};  // "" is the empty sequence
    return builder_.literal(bytes);
  }

  // [...] is handed to the regex parser whole.
  Sequence char_class() {
    const std::size_t start = pos_;
    ++pos_;
    while (!at_end() && text_[pos_] != ']') pos_ += text_[pos_] == '\\' ? 2 : 1;
    if (at_end()) return fail("unterminated character class"), Sequence{};
    ++pos_;
    auto out = regex_sequence(text_.substr(start, pos_ - start), RegexText::raw, builder_);
    if (!out.ok()) return fail(out.status().message()), Sequence{};
    return std::move(*out);
  }

  Sequence quantified(Sequence item) {
    while (ok() && !at_end()) {
      std::int64_t min = 0;
      std::int64_t max = -1;
      const char c = text_[pos_];
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        min = 1;
        ++pos_;
      } else if (c == '?') {
        max = 1;
        ++pos_;
      } else if (c == '{') {
        ++pos_;
        min = number();
        max = min;
        if (!at_end() && text_[pos_] == ',') {
          ++pos_;
          skip_space(false);
          max = !at_end() && text_[pos_] == '}' ? -1 : number();
        }
        skip_space(false);
        if (at_end() || text_[pos_] != '}') return fail("unterminated {m,n}"), Sequence{};
        ++pos_;
      } else {
        break;
      }
      auto repeated = builder_.repeat("repeat", item, min, max);
      if (!repeated.ok()) return fail(repeated.status().message()), Sequence{};
      item = {*repeated};
    }
    return item;
  }

  std::int64_t number() {
    skip_space(false);
    std::int64_t value = 0;
    const std::size_t start = pos_;
    while (!at_end() && text_[pos_] >= '0' && text_[pos_] <= '9' && value < (1 << 30))
      value = value * 10 + (text_[pos_++] - '0');
    if (pos_ == start) fail("expected a number");
    skip_space(false);
    return value;
  }

  std::string_view text_;
  std::size_t pos_ = 0;
  GrammarBuilder builder_;
  std::map<std::string, std::int32_t> rules_;
  std::set<std::string> defined_;
  Status error_;
};

}  // namespace

StatusOr<Grammar> ebnf_grammar(std::string_view text) {
  return EbnfParser(text).parse();
}

}  // namespace capserve::runtime::grammar
