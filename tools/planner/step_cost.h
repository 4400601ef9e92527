#pragma once
// The trace-driven planner's price of one engine step (tools/planner/README.md). A step runs the dense part
// of every layer (projections, router, attention) on each rank's own sequences, then each MoE layer's
// exchange and experts; every MoE layer waits for its slowest rank (the straggler), so
//   seconds = step + dense + sum over MoE layers of (layer + capacity(layer) + experts(layer) + wire(layer)),
// where
//   dense        = over ranks of token * tokens_r + pair * attention_pairs_r + decode_pair * decode_pairs_r
//   experts(l)   = over ranks of assignment * load_{l,r} (+ or max) active_expert * active_{l,r}
//   capacity(l)  = with a finite capacity factor: capacity_layer, plus capacity_refine when some expert of
//                  the layer overflowed (the global top-C takes further collectives to settle its threshold)
//   wire(l)      = wire_byte * bytes_l / ranks  (each rank's link carries its share of the exchange)
// "Over ranks" is the slowest rank when every rank has a device of its own (cores = 0), and the larger of
// the slowest rank and the total over `cores` when the ranks share that many CPU cores (this machine: 4-8
// oversubscribed ranks on 2 cores, where the total work, not the straggler, sets the pace). Experts cost
// their assignments plus a fixed cost per active expert (kernel launch, weights from cache) on a CPU
// ("sum"), and the slower of compute and reading the active experts' weights on a GPU ("roofline").
// Coefficients come from a fit to a --step-trace of the live server (planner_eval.py calibrate) or from
// published hardware figures (gpu_costs.py), each file saying which and on what assumptions.
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/step_shape.h"

namespace capserve::tools {

enum class ExpertTime { sum, roofline };

struct StepCost {
  std::string name;
  // The model the coefficients are for.
  std::int64_t moe_layers = 0;
  std::int64_t experts = 0;
  std::int64_t top_k = 0;
  std::int64_t row_bytes = 0;  // one token's hidden state on the wire
  int cores = 0;               // ranks share this many cores; 0: a device per rank
  ExpertTime expert_time = ExpertTime::sum;
  // Seconds.
  double step = 0;             // per step: scheduling, sampling, the control plane
  double token = 0;            // per token on its rank: dense layers of the whole model
  double pair = 0;             // per attention query-key pair, all layers
  double decode_pair = 0;      // per pair of a decode on top (reading the cache rather than computing)
  double layer = 0;            // per MoE layer: the exchange's latency, routing, capacity
  double assignment = 0;       // per assignment on its expert's rank, one layer
  double active_expert = 0;    // per expert with work, one layer
  double wire_byte = 0;        // per byte between different ranks, one layer (both directions counted)
  double capacity_layer = 0;   // per MoE layer under a finite capacity factor
  double capacity_refine = 0;  // per such layer where assignments were dropped
  std::vector<std::string> assumptions;
};

// One simulated (or traced) step: [ranks] work, [layers * ranks] expert loads and active experts,
// [layers] bytes between different ranks and assignments dropped; whether capacity was applied.
struct StepWork {
  std::span<const server::RankWork> ranks;
  std::span<const std::int64_t> expert_load;
  std::span<const std::int64_t> active_experts;
  std::span<const std::int64_t> wire_bytes;
  std::span<const std::int64_t> dropped;
  bool capacity = false;
};

struct StepSeconds {
  double total = 0;
  double moe = 0;  // the MoE layers' share: per-layer fixed cost, experts and exchange
};

StepSeconds step_seconds(const StepCost& cost, const StepWork& work);

// Reads a cost file ({"name", "model": {...}, "cores", "expert_time", "seconds": {...}, "assumptions"});
// std::runtime_error naming the file and the field at fault.
StepCost read_step_cost(const std::filesystem::path& path);
nlohmann::json to_json(const StepCost& cost);

}  // namespace capserve::tools
