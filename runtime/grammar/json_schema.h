#pragma once
// JSON schemas as grammars, in the language xgrammar (0.2.8) generates with its defaults (any_whitespace,
// strict_mode), so that the two engines' masks can be compared token for token:
// - whitespace: [ \n\r\t]* wherever JSON allows it (JsonOptions below); strings: any character but controls,
// quote and backslash,
//   or an escape (\" \\ \/ \b \f \n \r \t \uXXXX);
// - objects: the schema's properties in its order, the required ones present; no other property unless
//   additionalProperties says so (true or a schema: more properties after the listed ones, whose keys are not
//   the listed names); an object schema without properties (and {"type": "object"}) is any object;
// - arrays: items, minItems, maxItems; enum and const: their values, compact; anyOf and oneOf: any branch
// (oneOf's
//   exclusivity is not checked); $ref to "#", "#/$defs/..." or "#/definitions/..." (recursion allowed);
// - strings: pattern (a regex, regex.h, over the string's characters), minLength / maxLength (characters),
//   format date, time, date-time, uuid, ipv4, email;
// - integers: minimum, maximum, exclusiveMinimum, exclusiveMaximum, enforced exactly by the digits grammar
//   (the range's decimal spellings, no leading zeros); numbers: any JSON number, or with the same four bounds
//   as whole numbers, exact, written without an exponent and with at most 6 decimals (xgrammar's form; a
//   fractional bound is refused, naming it).
// Any other keyword with an effect on validity is refused with invalid_argument naming it (annotations such
// as title and description are ignored).
#include <cstdint>

#include <nlohmann/json.hpp>

#include "runtime/grammar/grammar.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

// Whitespace between JSON tokens (xgrammar's any_whitespace and max_whitespace_cnt). A small model left to
// `any` can write newlines for ever; servers offer the other two for that.
enum class JsonWhitespace {
  any,      // [ \n\r\t]* (xgrammar's default)
  at_most,  // at most max_whitespace of them at each place
  compact,  // none, except ", " and ": " as separators (xgrammar's any_whitespace=False)
};

struct JsonOptions {
  JsonWhitespace whitespace = JsonWhitespace::any;
  std::int64_t max_whitespace = 0;
  // The most digits of a number's exponent; 0: any (xgrammar). A small model can write an exponent's digits
  // for ever, and past 3 no double holds the number (they end at e308).
  std::int64_t max_exponent_digits = 0;
};

StatusOr<Grammar> json_schema_grammar(const nlohmann::ordered_json& schema, const JsonOptions& options = {});

}  // namespace capserve::runtime::grammar
