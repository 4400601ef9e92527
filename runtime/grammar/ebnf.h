#pragma once
// EBNF grammars (vLLM's guided grammar), in xgrammar's (and llama.cpp's GBNF) notation:
//   rule ::= alternative | alternative ...      the text must match the rule named root
// where an alternative is a sequence of "strings" (escapes \" \\ \n \t \r \xHH \uHHHH), [character classes]
// (regex.h's), rule names, (groups), each with an optional * + ? {m} {m,} {m,n}; # starts a comment. Refused,
// naming it: a lookahead assertion (= ...), an undefined rule, a rule defined twice, left recursion.
#include <string_view>

#include "runtime/grammar/grammar.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

StatusOr<Grammar> ebnf_grammar(std::string_view text);

}  // namespace capserve::runtime::grammar
