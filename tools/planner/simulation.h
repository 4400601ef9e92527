#pragma once
// The trace-driven planner's simulation (tools/planner/README.md): the server's own Scheduler (admission,
// chunked prefill, KV accounting, the CAPS batch selector with its load predictions) run on a simulated
// clock over an arrival list; each planned step's routing drawn from measured per-domain statistics
// (RoutingModel), the capacity factor applied per expert (over all ranks' tokens, or each rank's own), the
// load placed on ranks by the real placement
// code (contiguous, balanced, or EPLB replication), and the step priced by a StepCost. Every request's time
// to first token and end-to-end latency come out as the server would report them.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/scheduler.h"
#include "tools/planner/routing_model.h"
#include "tools/planner/step_cost.h"

namespace capserve::tools {

struct SimRequest {
  double at_s = 0;  // arrival, seconds from the start
  int domain = 0;   // RoutingModel::domain
  std::int64_t prompt_tokens = 0;
  std::int64_t output_tokens = 0;
};

struct SimConfig {
  int ranks = 1;
  server::SchedulerConfig scheduler;  // the server's; its prefix cache is off (prompts are not text here)
  double gamma = std::numeric_limits<double>::infinity();  // capacity factor, every layer (drop policy)
  // Capacity scope: global (ceil(gamma T k / E) over the step's T tokens of all ranks, the collectives
  // priced by the cost's capacity terms) or local (--capacity-scope local: each rank bounds its own T_r
  // tokens' assignments, routing drawn per rank, no collective and no capacity cost).
  bool local_capacity = false;
  std::string placement = "contiguous";  // contiguous | balanced (planned from the routing)
  std::int64_t redundant_per_rank = 0;   // EPLB slots per rank (balanced slots)
  bool predict = true;  // the selector sees each prompt's predicted load (its domain's mean routing)
  std::uint64_t seed = 1;
  std::string step_trace;  // when set, every simulated step as the server's --step-trace writes it
};

struct SimRequestOutcome {
  double ttft_s = 0;
  double e2e_s = 0;
  bool ok = false;
};

struct SimResult {
  std::vector<SimRequestOutcome> requests;
  std::int64_t refused = 0;  // at submission: the queue was full
  std::int64_t steps = 0;
  double makespan_s = 0;   // first arrival to last token
  double busy_s = 0;       // steps' time
  double moe_s = 0;        // of which the MoE layers' (experts, exchange)
  double imbalance = 1;    // mean over steps and MoE layers of max/mean rank load (after capacity)
  double assignments = 0;  // routed
  double dropped = 0;      // by capacity
  std::int64_t output_tokens = 0;
  std::int64_t slots_per_rank = 0;  // expert weights the busiest rank holds
};

// Throws std::invalid_argument on a configuration the routing or cost cannot serve, std::runtime_error when
// the scheduler stops making progress with requests left (a request that can never be admitted).
SimResult simulate(const SimConfig& config, const RoutingModel& routing, const StepCost& cost,
                   const std::vector<SimRequest>& requests);

// p50/p90/p99/mean of TTFT and end-to-end latency, throughput, imbalance, drops, as JSON.
nlohmann::json summarize(const SimResult& result);

}  // namespace capserve::tools
