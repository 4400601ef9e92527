#pragma once
// Statistics of the MoE layers: what each step's router asked for, what the capacity scheduler let through,
// how even the experts' and ranks' loads were, and where the time went. Each rank records its own tokens'
// share of a step (StepStatsRecorder); one reduction at the end of the step makes every rank hold the global
// figures; RunStats sums steps for reports (--moe-stats) and the server's metrics.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/expert_placement.h"

namespace capserve::parallel {

// max / mean of a load vector (1 for an all-zero vector: nothing is imbalanced).
double max_over_mean(std::span<const std::int64_t> loads);

struct MoeLayerStats {
  std::int64_t layer = 0;
  std::int64_t tokens = 0;
  std::int64_t assignments = 0;                // tokens * top_k
  std::int64_t dropped = 0;                    // slots left without an expert
  std::int64_t rerouted = 0;                   // slots moved to another expert
  std::vector<std::int64_t> routed_load;       // [experts]: the router's choice, before capacity
  std::vector<std::int64_t> expert_load;       // [experts]: what the experts computed
  std::vector<std::int64_t> rank_routed_load;  // [ranks]
  std::vector<std::int64_t> rank_load;         // [ranks]
  // With replication (ExpertPlacement::replicated), per slot: the router's choice and what each copy
  // computed; empty without.
  std::vector<std::int64_t> routed_slot_load;
  std::vector<std::int64_t> slot_load;
  std::int64_t rows_dispatched = 0;  // hidden rows sent, all ranks (self included)
  std::int64_t wire_bytes = 0;       // bytes between different ranks, dispatch + combine
  // Slowest rank's time in each phase.
  double scheduler_seconds = 0, dispatch_seconds = 0, expert_seconds = 0, combine_seconds = 0;

  [[nodiscard]] std::int64_t kept() const { return assignments - dropped; }
  [[nodiscard]] double expert_imbalance() const { return max_over_mean(expert_load); }
  [[nodiscard]] double routed_expert_imbalance() const { return max_over_mean(routed_load); }
  [[nodiscard]] double rank_imbalance() const { return max_over_mean(rank_load); }
  [[nodiscard]] double routed_rank_imbalance() const { return max_over_mean(rank_routed_load); }
};

// One step's figures, one entry per MoE layer (dense layers are absent).
struct MoeStepStats {
  std::vector<MoeLayerStats> layers;
};

// One MoE layer's counts as the backend writes them during a step (int64, this rank's tokens), summed over
// the ranks on the device at the step's end and read by the host with the step's one synchronisation:
// dropped and rerouted slots, hidden rows dispatched, then the routed and the kept load per expert, and with
// replication the routed and kept load per copy (slot).
struct LayerReport {
  static constexpr std::int64_t kDropped = 0;
  static constexpr std::int64_t kRerouted = 1;
  static constexpr std::int64_t kRowsSent = 2;
  static constexpr std::int64_t kRoutedLoad = 3;
  std::int64_t num_experts = 0;
  std::int64_t num_copies = 0;  // the placement's slots when replicated, else 0 (nothing per copy)
  [[nodiscard]] std::int64_t kept_load() const { return kRoutedLoad + num_experts; }
  [[nodiscard]] std::int64_t routed_copy_load() const { return kRoutedLoad + 2 * num_experts; }
  [[nodiscard]] std::int64_t kept_copy_load() const { return routed_copy_load() + num_copies; }
  [[nodiscard]] std::int64_t size() const { return kept_copy_load() + num_copies; }
};

// Filled by the MoE blocks of one rank during a forward pass: on the host what the host knows (tokens, wire
// bytes, phase times), reduced over ranks at the step's end; the device's counts (LayerReport) once they
// arrive.
class StepStatsRecorder {
 public:
  // moe_layers: the model's MoE layer indices, in order; num_copies: as LayerReport.
  StepStatsRecorder(std::vector<std::int64_t> moe_layers, std::int64_t num_experts, int num_ranks,
                    std::int64_t num_copies = 0);

  void begin_step();
  // Index of `layer` among the MoE layers.
  [[nodiscard]] MoeLayerStats& layer(std::int64_t moe_index) {
    return local_.layers[static_cast<std::size_t>(moe_index)];
  }
  // Sums the host's counts and takes the slowest rank's times over all ranks (two allreduces, every rank must
  // call).
  void reduce(Communicator& comm);
  // The device's counts, already summed over the ranks: one LayerReport per MoE layer, back to back; then
  // the per-rank loads from the placement.
  void add_reports(std::span<const std::int64_t> reports, const ExpertPlacement& placement);
  [[nodiscard]] const MoeStepStats& step() const { return local_; }

 private:
  MoeStepStats local_;
  std::vector<std::int64_t> packed_counts_;
  std::vector<double> packed_times_;
};

// Sums of many steps, per MoE layer, plus the mean per-step imbalance (the straggler seen by each step).
class RunStats {
 public:
  void add(const MoeStepStats& step);
  [[nodiscard]] std::int64_t steps() const { return steps_; }
  [[nodiscard]] const MoeStepStats& totals() const { return totals_; }
  // {"steps": n, "layers": [{"layer", "tokens", ..., "routed_load": [...], ...}]}: the file --moe-stats
  // writes and --expert-placement reads.
  [[nodiscard]] std::string to_json(const std::string& extra_config) const;

 private:
  std::int64_t steps_ = 0;
  MoeStepStats totals_;
  struct Imbalance {
    double expert = 0, routed_expert = 0, rank = 0, routed_rank = 0;
    std::int64_t steps = 0;
  };
  std::vector<Imbalance> imbalance_sum_;
};

}  // namespace capserve::parallel
