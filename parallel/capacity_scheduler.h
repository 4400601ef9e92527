#pragma once
// Capacity-aware scheduling of one MoE layer's routing (parallel/README.md): a pure function of the local
// tokens' router output, the placement and the config, plus — in global scope — small allreduces through the
// Communicator (per-bin counts, then per-bin 256-bucket histograms of the selection keys until each full
// bin's threshold is exact). Every rank reaches the same per-bin decisions, so the kept set is the exact
// global top-C whatever the number of ranks the tokens are split over.
//
// Selection key of an assignment, larger wins: (score << 32) | ~(global token index * top_k + slot). The low
// half makes keys unique (ties go to the earlier token, then the earlier slot), so "the C largest keys" is
// one exact set.
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

class CapacityScheduler {
 public:
  CapacityScheduler(CapacityConfig config, Communicator& comm);

  [[nodiscard]] const CapacityConfig& config() const { return config_; }

  // Once per step, before the layers, on every rank: this rank's token count. In global scope this is one
  // allgather (token offsets and the global count); it is skipped when no layer is active.
  void begin_step(std::int64_t local_tokens);

  // Applies the layer's capacity in place; a no-op (no collective) when the config is inactive for the layer.
  // All ranks must call it for the same layers.
  LayerCounts apply(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& routing);

 private:
  // Sets cand_keep_ so that each bin keeps the `capacity[b]` largest candidate keys over the scope; counts_
  // holds each bin's candidate count over the scope.
  void select_per_bin(std::int64_t nbins, std::span<const std::int64_t> capacity);
  [[nodiscard]] std::uint64_t key(std::int64_t layer, std::int64_t token, std::int64_t slot,
                                  std::int32_t expert, float weight, std::int64_t top_k,
                                  std::int64_t num_experts) const;
  void reroute(std::int64_t layer, const ExpertPlacement& placement, LayerRouting& r);
  [[nodiscard]] bool global() const { return config_.scope == CapacityScope::global && comm_.size() > 1; }

  CapacityConfig config_;
  Communicator& comm_;
  bool any_active_ = false;
  std::int64_t local_tokens_ = 0;
  std::int64_t token_offset_ = 0;  // global index of this rank's first token
  std::int64_t total_tokens_ = 0;  // tokens of the step over the scope (all ranks, or this rank)
  std::vector<std::int64_t> gathered_;

  // Grow-only scratch, reused across layers and steps. The candidate list is this rank's assignments that
  // take part in a selection: bin, key and the keep decision of each.
  std::vector<std::int32_t> cand_bin_;
  std::vector<std::uint64_t> cand_key_;
  std::vector<std::uint8_t> cand_keep_;
  std::vector<std::int64_t> cand_slot_;      // index into the [tokens, top_k] arrays
  std::vector<std::int32_t> cand_expert_;    // reroutes: the expert the slot would move to
  std::vector<std::int64_t> counts_;         // per bin: candidates, exempt
  std::vector<std::int64_t> capacity_;       // per bin
  std::vector<std::int64_t> cand_capacity_;  // per bin: capacity left for candidates after exempt slots
  std::vector<std::int64_t> room_;           // per bin: capacity left
  std::vector<std::int64_t> hist_;           // per unresolved bin: 256 buckets
  std::vector<std::int32_t> hist_row_;       // per bin: its row in hist_, -1 when resolved
  std::vector<std::int32_t> unresolved_;     // bins still searching their threshold
  std::vector<std::uint64_t> prefix_;        // per bin: the key bits fixed so far
  std::vector<std::int64_t> need_;           // per bin: keys still to keep below the fixed prefix
  std::vector<std::uint64_t> threshold_;     // per bin: keep keys >= threshold
  std::vector<std::uint8_t> take_all_;       // per bin
  std::vector<std::uint8_t> take_none_;      // per bin
  std::vector<std::int32_t> original_;       // [tokens, top_k]: the model's experts, for "already chosen"
  std::vector<float> denominator_;           // [tokens]: sum of the original top-k probs
  std::vector<float> original_weight_sum_;   // [tokens]
  std::vector<std::int32_t> local_choice_;   // [tokens, m]: expanded fallback experts
};

}  // namespace capserve::parallel
