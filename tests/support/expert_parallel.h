#pragma once
// One MoE layer's Dispatch, Experts and Combine (runtime::expert_parallel_stages) over host vectors, for
// tests that route themselves and run on the CPU backend.
#include <cstdint>
#include <span>

#include "kernels/backend.h"
#include "parallel/placement_tables.h"
#include "parallel/token_dispatcher.h"
#include "runtime/moe_block.h"

namespace capserve::testing {

struct ExpertParallelLayer {
  kernels::Backend& backend;
  parallel::TokenDispatcher& dispatcher;
  const parallel::LayerTables& tables;
  std::span<const kernels::ExpertWeights> local;
  runtime::MoeScratch scratch{};
  runtime::ExchangeForm form{};  // the counted exchange unless a test sets blocks

  // out [tokens, hidden] = the gate-weighted sum of each token's experts ([tokens, top_k], -1 dropped).
  void run(std::span<const float> h, std::int64_t tokens, std::int64_t hidden, std::int64_t top_k,
           std::span<const std::int32_t> experts, std::span<const float> weights, std::span<float> out) {
    const auto n = static_cast<std::size_t>(tokens);
    const auto k = static_cast<std::size_t>(top_k);
    const auto w = static_cast<std::size_t>(hidden);
    runtime::expert_parallel_stages(backend, dispatcher, tables, local,
                                    kernels::Tensor::host(h.first(n * w), {tokens, hidden}),
                                    kernels::Tensor::host(experts.first(n * k), {tokens, top_k}),
                                    kernels::Tensor::host(weights.first(n * k), {tokens, top_k}), scratch,
                                    kernels::Tensor::host(out.first(n * w), {tokens, hidden}), form);
  }
};

}  // namespace capserve::testing
