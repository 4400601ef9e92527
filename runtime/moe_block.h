#pragma once
// The MoE feed-forward block: router (fp32 softmax, top-k, optional renormalization), tokens grouped by
// expert (permute), one SwiGLU GEMM chain per expert, gate-weighted unpermute, plus the optional
// sigmoid-gated shared expert.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
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

// Softmax over the router logits [rows, num_experts] in fp32, top-k (ties to the lower expert id), then the
// weights renormalized to sum to 1 when `normalize` is set.
void route_softmax_topk(std::span<const float> router_logits, std::int64_t rows, std::int64_t num_experts,
                        std::int64_t top_k, bool normalize, Routing& out);

// Grow-only buffers reused across layers and steps.
struct MoeScratch {
  std::vector<float> router_logits;
  Routing routing;
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> slot_row;  // (token * top_k + slot) -> row in the permuted buffers
  std::vector<float> permuted_in;
  std::vector<float> permuted_out;
  std::vector<float> shared_out;
  std::vector<float> shared_gate;
};

// out[rows, hidden] = MoE(h); out is overwritten.
void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               std::span<const float> h, std::int64_t rows, std::span<float> out, MoeScratch& scratch);

}  // namespace capserve::runtime
