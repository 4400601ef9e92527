#pragma once
// Splits Jinja2 template source into tokens the way Jinja2's lexer does with the settings transformers uses:
// newlines normalised to "\n" and one trailing newline dropped, trim_blocks (the newline after a block tag or
// comment goes), lstrip_blocks (spaces and tabs before a block tag or comment at the start of a line go),
// "-" on a delimiter strips all whitespace on that side and "+" disables lstrip_blocks / trim_blocks.
// Comments are dropped. Throws Error(syntax_error) naming the line for an unterminated tag or string.
#include <string>
#include <string_view>
#include <vector>

namespace capserve::runtime::jinja {

enum class TokenKind {
  data,         // template text, already whitespace-controlled
  var_begin,    // {{
  var_end,      // }}
  block_begin,  // {%
  block_end,    // %}
  name,
  string,    // text holds the unescaped value
  integer,   // text holds the digits (underscores removed)
  floating,  // text holds the literal (underscores removed)
  op,        // operators and punctuation: + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : |
  end,
};

struct Token {
  TokenKind kind;
  std::string text;
  int line;
};

[[nodiscard]] std::vector<Token> tokenize(std::string_view source);

}  // namespace capserve::runtime::jinja
