#include "runtime/moe_block.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace capserve::runtime {

void route_softmax_topk(std::span<const float> router_logits, std::int64_t rows, std::int64_t num_experts,
                        std::int64_t top_k, bool normalize, Routing& out, const RouterConfig& router) {
  out.experts.resize(static_cast<std::size_t>(rows * top_k));
  out.weights.resize(static_cast<std::size_t>(rows * top_k));
  out.probs.resize(static_cast<std::size_t>(rows * num_experts));
  out.eligible.assign(static_cast<std::size_t>(num_experts), 1);
  const std::int64_t group_size = num_experts / router.n_group;
  const bool limited = router.topk_group < router.n_group;
  const auto scaling = static_cast<float>(router.scaling);
  for (std::int64_t t = 0; t < rows; ++t) {
    const float* logit = router_logits.data() + t * num_experts;
    float* probs = out.probs.data() + t * num_experts;
    const float mx = *std::max_element(logit, logit + num_experts);
    float sum = 0.0F;
    for (std::int64_t e = 0; e < num_experts; ++e) {
      probs[e] = std::exp(logit[e] - mx);
      sum += probs[e];
    }
    for (std::int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
    if (limited) {
      // The topk_group groups with the highest best-expert probability (ties to the lower group) are
      // eligible.
      std::fill(out.eligible.begin(), out.eligible.end(), 0);
      const auto group_best = [&](std::int64_t g) {
        return *std::max_element(probs + g * group_size, probs + (g + 1) * group_size);
      };
      for (std::int64_t chosen = 0; chosen < router.topk_group; ++chosen) {
        std::int64_t best = -1;
        for (std::int64_t g = 0; g < router.n_group; ++g) {
          if (out.eligible[static_cast<std::size_t>(g * group_size)] != 0) continue;
          if (best < 0 || group_best(g) > group_best(best)) best = g;
        }
        std::fill_n(out.eligible.begin() + best * group_size, group_size, 1);
      }
    }
    std::int32_t* ids = out.experts.data() + t * top_k;
    float* w = out.weights.data() + t * top_k;
    // Selection of the k best by repeated scan: k is small (2..8) and E modest, so this beats a sort.
    for (std::int64_t s = 0; s < top_k; ++s) {
      std::int64_t best = -1;
      for (std::int64_t e = 0; e < num_experts; ++e) {
        if (out.eligible[static_cast<std::size_t>(e)] == 0) continue;
        if (std::find(ids, ids + s, static_cast<std::int32_t>(e)) != ids + s) continue;
        if (best < 0 || probs[e] > probs[best]) best = e;
      }
      ids[s] = static_cast<std::int32_t>(best);
      w[s] = probs[best];
    }
    if (normalize) {
      float total = 0.0F;
      for (std::int64_t s = 0; s < top_k; ++s) total += w[s];
      for (std::int64_t s = 0; s < top_k; ++s) w[s] /= total;
    }
    if (scaling != 1.0F) {
      for (std::int64_t s = 0; s < top_k; ++s) w[s] *= scaling;
    }
  }
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
