#pragma once
// The expert-placement and capacity flags every program that runs a model shares (capserve-generate, the
// evaluation and benchmark tools, the server), parsed into ParallelOptions with CLI11's own validation.
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "parallel/capacity_config.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/model.h"

namespace capserve::runtime {

struct ParallelFlags {
  std::string gamma = "inf";
  ParallelOptions options;
};

inline void add_parallel_flags(CLI::App& app, ParallelFlags& flags) {
  using namespace parallel;
  CapacityConfig& c = flags.options.capacity;
  app.add_option("--expert-placement", flags.options.placement,
                 "contiguous, round-robin, or a --moe-stats JSON file to balance measured loads")
      ->capture_default_str();
  app.add_option("--capacity-factor", flags.gamma,
                 "gamma: expert capacity ceil(gamma * T * k / E); inf = off; one value or one per layer, "
                 "comma-separated")
      ->capture_default_str()
      ->check([](const std::string& v) {
        return parse_gamma(v) ? std::string() : "must be inf or positive numbers, comma-separated";
      });
  app.add_option("--capacity-policy", c.policy, "none | drop | reroute | expanded")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, CapacityPolicy>{{"none", CapacityPolicy::none},
                                                {"drop", CapacityPolicy::drop},
                                                {"reroute", CapacityPolicy::reroute},
                                                {"expanded", CapacityPolicy::expanded}}))
      ->capture_default_str();
  app.add_option("--capacity-granularity", c.granularity, "expert | device")
      ->transform(CLI::CheckedTransformer(std::map<std::string, CapacityGranularity>{
          {"expert", CapacityGranularity::expert}, {"device", CapacityGranularity::device}}));
  app.add_option("--capacity-scope", c.scope,
                 "local (no communication) | global (exact top-C over all ranks)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, CapacityScope>{
          {"local", CapacityScope::local}, {"global", CapacityScope::global}}));
  app.add_option("--capacity-score", c.score,
                 "which tokens a full expert keeps: gate | order | reverse-order | random")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, DropScore>{{"gate", DropScore::gate},
                                           {"order", DropScore::order},
                                           {"reverse-order", DropScore::reverse_order},
                                           {"random", DropScore::random}}));
  app.add_option("--capacity-rounds", c.rounds, "reroute rounds R")->check(at_least(1));
  app.add_option("--capacity-local-experts", c.local_experts,
                 "expanded drop: m experts on the token's own rank")
      ->check(at_least(1));
  app.add_flag("--capacity-renormalize", c.renormalize_after_drop,
               "rescale a token's kept gate weights to their original sum after drops");
  app.add_option("--capacity-apply-to", c.apply_to, "prefill | decode | both")
      ->transform(
          CLI::CheckedTransformer(std::map<std::string, CapacityPhase>{{"prefill", CapacityPhase::prefill},
                                                                       {"decode", CapacityPhase::decode},
                                                                       {"both", CapacityPhase::both}}));
  app.add_option("--capacity-seed", c.seed, "seed of the random score");
}

// Call after parsing.
inline ParallelOptions finish_parallel_flags(const ParallelFlags& flags) {
  ParallelOptions options = flags.options;
  options.capacity.gamma = *parallel::parse_gamma(flags.gamma);
  return options;
}

}  // namespace capserve::runtime
