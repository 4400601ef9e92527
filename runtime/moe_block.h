#pragma once
// The MoE feed-forward block of one layer: router (fp32 softmax, top-k, optionally group-limited, optional
// renormalization, scaling), the capacity scheduler, dispatch of each token to the ranks hosting its experts,
// grouped expert SwiGLU there, gate-weighted combine back, plus the optional shared expert (sigmoid-gated, or
// ungated as DeepSeek's), which is local dense compute: it never enters the all-to-all and is never dropped.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/moe_stats.h"
#include "parallel/token_dispatcher.h"
#include "runtime/model_config.h"
#include "runtime/model_weights.h"

namespace capserve::runtime {

// Top-k routing of `rows` tokens: router probabilities [rows, num_experts] (kept for the capacity scheduler's
// reroutes), and the chosen expert ids and gate weights, [rows, top_k] each, best first.
struct Routing {
  std::vector<float> probs;
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
};

// Softmax over the router logits [rows, num_experts] in fp32, top-k (ties to the lower expert id) among the
// experts of the router's topk_group best groups (all experts when n_group is 1), then the weights
// renormalized to sum to 1 when `normalize` is set, and multiplied by the router's scaling: the shared index
// logic's router (kernels/moe), run by the host executor, so the CPU routes exactly as the CUDA kernel does.
// `probs` keeps the whole softmax: the capacity scheduler may reroute a slot outside the token's groups,
// where capacity is.
void route_softmax_topk(std::span<const float> router_logits, std::int64_t rows, std::int64_t num_experts,
                        std::int64_t top_k, bool normalize, Routing& out, const RouterConfig& router = {});

// Grow-only buffers reused across layers and steps.
struct MoeScratch {
  kernels::Buffer router_logits;
  Routing routing;
  std::vector<parallel::SlotStatus> status;
  kernels::Buffer shared_out;
  kernels::Buffer shared_gate;
};

// The expert-parallel machinery one MoE layer runs through, and where its statistics go.
struct MoeLayerContext {
  std::int64_t layer = 0;
  const parallel::ExpertPlacement& placement;
  parallel::CapacityStage& scheduler;
  parallel::TokenDispatcher& dispatcher;
  std::span<const std::uint8_t> exempt;  // [rows] or empty: rows the capacity scheduler never drops
  parallel::MoeLayerStats& stats;        // this rank's share, added to
  std::span<std::int32_t> row_dropped;   // [rows]: slots dropped per row, added to
  std::span<std::int32_t> row_rerouted;  // [rows]: slots rerouted per row, added to
};

// out[rows, hidden] = MoE(h); out is overwritten. Every rank calls it for every MoE layer, rows may be 0.
void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               const kernels::Tensor& h, const kernels::Tensor& out, MoeScratch& scratch,
               MoeLayerContext& context);

}  // namespace capserve::runtime
