#pragma once
// Regular expressions (the JSON schema `pattern`, vLLM's guided regex) as grammar rules. The whole text must
// match: a leading ^ and a trailing $ are accepted and change nothing. Supported: literals, ., classes
// ([a-z],
// [^...], \d \w \s and their negations), escapes (\n \t \r \f \v \xHH \uHHHH, escaped punctuation), groups
// ((...), (?:...), (?<name>...), (?P<name>...)), alternation, and the quantifiers * + ? {n} {n,} {n,m} (lazy
// forms match the same texts). Anything else (backreferences, lookaround, word boundaries, inner anchors,
// possessive quantifiers) is refused naming the construct.
#include <string_view>

#include "runtime/grammar/grammar.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

enum class RegexText {
  raw,          // the text itself
  json_string,  // the content of a JSON string: quote, backslash and control characters are never produced
};

StatusOr<GrammarBuilder::Sequence> regex_sequence(std::string_view pattern, RegexText text,
                                                  GrammarBuilder& builder);

}  // namespace capserve::runtime::grammar
