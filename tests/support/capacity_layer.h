#pragma once
// Test helpers over host vectors: the router (kernels/moe's host executor) and one layer through
// parallel::CapacityStage on a CPU backend.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe/host_executor.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/placement_tables.h"

namespace capserve::testing {

// Softmax top-k routing of logits [T, E]: probs [T, E], experts and weights [T, k].
struct HostRouting {
  std::vector<float> probs;
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
};

inline HostRouting route_softmax(std::span<const float> logits, std::int64_t T, std::int64_t E,
                                 std::int64_t k, bool normalize) {
  HostRouting r{std::vector<float>(static_cast<std::size_t>(T * E)),
                std::vector<std::int32_t>(static_cast<std::size_t>(T * k)),
                std::vector<float>(static_cast<std::size_t>(T * k))};
  kernels::moe::RouterParams p;
  p.tokens = T;
  p.num_experts = E;
  p.top_k = k;
  p.normalize = normalize;
  kernels::moe::route_on_host(p, logits, {}, r.probs, r.experts, r.weights);
  return r;
}

// The counts one layer's scheduling reports.
struct LayerCounts {
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
};

// One layer through the stage on a CPU backend, in place on host vectors, as `rank` of `placement`.
inline LayerCounts apply_layer(parallel::CapacityStage& stage, std::int64_t layer,
                               const parallel::ExpertPlacement& placement, int rank, std::int64_t n,
                               std::int64_t k, std::span<const float> probs,
                               std::vector<std::int32_t>& experts, std::vector<float>& weights,
                               std::vector<parallel::SlotStatus>& status,
                               std::span<const std::uint8_t> exempt, bool normalized, float scaling) {
  kernels::cpu::CpuBackend backend(1);
  const parallel::PlacementTables tables(backend, placement, rank);
  std::int64_t totals[2] = {-1, -1};
  const std::int64_t E = placement.num_experts();
  parallel::LayerRouting routing{
      kernels::Tensor::host(probs, {n, E}),
      kernels::Tensor::host(std::span(experts), {n, k}),
      kernels::Tensor::host(std::span(weights), {n, k}),
      kernels::Tensor::host(std::span(reinterpret_cast<std::uint8_t*>(status.data()), status.size()), {n, k}),
      exempt.empty() ? kernels::Tensor{} : kernels::Tensor::host(exempt, {n}),
      kernels::Tensor::host(std::span<std::int64_t>(totals), {2}),
      normalized,
      scaling};
  stage.apply(backend, layer, tables.layer(layer), routing);
  return {totals[0], totals[1]};
}

}  // namespace capserve::testing
