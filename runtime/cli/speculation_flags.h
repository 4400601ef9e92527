#pragma once
// The speculative decoding flags every program that decodes shares (capserve, capserve-generate).
#include <CLI/CLI.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/speculative/speculation_config.h"

namespace capserve::runtime {

inline constexpr std::int64_t kMaxSpeculativeTokens = 16;

inline void add_speculation_flags(CLI::App& app, SpeculationConfig& config) {
  CLI::Option* method = add_enum_option(
      app, "--speculative", config.method,
      "speculative decoding's drafter (runtime/README.md): none; ngram (prompt lookup in the "
      "sequence's own tokens); or mtp (the checkpoint's multi-token-prediction layer, DeepSeek-V3's)",
      {{"none", SpeculationConfig::Method::none},
       {"ngram", SpeculationConfig::Method::ngram},
       {"mtp", SpeculationConfig::Method::mtp}});
  app.add_option("--num-speculative-tokens", config.num_tokens,
                 "k: draft tokens verified per sequence and step")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, kMaxSpeculativeTokens))
      ->needs(method);
  app.add_option("--ngram-min", config.ngram_min, "ngram drafter: the shortest suffix looked up")
      ->capture_default_str()
      ->check(at_least(1))
      ->needs(method);
  app.add_option("--ngram-max", config.ngram_max, "ngram drafter: the longest suffix looked up")
      ->capture_default_str()
      ->check(at_least(1))
      ->needs(method);
}

}  // namespace capserve::runtime
