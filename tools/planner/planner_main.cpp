// capserve-planner: the trace-driven planner (tools/planner/README.md). Replays an arrival list (Poisson or
// a trace slice, sized and capped exactly as capserve-loadgen sends it, prompt domains from the same corpus
// sequence) through the server's own scheduler and batch selector on a simulated clock, with routing drawn
// from measured per-domain expert counts, the capacity factor, a placement (contiguous, balanced, EPLB
// replication), and each step priced by a step cost file; prints and writes TTFT / end-to-end percentiles,
// throughput, the per-rank imbalance and the assignments dropped.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "parallel/capacity_config.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/batch_selector.h"
#include "tools/loadgen/arrivals.h"
#include "tools/loadgen/mooncake_trace.h"
#include "tools/loadgen/prompts.h"
#include "tools/loadgen/trace_lengths.h"
#include "tools/placement/expert_counts.h"
#include "tools/planner/routing_model.h"
#include "tools/planner/simulation.h"
#include "tools/planner/step_cost.h"

namespace {

using namespace capserve;

struct Options {
  std::string routing, routing_model, cost, json_path;
  std::vector<std::string> aliases{"books=book", "web=c4", "code=github"};
  std::int64_t top_k = 0;
  // Workload, as capserve-loadgen takes it.
  std::string trace;
  double rate = 0, duration_s = 60, time_scale = 1, trace_start_s = 0;
  std::int64_t max_requests = 0;
  std::uint64_t seed = 1;
  std::string corpus = CAPSERVE_SOURCE_DIR "/../shared/data/corpus";
  loadgen::PromptConfig prompts{.corpus_dir = {}, .domains = loadgen::kCorpusDomains};
  std::string prompt_mix = "bursts";
  std::string tokenizer;
  std::int64_t prompt_tokens = 128, output_tokens = 64, max_prompt_tokens = 512, max_tokens = 128;
  std::int64_t max_context = 4096;
  std::int64_t extra_prompt_tokens = 0;
  // Server.
  tools::SimConfig sim;
  std::string strategy = "fcfs";
  std::string gamma = "inf";
  std::string scope = "global";
};

std::vector<std::pair<std::string, std::string>> parse_aliases(const std::vector<std::string>& texts) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& t : texts) {
    const auto eq = t.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == t.size())
      throw std::invalid_argument("--domain-alias " + t + ": expected DOMAIN=GROUP");
    out.emplace_back(t.substr(0, eq), t.substr(eq + 1));
  }
  return out;
}

