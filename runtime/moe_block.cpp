#include "runtime/moe_block.h"

#include "kernels/moe/host_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace capserve::runtime {

void route_softmax_topk(std::span<const float> router_logits, std::int64_t rows, std::int64_t num_experts,
                        std::int64_t top_k, bool normalize, Routing& out, const RouterConfig& router) {
  out.experts.resize(static_cast<std::size_t>(rows * top_k));
  out.weights.resize(static_cast<std::size_t>(rows * top_k));
  out.probs.resize(static_cast<std::size_t>(rows * num_experts));
  kernels::moe::RouterParams p;
  p.tokens = rows;
  p.num_experts = num_experts;
  p.top_k = top_k;
  p.score = kernels::moe::RouterScore::softmax;
  p.n_group = router.n_group;
  p.topk_group = router.topk_group;
  p.normalize = normalize;
  p.scaling = static_cast<float>(router.scaling);
  kernels::moe::route_on_host(p, router_logits.first(static_cast<std::size_t>(rows * num_experts)), out.probs,
                              out.experts, out.weights);
}

void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               const kernels::Tensor& h_t, const kernels::Tensor& out_t, MoeScratch& s,
               MoeLayerContext& ctx) {
  using Clock = std::chrono::steady_clock;
  using kernels::DType;
  using kernels::Tensor;
  const std::int64_t rows = h_t.dim(0);
  const std::span<const float> h = h_t.host_span<const float>();
  const std::span<float> out = out_t.host_span<float>();
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t top_k = config.top_k;
  const auto slots = static_cast<std::size_t>(rows * top_k);

  const Tensor router_logits = backend.scratch(s.router_logits, DType::f32, {rows, num_experts});
  backend.linear(h_t, weights.router, {}, router_logits);
  route_softmax_topk(router_logits.host_span<const float>(), rows, num_experts, top_k, config.norm_topk_prob,
                     s.routing, config.router);

  parallel::MoeLayerStats& stats = ctx.stats;
  stats.tokens += rows;
  stats.assignments += rows * top_k;
  for (std::size_t a = 0; a < slots; ++a) ++stats.routed_load[static_cast<std::size_t>(s.routing.experts[a])];

  const auto scheduled = Clock::now();
  s.status.resize(slots);
  parallel::LayerRouting routing{rows,
                                 top_k,
                                 num_experts,
                                 s.routing.probs,
                                 std::span<std::int32_t>(s.routing.experts.data(), slots),
                                 std::span<float>(s.routing.weights.data(), slots),
                                 s.status,
                                 ctx.exempt,
                                 config.norm_topk_prob,
                                 static_cast<float>(config.router.scaling)};
  const parallel::LayerCounts counts = ctx.scheduler.apply(ctx.layer, ctx.placement, routing);
  stats.scheduler_seconds += std::chrono::duration<double>(Clock::now() - scheduled).count();
  stats.dropped += counts.dropped;
  stats.rerouted += counts.rerouted;
  for (std::size_t a = 0; a < slots; ++a) {
    const std::int32_t e = s.routing.experts[a];
    if (e >= 0) ++stats.expert_load[static_cast<std::size_t>(e)];
    const std::size_t row = a / static_cast<std::size_t>(top_k);
    ctx.row_dropped[row] += s.status[a] == parallel::SlotStatus::dropped ? 1 : 0;
    ctx.row_rerouted[row] += s.status[a] == parallel::SlotStatus::rerouted ? 1 : 0;
  }

  const parallel::LayerExperts experts{ctx.placement.owners(ctx.layer), ctx.placement.local_index(ctx.layer),
                                       weights.experts};
  ctx.dispatcher.run(h, rows, hidden, top_k, std::span<const std::int32_t>(s.routing.experts.data(), slots),
                     std::span<const float>(s.routing.weights.data(), slots), experts, backend, out);
  const parallel::DispatchCounters& moved = ctx.dispatcher.counters();
  stats.rows_dispatched += moved.rows_sent;
  stats.wire_bytes += moved.wire_bytes;
  stats.dispatch_seconds += moved.dispatch_seconds;
  stats.expert_seconds += moved.expert_seconds;
  stats.combine_seconds += moved.combine_seconds;

  if (!weights.shared.empty()) {
    const Tensor shared_out = backend.scratch(s.shared_out, DType::f32, {rows, hidden});
    const std::int64_t whole[2] = {0, rows};
    backend.grouped_expert_ffn(h_t, whole, weights.shared, shared_out);
    if (weights.shared_gate.empty()) {
      backend.add(out_t, shared_out);
    } else {
      const Tensor gate = backend.scratch(s.shared_gate, DType::f32, {rows});
      backend.linear(h_t, weights.shared_gate, {}, gate.reshaped({rows, 1}));
      backend.add_sigmoid_gated(out_t, shared_out, gate);
    }
  }
}

}  // namespace capserve::runtime
