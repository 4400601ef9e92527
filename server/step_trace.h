#pragma once
// --step-trace FILE: one JSON line per engine step on rank 0, what the step computed and how long it took,
// for fitting a step cost model (tools/planner/planner_eval.py calibrate) and for looking at stragglers step
// by step:
//   {"start_s": seconds since the first step, "seconds": the step's wall time (plan to results),
//    "tokens": [per rank], "decodes": [per rank], "attention_pairs": [per rank], "decode_pairs": [per rank],
//    "expert_load": [[per rank] per MoE layer]  (assignments each rank's experts computed, after capacity),
//    "active_experts": [[per rank] per MoE layer]  (its experts that computed at least one assignment),
//    "dropped": [per MoE layer], "wire_bytes": [per MoE layer]  (between different ranks, both directions)}
// Lines are flushed as they are written, so a trace survives a killed job up to its last whole step.
// The server stops tracing (and keeps serving) when a line cannot be written.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "parallel/expert_placement.h"
#include "parallel/moe_stats.h"
#include "server/step_shape.h"

namespace capserve::server {

class StepTraceWriter {
 public:
  // Throws std::runtime_error naming the file when it cannot be created.
  explicit StepTraceWriter(const std::filesystem::path& path);

  // active_experts: [MoE layers, ranks] (active_experts() below, or a simulation's own). False when the line
  // could not be written (a full disk): the caller decides, since a trace must not stop a server.
  [[nodiscard]] bool write(std::chrono::steady_clock::time_point start, double seconds,
                           std::span<const RankWork> ranks, const parallel::MoeStepStats& stats,
                           std::span<const std::int64_t> active_experts);

 private:
  std::filesystem::path path_;
  std::ofstream out_;
  std::optional<std::chrono::steady_clock::time_point> first_;
  std::string line_;  // reused
};

// Per MoE layer and rank ([layers, ranks] into `out`), the experts `placement` puts on the rank that computed
// at least one assignment in the step.
void active_experts(const parallel::MoeStepStats& stats, const parallel::ExpertPlacement& placement,
                    std::vector<std::int64_t>& out);

}  // namespace capserve::server
