#include "runtime/grammar/structured_output.h"

#include <utility>

#include "runtime/grammar/json_schema.h"
#include "runtime/grammar/regex.h"

namespace capserve::runtime::grammar {

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
  }
  return Status::internal("unknown output constraint");
}

StatusOr<std::shared_ptr<const CompiledGrammar>> compile(const OutputConstraint& constraint,
                                                         std::shared_ptr<const TokenVocabulary> vocabulary) {
  auto grammar = constraint_grammar(constraint);
  if (!grammar.ok()) return std::move(grammar).take_status();
  return std::make_shared<const CompiledGrammar>(std::move(*grammar), std::move(vocabulary));
}

}  // namespace capserve::runtime::grammar
