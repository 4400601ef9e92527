#include "runtime/chat/jinja_lexer.h"

#include <cctype>
#include <cstdint>

#include "runtime/chat/jinja_error.h"

namespace capserve::runtime::jinja {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Jinja2 reads the source with universal newlines and, without keep_trailing_newline, drops one final "\n".
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (std::size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

void append_utf8(std::uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    std::size_t strip_next =
        0;  // 1: drop one "\n" (trim_blocks); 2: drop all whitespace ("-" on the tag end)
    while (pos_ < src_.size()) {
      const std::size_t tag = find_tag(pos_);
      std::string data = src_.substr(pos_, tag - pos_);
      count_lines(pos_, tag);
      std::size_t lead = 0;
      if (strip_next == 2) {
        while (lead < data.size() && is_space(data[lead])) ++lead;
      } else if (strip_next == 1 && !data.empty() && data[0] == '\n') {
        lead = 1;
      }
      data.erase(0, lead);
      strip_next = 0;
      if (tag == src_.size()) {
        emit_data(std::move(data));
        break;
      }
      const char type = src_[tag + 1];
      const char control = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (control == '-') {
        while (!data.empty() && is_space(data.back())) data.pop_back();
      } else if (control != '+' && type != '{') {
        // lstrip_blocks: only whitespace between the start of the line and a block tag or comment.
        const std::size_t nl = data.rfind('\n');
        const std::size_t from = nl == std::string::npos ? 0 : nl + 1;
        if ((nl != std::string::npos || line_starting) && from < data.size() &&
            data.find_first_not_of(" \t\r\f\v", from) == std::string::npos) {
          data.erase(from);
        }
      }
      emit_data(std::move(data));
      pos_ = tag + 2 + ((control == '-' || (control == '+' && type != '{')) ? 1 : 0);
      char end_control = '\0';
      if (type == '#') {
        end_control = skip_comment();
      } else {
        end_control = lex_tag(type);
      }
      if (end_control == '-') {
        strip_next = 2;
      } else if (end_control != '+' && type != '{') {
        strip_next = 1;
      }
      line_starting = next_starts_line(strip_next);
    }
    tokens_.push_back({TokenKind::end, {}, line_});
    return std::move(tokens_);
  }

 private:
  // Whether, once the whitespace control after the tag has run, the next text starts a line (Jinja tracks
  // this by whether the tag's match ended in a newline).
  bool next_starts_line(std::size_t strip_next) const {
    if (strip_next == 1) return pos_ < src_.size() && src_[pos_] == '\n';
    if (strip_next == 2) {
      std::size_t p = pos_;
      while (p < src_.size() && is_space(src_[p])) ++p;
      return p > pos_ && src_[p - 1] == '\n';
    }
    return false;
  }

  std::size_t find_tag(std::size_t from) const {
    for (std::size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return src_.size();
  }

  void count_lines(std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; ++i) line_ += src_[i] == '\n' ? 1 : 0;
  }

  void emit_data(std::string data) {
    if (!data.empty()) tokens_.push_back({TokenKind::data, std::move(data), line_});
  }

  [[noreturn]] void fail(const std::string& what) const { throw Error(ErrorKind::syntax_error, what, line_); }

  char skip_comment() {
    const std::size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) fail("Missing end of comment tag");
    count_lines(pos_, end);
    const char control = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    pos_ = end + 2;
    return control;
  }

