#pragma once
// The capacity stage of an MoE layer (parallel/README.md): the step's scope (how many tokens the step has
// over the ranks, where this rank's start) and the call into the one capacity implementation, the shared
// index logic (kernels/moe/index_logic.h) run by the host executor — the very decisions the CUDA kernels
// make. In global scope it takes small allreduces through the Communicator (per-bin counts, then per-bin
// 256-bucket histograms of the selection keys until each full bin's threshold is exact), so every rank
// reaches the same per-bin decisions and the kept set is the exact global top-C whatever the number of ranks.
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "parallel/capacity_config.h"
#include "parallel/communicator.h"
#include "parallel/placement_tables.h"

namespace capserve::parallel {

// Final state of one (token, slot) assignment.
enum class SlotStatus : std::uint8_t { kept = 0, dropped = 1, rerouted = 2 };

// One layer's routing of this rank's tokens: tensors of the backend, modified in place.
struct LayerRouting {
  kernels::Tensor probs;    // f32 [T, E]: router probabilities
  kernels::Tensor experts;  // int32 [T, k]: in: the model's choice; out: -1 where dropped
  kernels::Tensor weights;  // f32 [T, k]: gate weights; 0 where dropped
  kernels::Tensor status;   // u8 [T, k]: out, SlotStatus
  kernels::Tensor exempt;   // u8 [T] or empty: 1 = never dropped (phase not scheduled, protected request)
  kernels::Tensor totals;   // int64 [2]: out, slots dropped and rerouted
  bool normalized = false;  // weights are probs / sum of the top-k probs (norm_topk_prob)
  float scaling = 1.0F;     // then multiplied by this (routed_scaling_factor)
};

class CapacityStage {
 public:
  // `data` (the backend's device) reduces the selection counts of global scope; `control` (host memory)
  // gathers the step's token counts. The same group; one host communicator may be both.
  CapacityStage(CapacityConfig config, Communicator& data, Communicator& control);
  CapacityStage(CapacityConfig config, Communicator& comm) : CapacityStage(std::move(config), comm, comm) {}

  [[nodiscard]] const CapacityConfig& config() const { return config_; }
  // The step's tokens over the scope: all ranks in global scope (the same on every rank), else this rank's.
  [[nodiscard]] std::int64_t total_tokens() const { return total_tokens_; }

  // Once per step, before the layers, on every rank: this rank's token count, and how many of them are exempt
  // from capacity (the phase it leaves alone). In global scope this is one allgather (token offsets, the
  // global count, whether any rank has exempt tokens); it is skipped when no layer is active.
  void begin_step(std::int64_t local_tokens, std::int64_t exempt_tokens = 0);

  // The capacity bound of the step's layer as the sizes of a fixed exchange (TokenDispatcher::Blocks) and of
  // each local expert's rows, the same on every rank: when the layer is active at expert granularity, every
  // rank knows the step's token counts (global scope, or a single rank) and no token of any rank is exempt.
  // Expert e keeps at most C = ceil(gamma * T * k / E) slots of the step's T tokens, so a rank sends a peer
  // hosting n experts at most min(its tokens, n * C) rows and min(its tokens * min(k, n), n * C) entries.
  struct FixedBounds {
    std::int64_t rows = 0;         // per peer block
    std::int64_t entries = 0;      // per peer block
    std::int64_t expert_rows = 0;  // per local expert: C
  };
  // `peer_experts`: the most experts one rank hosts in this layer.
  [[nodiscard]] std::optional<FixedBounds> fixed_bounds(std::int64_t layer, std::int64_t top_k,
                                                        std::int64_t num_experts,
                                                        std::int64_t peer_experts) const;
  // The largest FixedBounds of any active layer for steps of at most `tokens` tokens over all ranks (none on
  // a rank), for sizing buffers at start-up.
  [[nodiscard]] std::optional<FixedBounds> largest_fixed_bounds(std::int64_t tokens, std::int64_t top_k,
                                                                std::int64_t num_experts,
                                                                std::int64_t peer_experts) const;

  // Applies the layer's capacity in place on the backend; when the config is inactive for the layer every
  // slot stays kept and no collective runs. All ranks must call it for the same layers. `tables` are the
  // layer's placement on the backend's device.
  void apply(kernels::Backend& backend, std::int64_t layer, const LayerTables& tables,
             const LayerRouting& routing);

 private:
  [[nodiscard]] bool global() const { return config_.scope == CapacityScope::global && comm_.size() > 1; }

  CapacityConfig config_;
  Communicator& comm_;
  Communicator& control_;
  bool any_active_ = false;
  std::int64_t local_tokens_ = 0;
  std::int64_t token_offset_ = 0;       // global index of this rank's first token
  std::int64_t total_tokens_ = 0;       // tokens of the step over the scope (all ranks, or this rank)
  std::int64_t max_rank_tokens_ = 0;    // the most tokens of one rank (known in global scope or on one rank)
  bool any_exempt_ = false;             // some rank has exempt tokens this step
  std::vector<std::int64_t> gathered_;  // [ranks, 2]: tokens, exempt tokens
};

}  // namespace capserve::parallel
