#pragma once
// The expert load of a step on each rank in each balanced MoE layer ([layers, ranks]), as predicted when the
// step is planned and as realized once it ran: what the batch selector balances and how well the prediction
// did (capserve_predictor_cosine, capserve_selector_imbalance). The prediction is the running decodes'
// realized load per token times the decodes that continue, plus each prompt's predicted load scaled to the
// chunk of it the step computes.
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/moe_stats.h"
#include "server/server_metrics.h"

namespace capserve::server {

class StepLoad {
 public:
  StepLoad(int ranks, std::int64_t layers, ServerMetrics* metrics);

  // A new step's prediction starts from the decodes' expected load.
  void begin_step();
  // Adds `share` of a prompt's predicted per-rank load (the fraction of the prompt this step computes).
  void add(std::span<const float> prompt_load, double share);
  [[nodiscard]] std::span<const float> predicted() const { return predicted_; }
  // After the step: compares the prediction with the realized load of the balanced layers over
  // `step_tokens` tokens, and expects `next_decodes` decodes to weigh as much per token next step.
  void end_step(const parallel::MoeStepStats& stats, std::int64_t step_tokens, std::int64_t next_decodes);

 private:
  std::size_t ranks_;
  std::size_t layers_;
  ServerMetrics* metrics_;
  std::vector<float> decodes_;    // expected load of the next step's decodes
  std::vector<float> predicted_;  // of the step being planned
  std::vector<std::int64_t> realized_;
};

}  // namespace capserve::server
