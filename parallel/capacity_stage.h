#pragma once
// The capacity stage of an MoE layer (parallel/README.md): the step's scope (how many tokens the step has
// over the ranks, where this rank's start) and the call into the one capacity implementation, the shared
// index logic (kernels/moe/index_logic.h) run by the host executor — the very decisions the CUDA kernels
// make. In global scope it takes small allreduces through the Communicator (per-bin counts, then per-bin
// 256-bucket histograms of the selection keys until each full bin's threshold is exact), so every rank
// reaches the same per-bin decisions and the kept set is the exact global top-C whatever the number of ranks.
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/capacity_config.h"
#include "parallel/communicator.h"
#include "parallel/expert_placement.h"

namespace capserve::parallel {

// Final state of one (token, slot) assignment.
enum class SlotStatus : std::uint8_t { kept = 0, dropped = 1, rerouted = 2 };

// One layer's routing of this rank's tokens, modified in place.
struct LayerRouting {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t num_experts = 0;
  std::span<const float> probs;          // [tokens, num_experts]: router probabilities
  std::span<std::int32_t> experts;       // [tokens, top_k]: in: the model's choice; out: -1 where dropped
  std::span<float> weights;              // [tokens, top_k]: gate weights; 0 where dropped
  std::span<SlotStatus> status;          // [tokens, top_k]: out
  std::span<const std::uint8_t> exempt;  // [tokens] or empty: 1 = never dropped (phase not scheduled)
  bool normalized = false;               // weights are probs / sum of the top-k probs (norm_topk_prob)
  float scaling = 1.0F;                  // then multiplied by this (routed_scaling_factor)
};

// This rank's counts for one layer.
struct LayerCounts {
  std::int64_t dropped = 0;   // slots left without an expert
  std::int64_t rerouted = 0;  // slots moved to another expert
};

class CapacityStage {
 public:
  CapacityStage(CapacityConfig config, Communicator& comm);

  [[nodiscard]] const CapacityConfig& config() const { return config_; }

  // Once per step, before the layers, on every rank: this rank's token count. In global scope this is one
  // allgather (token offsets and the global count); it is skipped when no layer is active.
  void begin_step(std::int64_t local_tokens);

  // Applies the layer's capacity in place; a no-op (no collective) when the config is inactive for the layer.
  // All ranks must call it for the same layers.
  LayerCounts apply(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& routing);

 private:
  [[nodiscard]] bool global() const { return config_.scope == CapacityScope::global && comm_.size() > 1; }

  CapacityConfig config_;
  Communicator& comm_;
  bool any_active_ = false;
  std::int64_t local_tokens_ = 0;
  std::int64_t token_offset_ = 0;  // global index of this rank's first token
  std::int64_t total_tokens_ = 0;  // tokens of the step over the scope (all ranks, or this rank)
  std::vector<std::int64_t> gathered_;
  std::vector<std::int32_t> bin_experts_;  // device granularity: routed experts per rank
  std::vector<std::uint64_t> workspace_;   // the index logic's, grow-only
};

}  // namespace capserve::parallel
