#pragma once
// The MoE index work on the host — routing, capacity scheduling, permute: the same thread bodies
// (index_logic.h) and launch sequences (pipeline.h) the CUDA kernels run, each launch's threads one after
// another. This is the CPU path's only implementation of them, so the CPU and the device make the same
// decisions from the same inputs.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kernels/moe/pipeline.h"

namespace capserve::kernels::moe {

// One launch on the host: body(i) for i in [0, n), in order.
template <class Body>
void for_each_on_host(std::int64_t n, const Body& body) {
  for (std::int64_t i = 0; i < n; ++i) body(i);
}

// Router: probs [T, E], experts and weights [T, k].
// `bias`: the selection-only correction bias [E], or empty.
void route_on_host(const RouterParams& p, std::span<const float> logits, std::span<const float> bias,
                   std::span<float> probs, std::span<std::int32_t> experts, std::span<float> weights);

struct CapacityInputs {
  CapacityParams params;
  std::span<const float> probs;               // [T, E]
  std::span<const std::uint8_t> exempt;       // [T] or empty
  std::span<const std::int32_t> owners;       // [E] (device granularity) or empty
  std::span<const std::int32_t> bin_experts;  // [nbins] (device granularity) or empty
  std::span<const std::int32_t> local_list;   // this rank's experts, ascending (expanded)
  // Global scope: sums the values over the ranks (Communicator::allreduce_sum); empty in local scope. Then
  // params.total_tokens and token_offset are the step's token count and this rank's first token in it.
  std::function<void(std::span<std::int64_t>)> allreduce_sum;
  // Grow-only scratch reused across calls (the hot path allocates nothing once warm); null: a fresh one.
  std::vector<std::uint64_t>* workspace = nullptr;
};

struct CapacityTotals {
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
};

// One layer's scheduling in place on experts/weights [T, k]; status [T, k] gets SlotState values.
CapacityTotals schedule_capacity_on_host(const CapacityInputs& in, std::span<std::int32_t> experts,
                                         std::span<float> weights, std::span<std::uint8_t> status);

struct PermuteResult {
  std::vector<std::int64_t> offsets;    // [groups + 1]
  std::vector<std::int64_t> position;   // [T, k]: row of each slot, -1 when not here
  std::vector<std::int32_t> row_token;  // [offsets.back()]
};

// owners/local_index empty: every expert is local and its own group.
PermuteResult permute_on_host(const PermuteParams& p, std::span<const std::int32_t> experts,
                              std::span<const std::int32_t> owners,
                              std::span<const std::int32_t> local_index);

// The dispatch plan and the receiver's grouping (pipeline.h) with their views' pointers all set, each
// permute's chunk_base holding num_groups * permute_chunks + 1 elements.
void plan_dispatch_on_host(const DispatchPlanView& v);
void group_received_on_host(const ReceivedView& v);
void group_received_blocks_on_host(const ReceivedBlocksView& v);

}  // namespace capserve::kernels::moe
