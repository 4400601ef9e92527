#pragma once
// The MoE feed-forward block of one layer in five stages (runtime/README.md): Router (fp32 softmax or
// sigmoid, top-k, optionally group-limited, normalisation, scaling) -> Capacity (drop / reroute) -> Dispatch
// (with replicated experts each kept entry first assigned one of its expert's copies; each token's row once
// to every rank hosting its kept experts) -> Experts (grouped SwiGLU of the received
// rows, gate-weighted per row) -> Combine (the rows back, summed per token); plus the optional shared expert
// (sigmoid-gated, or ungated as DeepSeek's), local dense compute that never enters the all-to-all and is
// never dropped. Every stage is backend operations on the backend's tensors. The layer's counts go into the
// step's report on the device (parallel::LayerReport), which the host reads with the step's one
// synchronisation. The exchange takes one of two forms (runtime/README.md, "Decode without host waits"):
// counted, where the host reads the exchange sizes (HostSync::moe_dispatch) and the expert group sizes
// (HostSync::moe_groups); or, under a capacity bound every rank knows, fixed-size blocks, where it reads
// nothing.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "parallel/capacity_stage.h"
#include "parallel/moe_stats.h"
#include "parallel/placement_tables.h"
#include "parallel/token_dispatcher.h"
#include "runtime/model_config.h"
#include "runtime/model_weights.h"

namespace capserve::runtime {

// The router of `config` over `rows` tokens: softmax, top-k among the topk_group best groups, the weights
// renormalised when norm_topk_prob is set and multiplied by the router's scaling.
kernels::moe::RouterParams router_params(const ModelConfig& config, std::int64_t rows);

// Grow-only buffers of the backend reused across layers and steps.
struct MoeScratch {
  kernels::Buffer router_logits, probs, experts, copies, weights, status, counts, own_report;
  kernels::Buffer local_experts, local_weights, group_offsets, group_position, group_rows, grouped_in,
      grouped_out, results;
  kernels::Buffer expert_index, expert_position;  // the fixed form's rows in per-expert blocks
  kernels::Buffer shared_out, shared_gate;
  std::vector<std::int64_t> counts_host, group_offsets_host, expert_offsets_host;
};

// Which form a layer's exchange takes, and where it reports.
struct ExchangeForm {
  // Fixed-size blocks of these sizes (CapacityStage::fixed_bounds); none: the counted exchange.
  std::optional<parallel::CapacityStage::FixedBounds> fixed;
  kernels::Tensor rows_sent;  // int64 [1]: hidden rows this rank dispatches; empty: not reported
  kernels::Tensor overflow;   // int64 [1]: rows and entries past their blocks, added to; empty: not reported
};

// The expert-parallel machinery one MoE layer runs through, and where its statistics go.
struct MoeLayerContext {
  std::int64_t layer = 0;
  const parallel::LayerTables& tables;  // the layer's placement on the backend
  parallel::CapacityStage& capacity;
  parallel::TokenDispatcher& dispatcher;
  kernels::Tensor exempt;             // u8 [rows] or empty: rows the capacity scheduler never drops
  parallel::MoeLayerStats& stats;     // this rank's host-side share (tokens, times), added to
  kernels::Tensor report;             // int64 [LayerReport::size()]: the layer's counts, zeroed by the caller
  kernels::Tensor row_dropped;        // int64 [rows]: slots dropped per row, added to
  kernels::Tensor row_rerouted;       // int64 [rows]: slots rerouted per row, added to
  kernels::Tensor overflow;           // int64 [1]: see ExchangeForm
  std::int64_t fixed_max_tokens = 0;  // the fixed form only for steps of at most this many tokens (all ranks)
};

// The stages after Capacity, for kept experts / gate weights [T, k] of h [T, hidden]: Dispatch, Experts over
// this rank's `local` experts, Combine into out [T, hidden], in `form`. Returns the Experts stage's seconds.
double expert_parallel_stages(kernels::Backend& backend, parallel::TokenDispatcher& dispatcher,
                              const parallel::LayerTables& tables,
                              std::span<const kernels::ExpertWeights> local, const kernels::Tensor& h,
                              const kernels::Tensor& experts, const kernels::Tensor& gate,
                              MoeScratch& scratch, const kernels::Tensor& out, const ExchangeForm& form = {});

// Sizes `scratch` and the backend's own expert buffers for any step of at most `tokens` tokens over all ranks
// together on the `local` experts of a layer (received rows at most `tokens`, grouped rows at most tokens x
// top_k, any one expert's rows at most `tokens`; in the fixed form `fixed`'s blocks over `ranks`): the
// buffers whose size depends on the routing, which one step at the largest shape need not reach
// (runtime/README.md, "Step memory").
void reserve_moe_scratch(kernels::Backend& backend, const ModelConfig& config,
                         std::span<const kernels::ExpertWeights> local, std::int64_t tokens,
                         const std::optional<parallel::CapacityStage::FixedBounds>& fixed, std::int64_t ranks,
                         MoeScratch& scratch);

// out[rows, hidden] = MoE(h); out is overwritten. Every rank calls it for every MoE layer, rows may be 0.
void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               const kernels::Tensor& h, const kernels::Tensor& out, MoeScratch& scratch,
               MoeLayerContext& context);

}  // namespace capserve::runtime
