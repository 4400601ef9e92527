// Replays the walks tools/grammar/compare_xgrammar.py --record wrote
// (tests/fixtures/grammar/xgrammar_walks.jsonl: valid instances of the corpus's schemas and random detours
// from them, on the default model's tokenizer) and checks that capserve's mask equals xgrammar 0.2.8's at
// every state (the recorded FNV-1a hash of its words; special tokens other than the stop token left out, as
// the script does) and that both accept the same tokens.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/grammar/matcher.h"
#include "runtime/grammar/structured_output.h"
#include "runtime/tokenizer/tokenizer.h"

namespace capserve::runtime::grammar {
namespace {

std::string fnv1a64(std::span<const std::int32_t> words) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (const std::int32_t w : words) {
    for (int i = 0; i < 4; ++i) {
      h ^= (static_cast<std::uint32_t>(w) >> (8 * i)) & 0xFFU;
      h *= 0x100000001B3ULL;
    }
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

TEST(GrammarXgrammar, MasksEqualRecordedXgrammarMasks) {
  const std::string source = CAPSERVE_SOURCE_DIR;
  const auto tokenizer = Tokenizer::load(source + "/deploy/models/capserve-moe-tiny");
  const auto vocabulary = std::make_shared<const TokenVocabulary>(
      TokenVocabulary::from_tokenizer(tokenizer, {*tokenizer.eos_id()}));
  std::ifstream walks(source + "/tests/fixtures/grammar/xgrammar_walks.jsonl");
  ASSERT_TRUE(walks) << "tests/fixtures/grammar/xgrammar_walks.jsonl missing";
  std::map<std::string, std::shared_ptr<const CompiledGrammar>> compiled;
  std::vector<std::int32_t> words(static_cast<std::size_t>(vocabulary->mask_words()));
  std::string line;
  int states = 0;
  int constraints = 0;
  while (std::getline(walks, line)) {
    const auto walk = nlohmann::ordered_json::parse(line);
    const std::string name = walk["name"];
    auto& grammar = compiled[name];
    if (!grammar) {
      const auto c = parse_constraint(walk["constraint"]);
      ASSERT_TRUE(c.ok()) << c.status().message();
      auto out = compile(*c, vocabulary);
      ASSERT_TRUE(out.ok()) << name << ": " << out.status().message();
      grammar = *out;
      ++constraints;
    }
    GrammarMatcher matcher(grammar);
    const auto& tokens = walk["tokens"];
    const auto& accepted = walk["accepted"];
    const auto& masks = walk["masks"];
    for (std::size_t k = 0; k < masks.size(); ++k) {
      ASSERT_TRUE(matcher.fill_next_token_bitmask(words).ok());
      // null: after part of a character, where xgrammar also allows invalid UTF-8 (surrogates, past
      // U+10FFFF).
      if (!masks[k].is_null()) {
        ASSERT_EQ(fnv1a64(words), masks[k].get<std::string>()) << name << ": state " << k << " of " << line;
        ++states;
      }
      if (k < accepted.size()) {
        ASSERT_EQ(matcher.accept_token(tokens[k].get<std::int32_t>()), accepted[k].get<bool>())
            << name << ": token " << k;
      }
    }
  }
  EXPECT_GE(constraints, 60);
  std::printf("%d constraints, %d states equal to xgrammar's\n", constraints, states);
}

}  // namespace
}  // namespace capserve::runtime::grammar
