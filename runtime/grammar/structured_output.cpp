#include "runtime/grammar/structured_output.h"

#include <algorithm>
#include <string>
#include <utility>

#include "runtime/grammar/ebnf.h"
#include "runtime/grammar/json_schema.h"
#include "runtime/grammar/regex.h"

namespace capserve::runtime::grammar {

StatusOr<OutputConstraint> parse_constraint(const nlohmann::ordered_json& spec) {
  OutputConstraint c;
  if (!spec.is_object()) return Status::invalid_argument("a constraint is a JSON object");
  if (spec.contains("json_schema")) {
    c.kind = OutputConstraint::Kind::json_schema;
    c.schema = spec["json_schema"];
  } else if (spec.contains("json_object")) {
    c.kind = OutputConstraint::Kind::json_object;
  } else if (spec.contains("regex") && spec["regex"].is_string()) {
    c.kind = OutputConstraint::Kind::regex;
    c.regex = spec["regex"].get<std::string>();
  } else if (spec.contains("choice") && spec["choice"].is_array()) {
    c.kind = OutputConstraint::Kind::choice;
    for (const auto& choice : spec["choice"]) {
      if (!choice.is_string()) return Status::invalid_argument("a choice that is not a string", "choice");
      c.choices.push_back(choice.get<std::string>());
    }
  } else if (spec.contains("grammar") && spec["grammar"].is_string()) {
    c.kind = OutputConstraint::Kind::grammar;
    c.grammar = spec["grammar"].get<std::string>();
  } else {
    return Status::invalid_argument(
        "a constraint needs json_schema, json_object, regex (a string), choice (a list) or grammar (a "
        "string)");
  }
  if (spec.contains("exponent_digits")) {
    const auto& digits = spec["exponent_digits"];
    if (!digits.is_number_integer() || digits.get<std::int64_t>() < 0 || digits.get<std::int64_t>() > 9)
      return Status::invalid_argument("exponent_digits: a count in [0, 9] (0: any)", "exponent_digits");
    c.json.max_exponent_digits = digits.get<std::int64_t>();
  }
  if (spec.contains("whitespace")) {
    const auto& ws = spec["whitespace"];
    if (ws == "compact") {
      c.json.whitespace = JsonWhitespace::compact;
    } else if (ws.is_number_integer() && ws.get<std::int64_t>() >= 0) {
      c.json.whitespace = JsonWhitespace::at_most;
      c.json.max_whitespace = ws.get<std::int64_t>();
    } else {
      return Status::invalid_argument("whitespace: \"compact\" or a count", "whitespace");
    }
  }
  return c;
}

StatusOr<Grammar> constraint_grammar(const OutputConstraint& constraint) {
  switch (constraint.kind) {
    case OutputConstraint::Kind::json_schema:
      return json_schema_grammar(constraint.schema, constraint.json);
    case OutputConstraint::Kind::json_object:
      return json_schema_grammar(nlohmann::ordered_json{{"type", "object"}}, constraint.json);
    case OutputConstraint::Kind::regex: {
      GrammarBuilder builder;
      const std::int32_t root = builder.new_rule("root");
      auto body = regex_sequence(constraint.regex, RegexText::raw, builder);
      if (!body.ok()) return std::move(body).take_status();
      builder.add_alternative(root, std::move(*body));
      return std::move(builder).finish(root);
    }
    case OutputConstraint::Kind::choice: {
      if (constraint.choices.empty()) return Status::invalid_argument("an empty list of choices");
      GrammarBuilder builder;
      const std::int32_t root = builder.new_rule("root");
      for (const auto& choice : constraint.choices) {
        if (choice.empty()) return Status::invalid_argument("an empty choice");
        builder.add_alternative(root, builder.literal(choice));
      }
      return std::move(builder).finish(root);
    }
    case OutputConstraint::Kind::grammar:
      return ebnf_grammar(constraint.grammar);
  }
  return Status::internal("unknown output constraint");
}

StatusOr<std::shared_ptr<const CompiledGrammar>> compile(const OutputConstraint& constraint,
                                                         std::shared_ptr<const TokenVocabulary> vocabulary) {
  auto grammar = constraint_grammar(constraint);
  if (!grammar.ok()) return std::move(grammar).take_status();
  // The mask cache holds a vocabulary bitmask per byte position and compiling walks the vocabulary once for
  // each: a schema of thousands of long strings would take the server's memory and a core for seconds.
  const auto positions = static_cast<std::int64_t>(
      std::count_if(grammar->elements.begin(), grammar->elements.end(),
                    [](const Element& e) { return e.kind == Element::Kind::bytes; }));
  const std::int64_t bytes = positions * vocabulary->mask_words() * 4;
  if (bytes > kMaxMaskCacheBytes)
    return Status::invalid_argument("the constraint is too large: " + std::to_string(positions) +
                                    " grammar positions need " + std::to_string(bytes >> 20) +
                                    " MiB of token masks, the limit is " +
                                    std::to_string(kMaxMaskCacheBytes >> 20) + " MiB");
  return std::make_shared<const CompiledGrammar>(std::move(*grammar), std::move(vocabulary));
}

}  // namespace capserve::runtime::grammar
