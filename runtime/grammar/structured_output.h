#pragma once
// The entry point for a request's structured output: what the output must be (OpenAI's response_format
// json_schema / json_object, vLLM's regex, choice and grammar), compiled against the model's vocabulary. The
// server compiles once per request and gives each of its sequences a GrammarMatcher (matcher.h); the sampler
// applies the matcher's bitmask to the logits before drawing, and the step loop calls accept_token with the
// token drawn.
//
// Errors are invalid_argument naming the schema keyword or regex construct at fault; the caller sets the
// request field (Status::with_field) and returns it as an HTTP 400.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/grammar/compiled_grammar.h"
#include "runtime/grammar/json_schema.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

struct OutputConstraint {
  enum class Kind { json_schema, json_object, regex, choice, grammar };
  Kind kind = Kind::json_object;
  nlohmann::ordered_json schema;     // json_schema (ordered: its properties are generated in order)
  std::string regex;                 // regex: the whole output matches it
  std::vector<std::string> choices;  // choice: the output is exactly one of them
  std::string grammar;               // grammar: EBNF (ebnf.h), the output matches its root rule
  JsonOptions json;                  // json_schema and json_object
};

// A constraint spelled in JSON, as capserve-grammar-tool and the tests read it (and a front end may):
//   {"json_schema": {...}} | {"json_object": true} | {"regex": "..."} | {"choice": ["...", ...]} |
//   {"grammar": "root ::= ..."}
// with, for the JSON kinds, "whitespace": "compact" or a number, and "exponent_digits": a count
// (JsonOptions).
StatusOr<OutputConstraint> parse_constraint(const nlohmann::ordered_json& spec);

StatusOr<Grammar> constraint_grammar(const OutputConstraint& constraint);

// The most memory a compiled grammar's mask cache may take (compiled_grammar.h); a larger constraint is
// refused, saying so.
inline constexpr std::int64_t kMaxMaskCacheBytes = std::int64_t{64} << 20;

StatusOr<std::shared_ptr<const CompiledGrammar>> compile(const OutputConstraint& constraint,
                                                         std::shared_ptr<const TokenVocabulary> vocabulary);

}  // namespace capserve::runtime::grammar
