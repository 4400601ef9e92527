// GrammarCache: compiles a constraint once, keeps the most recent ones up to its capacity, refuses what the
// engine cannot compile (and a constraint whose mask cache would be too large), and is safe to share
// between threads.
#include "runtime/grammar/grammar_cache.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/grammar/structured_output.h"

namespace capserve::runtime::grammar {
namespace {

std::shared_ptr<const TokenVocabulary> vocabulary(std::size_t extra_tokens = 0) {
  std::vector<std::optional<std::string>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)));
  // Distinct multi-byte tokens, for a vocabulary of a real model's size.
  for (std::size_t i = 0; i < extra_tokens; ++i) bytes.emplace_back(std::to_string(i) + "t");
  const auto stop = static_cast<std::int32_t>(bytes.size());
  bytes.emplace_back(std::nullopt);
  return std::make_shared<const TokenVocabulary>(std::move(bytes), std::vector<std::int32_t>{stop});
}

TEST(GrammarCache, CompilesAConstraintOnceAndKeepsTheMostRecent) {
  GrammarCache cache(vocabulary(), 2);
  const auto a = cache.get(R"({"regex": "a+"})");
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(*cache.get(R"({"regex": "a+"})"), *a);
  ASSERT_TRUE(cache.get(R"({"regex": "b+"})").ok());
  EXPECT_EQ(*cache.get(R"({"regex": "a+"})"), *a);  // used: now the most recent
  ASSERT_TRUE(cache.get(R"({"choice": ["x", "y"]})").ok());
  EXPECT_EQ(cache.size(), 2U);  // "b+" went
  EXPECT_EQ(*cache.get(R"({"regex": "a+"})"), *a);
}

TEST(GrammarCache, RefusesWhatTheEngineCannotCompileAndCachesNothing) {
  GrammarCache cache(vocabulary(), 4);
  for (const std::string spec :
       {R"({"regex": "(a)\\1"})", R"({"json_schema": {"type": "number", "minimum": 0.5}})",
        R"({"nothing": 1})", "not json"}) {
    const auto refused = cache.get(spec);
    ASSERT_FALSE(refused.ok()) << spec;
    EXPECT_EQ(refused.status().code(), StatusCode::invalid_argument) << spec;
  }
  EXPECT_EQ(cache.size(), 0U);
}

// A regex of 8000 positions over a 128k-token vocabulary would need 8000 masks of 16 KB: refused before any
// is built.
TEST(GrammarCache, RefusesAConstraintWhoseMasksWouldBeTooLarge) {
  GrammarCache cache(vocabulary(128 * 1024), 4);
  const auto refused = cache.get(R"({"regex": "a{4000}b{4000}"})");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("too large"), std::string::npos) << refused.status().message();
  EXPECT_TRUE(cache.get(R"({"regex": "a{40}"})").ok());
}

// A schema of many long bounded strings is refused while its grammar is built (past
// GrammarBuilder::kMaxElements), before the build and the compile take a server thread for seconds.
TEST(GrammarCache, RefusesAGrammarPastItsElementBudget) {
  GrammarCache cache(vocabulary(), 4);
  nlohmann::ordered_json properties = nlohmann::ordered_json::object();
  for (int i = 0; i < 20; ++i)
    properties[std::to_string(i) + "p"] = {{"type", "string"}, {"maxLength", 4000}};
  const nlohmann::ordered_json spec{{"json_schema", {{"type", "object"}, {"properties", properties}}}};
  const auto refused = cache.get(spec.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("grammar elements"), std::string::npos)
      << refused.status().message();
}

TEST(GrammarCache, ThreadsShareOneCompiledGrammar) {
  GrammarCache cache(vocabulary(), 8);
  std::vector<std::shared_ptr<const CompiledGrammar>> got(4);
  {
    std::vector<std::jthread> threads;
    for (std::size_t t = 0; t < got.size(); ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 50; ++i) {
          const auto g = cache.get(R"({"json_object": true})");
          ASSERT_TRUE(g.ok());
          got[t] = *g;
        }
      });
    }
  }
  for (const auto& g : got) EXPECT_EQ(g, got[0]);
  EXPECT_EQ(cache.size(), 1U);
}

}  // namespace
}  // namespace capserve::runtime::grammar