// The arrivals and sizes capserve-loadgen would send with the same flags, each with its prompt's domain.
std::vector<tools::SimRequest> workload(const Options& o, const tools::RoutingModel& routing,
                                        std::string& description) {
  using namespace capserve::loadgen;
  std::vector<TraceRecord> trace;
  if (!o.trace.empty()) trace = read_trace(o.trace, TraceFormat::azure);
  SizeSource sizes(o.rate > 0 ? trace : std::vector<TraceRecord>{}, o.prompt_tokens, o.output_tokens,
                   o.seed + 1);
  std::vector<Arrival> arrivals;
  if (o.rate > 0) {
    arrivals = poisson_arrivals({o.rate, o.duration_s, o.max_requests, o.seed}, sizes);
    description = "Poisson " + std::to_string(o.rate) + "/s for " + std::to_string(o.duration_s) + " s";
  } else if (!trace.empty()) {
    arrivals = slice_trace(trace, {o.trace_start_s, o.duration_s, o.time_scale, o.max_requests});
    description = "trace from " + std::to_string(o.trace_start_s) + " s x" + std::to_string(o.time_scale);
  } else {
    throw std::invalid_argument("give --rate (Poisson arrivals) or --trace (a replayed Azure trace)");
  }
  const std::optional<runtime::Tokenizer> tokenizer =
      o.tokenizer.empty() ? std::nullopt : std::optional(runtime::Tokenizer::load(o.tokenizer));
  PromptConfig config = o.prompts;
  config.corpus_dir = o.corpus;
  config.mix = o.prompt_mix == "mixed" ? PromptMix::mixed : PromptMix::bursts;
  config.seed = o.seed;
  PromptSource prompts(config, tokenizer ? &*tokenizer : nullptr);
  LengthCaps caps({o.max_prompt_tokens, o.max_tokens, o.max_context});
  std::vector<tools::SimRequest> out;
  out.reserve(arrivals.size());
  for (const Arrival& a : arrivals) {
    const Lengths l = caps.fit(a.context_tokens, a.generated_tokens);
    const Prompt p = prompts.next(l.prompt);
    out.push_back({a.at_s, routing.domain(p.domain), l.prompt + o.extra_prompt_tokens, l.output});
  }
  description += " (" + std::to_string(out.size()) + " requests), " + caps.summary();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{
      "The trace-driven planner: the server's scheduler on a simulated clock, priced by a step cost"};
  capserve::runtime::add_common_flags(app, "capserve-planner");
  Options o;
  app.add_option("--routing", o.routing, "routing counts (any file capserve-placement reads)")->required();
  app.add_option("--routing-model", o.routing_model,
                 "the model key of a shared counts file (olmoe, mistral)");
  app.add_option("--top-k", o.top_k, "experts per token, when the counts do not tell");
  app.add_option("--domain-alias", o.aliases, "DOMAIN=GROUP: a corpus domain's name in the counts")
      ->capture_default_str();
  app.add_option("--cost", o.cost, "the step cost file (planner_eval.py calibrate or project wrote it)")
      ->required();
  app.add_option("--trace", o.trace, "an Azure LLM trace CSV: replayed, or sizes for --rate");
  app.add_option("--rate", o.rate, "Poisson arrivals per second (0: replay --trace)");
  app.add_option("--duration-s", o.duration_s, "of the run")->capture_default_str();
  app.add_option("--time-scale", o.time_scale, "replay time = trace time x this")->capture_default_str();
  app.add_option("--trace-start-s", o.trace_start_s, "replay from this second of the trace");
  app.add_option("--max-requests", o.max_requests, "0: no limit");
  app.add_option("--seed", o.seed, "arrivals, sizes and prompt domains (as capserve-loadgen's)")
      ->capture_default_str();
  app.add_option("--corpus", o.corpus, "the corpus directory (prompt domains)")->capture_default_str();
  app.add_option("--domains", o.prompts.domains, "corpus domains")->delimiter(',')->capture_default_str();
  app.add_option("--prompt-mix", o.prompt_mix, "bursts | mixed")->capture_default_str();
  app.add_option("--burst-length", o.prompts.burst_length, "requests per run of one domain")
      ->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer,
                 "the model directory capserve-loadgen was given (the same domain sequence as its run)");
  app.add_option("--prompt-tokens", o.prompt_tokens, "without --trace")->capture_default_str();
  app.add_option("--output-tokens", o.output_tokens, "without --trace")->capture_default_str();
  app.add_option("--max-prompt-tokens", o.max_prompt_tokens)->capture_default_str();
  app.add_option("--max-tokens", o.max_tokens)->capture_default_str();
  app.add_option("--max-context", o.max_context, "the served context")->capture_default_str();
  app.add_option("--extra-prompt-tokens", o.extra_prompt_tokens,
                 "tokens the server adds to every prompt (the chat template's)")
      ->capture_default_str();
  app.add_option("--ranks", o.sim.ranks)->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--max-running", o.sim.scheduler.max_running)->capture_default_str();
  app.add_option("--max-queue", o.sim.scheduler.max_queue, "waiting requests beyond this are refused")
      ->capture_default_str();
  app.add_option("--max-batched-tokens", o.sim.scheduler.max_batched_tokens)->capture_default_str();
  app.add_option("--kv-blocks", o.sim.scheduler.kv_blocks_per_rank)->capture_default_str();
  app.add_option("--kv-block-size", o.sim.scheduler.kv_block_size)->capture_default_str();
  server::SelectorConfig& s = o.sim.scheduler.selector;
  app.add_option("--batch-selector", o.strategy, "fcfs | greedy | power_of_d | lpt_balanced | random")
      ->capture_default_str();
  app.add_option("--selector-window", s.window)->capture_default_str();
  app.add_option("--selector-min-queue", s.min_queue_depth)->capture_default_str();
  app.add_option("--selector-max-wait-ms", s.max_wait_ms)->capture_default_str();
  app.add_option("--selector-interval-ms", s.interval_ms)->capture_default_str();
  app.add_option("--selector-d", s.power_of_d)->capture_default_str();
  app.add_option("--capacity-factor", o.gamma, "gamma for every layer (inf: off); the drop policy")
      ->capture_default_str();
  app.add_option("--capacity-scope", o.scope,
                 "global (over all ranks' tokens, its collectives priced) or local (each rank's own tokens, "
                 "no collective)")
      ->capture_default_str()
      ->check(CLI::IsMember({"global", "local"}));
  app.add_option("--placement", o.sim.placement, "contiguous | balanced (planned from the routing counts)")
      ->capture_default_str();
  app.add_option("--redundant-experts", o.sim.redundant_per_rank,
                 "EPLB replication: extra expert slots per rank (balanced slots)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--sim-seed", o.sim.seed, "the routing draws")->capture_default_str();
  app.add_option("--json", o.json_path, "write the summary here");
  app.add_option("--step-trace", o.sim.step_trace,
                 "write every simulated step here, in the server's --step-trace format");
  if (const auto bad = runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    std::cerr << "capserve-planner: " << *bad << " has an empty value\n";
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  // The simulated requests' access lines are the server's; the planner reports its summary instead.
  spdlog::set_level(spdlog::level::warn);

  try {
    if (!server::parse_strategy(o.strategy, o.sim.scheduler.selector.strategy))
      throw std::invalid_argument("--batch-selector " + o.strategy +
                                  ": fcfs, greedy, power_of_d, "
                                  "lpt_balanced or random");
    const auto gamma = parallel::parse_gamma(o.gamma);
    if (!gamma || gamma->size() != 1)
      throw std::invalid_argument("--capacity-factor " + o.gamma + ": one positive number or inf");
    o.sim.gamma = gamma->front();
    o.sim.local_capacity = o.scope == "local";
    o.sim.scheduler.max_context = o.max_context;
    const tools::StepCost cost = tools::read_step_cost(o.cost);
    const tools::ExpertCounts counts = tools::read_expert_counts(o.routing, o.routing_model);
    const tools::RoutingModel routing(counts, cost.moe_layers, o.top_k > 0 ? o.top_k : cost.top_k,
                                      parse_aliases(o.aliases));
    std::string description;
    const std::vector<tools::SimRequest> requests = workload(o, routing, description);
    const tools::SimResult result = tools::simulate(o.sim, routing, cost, requests);
    nlohmann::json summary = tools::summarize(result);
    summary["workload"] = description;
    summary["cost"] = cost.name;
    summary["ranks"] = o.sim.ranks;
    summary["strategy"] = o.strategy;
    summary["gamma"] = o.gamma;
    summary["capacity_scope"] = o.scope;
    summary["placement"] = o.sim.redundant_per_rank > 0
                               ? "replication +" + std::to_string(o.sim.redundant_per_rank)
                               : o.sim.placement;
    const auto& t = summary["ttft_s"];
    const auto& e = summary["e2e_s"];
    std::printf(
        "%s\n%d ranks, %s, gamma %s, %s: %lld steps (mean %.2f ms), TTFT p50 %.3f p99 %.3f s, e2e p50 %.3f "
        "p99 %.3f s, %.1f output tokens/s, imbalance %.3f, dropped %.2f%%\n",
        description.c_str(), o.sim.ranks, o.strategy.c_str(), o.gamma.c_str(),
        summary["placement"].get<std::string>().c_str(), static_cast<long long>(result.steps),
        1e3 * summary["mean_step_s"].get<double>(), t["p50"].get<double>(), t["p99"].get<double>(),
        e["p50"].get<double>(), e["p99"].get<double>(), summary["output_tokens_per_s"].get<double>(),
        result.imbalance, 100 * summary["dropped_share"].get<double>());
    if (!o.json_path.empty()) {
      std::ofstream f(o.json_path);
      f << summary.dump(1) << "\n";
      if (!f.flush()) throw std::runtime_error("cannot write " + o.json_path);
    }
  } catch (const std::exception& e) {
    std::cerr << "capserve-planner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