  // Lexes the inside of a {{ }} or {% %} up to its end delimiter; returns the end's control character.
  char lex_tag(char type) {
    const int begin_line = line_;
    tokens_.push_back({type == '{' ? TokenKind::var_begin : TokenKind::block_begin, {}, line_});
    const char close = type == '{' ? '}' : '%';
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) {
        line_ += src_[pos_] == '\n' ? 1 : 0;
        ++pos_;
      }
      if (pos_ >= src_.size()) {
        line_ = begin_line;
        fail(type == '{' ? "unexpected end of template, expected end of print statement ('}}')"
                         : "unexpected end of template, expected end of statement block ('%}')");
      }
      const std::string_view rest = std::string_view(src_).substr(pos_);
      if (depth == 0) {
        const char end_control = rest[0];
        if ((end_control == '-' || end_control == '+') && rest.size() >= 3 && rest[1] == close &&
            rest[2] == '}') {
          pos_ += 3;
          tokens_.push_back({type == '{' ? TokenKind::var_end : TokenKind::block_end, {}, line_});
          return end_control;
        }
        if (rest.size() >= 2 && rest[0] == close && rest[1] == '}') {
          pos_ += 2;
          tokens_.push_back({type == '{' ? TokenKind::var_end : TokenKind::block_end, {}, line_});
          return '\0';
        }
      }
      const char c = rest[0];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t n = 1;
        while (n < rest.size() && (std::isalnum(static_cast<unsigned char>(rest[n])) || rest[n] == '_')) ++n;
        tokens_.push_back({TokenKind::name, std::string(rest.substr(0, n)), line_});
        pos_ += n;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number(rest);
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        static constexpr std::string_view kTwo[] = {"**", "//", "==", "!=", "<=", ">="};
        std::size_t n = 0;
        for (const std::string_view two : kTwo) {
          if (rest.starts_with(two)) n = 2;
        }
        if (n == 0) {
          if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) == std::string_view::npos) {
            fail(std::string("unexpected char '") + c + "'");
          }
          n = 1;
          if (c == '(' || c == '[' || c == '{') ++depth;
          if (c == ')' || c == ']' || c == '}') {
            if (depth == 0) fail(std::string("unexpected '") + c + "'");
            --depth;
          }
        }
        tokens_.push_back({TokenKind::op, std::string(rest.substr(0, n)), line_});
        pos_ += n;
      }
    }
  }

  void lex_number(std::string_view rest) {
    std::size_t n = 0;
    std::string digits;
    auto take_digits = [&] {
      while (n < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[n])) ||
                                 (rest[n] == '_' && n + 1 < rest.size() &&
                                  std::isdigit(static_cast<unsigned char>(rest[n + 1]))))) {
        if (rest[n] != '_') digits += rest[n];
        ++n;
      }
    };
    take_digits();
    bool is_float = false;
    if (n + 1 < rest.size() && rest[n] == '.' && std::isdigit(static_cast<unsigned char>(rest[n + 1]))) {
      is_float = true;
      digits += rest[n++];
      take_digits();
    }
    if (n < rest.size() && (rest[n] == 'e' || rest[n] == 'E')) {
      std::size_t m = n + 1;
      if (m < rest.size() && (rest[m] == '+' || rest[m] == '-')) ++m;
      if (m < rest.size() && std::isdigit(static_cast<unsigned char>(rest[m]))) {
        is_float = true;
        digits.append(rest.substr(n, m - n));
        n = m;
        take_digits();
      }
    }
    tokens_.push_back({is_float ? TokenKind::floating : TokenKind::integer, std::move(digits), line_});
    pos_ += n;
  }

  // A Python string literal's escapes (Jinja decodes them with "unicode-escape").
  void lex_string(char quote) {
    const int start_line = line_;
    std::string value;
    std::size_t p = pos_ + 1;
    while (true) {
      if (p >= src_.size()) {
        line_ = start_line;
        fail("unexpected end of string");
      }
      const char c = src_[p];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) {
        line_ = start_line;
        fail("unexpected end of string");
      }
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n':
          ++line_;
          break;
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'n':
          value += '\n';
          break;
        case 'r':
          value += '\r';
          break;
        case 't':
          value += '\t';
          break;
        case 'v':
          value += '\v';
          break;
        case 'x':
        case 'u':
        case 'U': {
          const std::size_t width = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          std::uint32_t cp = 0;
          for (std::size_t i = 0; i < width; ++i) {
            if (p + i >= src_.size() || !std::isxdigit(static_cast<unsigned char>(src_[p + i]))) {
              fail(std::string("truncated \\") + e + " escape in string");
            }
            const char h = src_[p + i];
            cp = cp * 16 +
                 static_cast<std::uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                ? h - '0'
                                                : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
          }
          if (cp > 0x10FFFF) fail("illegal Unicode character in string");
          append_utf8(cp, value);
          p += width;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            std::uint32_t cp = static_cast<std::uint32_t>(e - '0');
            for (int i = 0; i < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i, ++p) {
              cp = cp * 8 + static_cast<std::uint32_t>(src_[p] - '0');
            }
            append_utf8(cp, value);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    tokens_.push_back({TokenKind::string, std::move(value), start_line});
    pos_ = p + 1;
  }

  std::string src_;
  std::size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  return Lexer(normalize_newlines(source)).run();
}

}  // namespace capserve::runtime::jinja
