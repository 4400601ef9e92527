#pragma once
// The expert-placement and capacity flags every program that runs a model shares (capserve-generate, the
// evaluation and benchmark tools, the server), parsed into ParallelOptions with CLI11's own validation.
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
  app.add_option("--redundant-experts", flags.options.redundant_experts,
                 "EPLB replication: extra copies per MoE layer (over all ranks) of the experts the "
                 "--expert-placement statistics show hottest; each costs one expert's weights")
      ->capture_default_str()
      ->check(at_least(0));
  app.add_option("--capacity-factor", flags.gamma,
                 "gamma: expert capacity ceil(gamma * T * k / E); inf = off; one value or one per layer, "
                 "comma-separated")
      ->capture_default_str()
      ->check([](const std::string& v) {
        return parse_gamma(v) ? std::string() : "must be inf or positive numbers, comma-separated";
      });
  add_enum_option(app, "--capacity-policy", c.policy, "what a full expert does with the tokens over capacity",
                  {{"none", CapacityPolicy::none},
                   {"drop", CapacityPolicy::drop},
                   {"reroute", CapacityPolicy::reroute},
                   {"expanded", CapacityPolicy::expanded}});
  add_enum_option(app, "--capacity-granularity", c.granularity,
                  "a capacity per expert or per device (all of a rank's experts)",
                  {{"expert", CapacityGranularity::expert}, {"device", CapacityGranularity::device}});
  add_enum_option(app, "--capacity-scope", c.scope,
                  "local (no communication) or global (exact top-C over all ranks)",
                  {{"local", CapacityScope::local}, {"global", CapacityScope::global}});
  add_enum_option(app, "--capacity-score", c.score, "which tokens a full expert keeps",
                  {{"gate", DropScore::gate},
                   {"order", DropScore::order},
                   {"reverse-order", DropScore::reverse_order},
                   {"random", DropScore::random}});
  app.add_option("--capacity-rounds", c.rounds, "reroute rounds R")->check(at_least(1));
  app.add_option("--capacity-local-experts", c.local_experts,
                 "expanded drop: m experts on the token's own rank")
      ->check(at_least(1));
  app.add_flag("--capacity-renormalize", c.renormalize_after_drop,
               "rescale a token's kept gate weights to their original sum after drops");
  add_enum_option(app, "--capacity-apply-to", c.apply_to, "the phases the capacity applies to",
                  {{"prefill", CapacityPhase::prefill},
                   {"decode", CapacityPhase::decode},
                   {"both", CapacityPhase::both}});
  app.add_option("--capacity-seed", c.seed, "seed of the random score");
}

// Call after parsing.
inline ParallelOptions finish_parallel_flags(const ParallelFlags& flags) {
  ParallelOptions options = flags.options;
  options.capacity.gamma = *parallel::parse_gamma(flags.gamma);
  return options;
}

}  // namespace capserve::runtime
