#include "runtime/moe_block.h"

#include <chrono>

namespace capserve::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::DType;
using kernels::HostSync;
using kernels::Tensor;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

template <class T>
std::span<std::byte> bytes_of(std::vector<T>& v) {
  return std::as_writable_bytes(std::span<T>(v));
}

// The receiver's grouping of `rows` received rows into `s`'s slots, from the sources' entries and starts.
kernels::ReceivedGroups received_groups(kernels::Backend& backend, MoeScratch& s, const Tensor& entries,
                                        const Tensor& entry_start, const Tensor& row_start, std::int64_t rows,
                                        std::int64_t top_k, std::int64_t num_local) {
  return {entries,
          entry_start,
          row_start,
          backend.scratch(s.local_experts, DType::i32, {rows, top_k}),
          backend.scratch(s.local_weights, DType::f32, {rows, top_k}),
          backend.scratch(s.group_offsets, DType::i64, {num_local + 1}),
          backend.scratch(s.group_position, DType::i64, {rows, top_k}),
          backend.scratch(s.group_rows, DType::i32, {rows * top_k})};
}

}  // namespace

kernels::moe::RouterParams router_params(const ModelConfig& config, std::int64_t rows) {
  kernels::moe::RouterParams p;
  p.tokens = rows;
  p.num_experts = config.num_experts;
  p.top_k = config.top_k;
  p.score = config.router.sigmoid ? kernels::moe::RouterScore::sigmoid : kernels::moe::RouterScore::softmax;
  p.n_group = config.router.n_group;
  p.topk_group = config.router.topk_group;
  p.group_score =
      config.router.group_top2_sum ? kernels::moe::GroupScore::top2_sum : kernels::moe::GroupScore::best;
  p.normalize = config.norm_topk_prob;
  p.scaling = static_cast<float>(config.router.scaling);
  return p;
}

double expert_parallel_stages(kernels::Backend& backend, parallel::TokenDispatcher& dispatcher,
                              const parallel::LayerTables& tables,
                              std::span<const kernels::ExpertWeights> local, const Tensor& h,
                              const Tensor& experts, const Tensor& gate, const Tensor& report, MoeScratch& s,
                              const Tensor& out) {
  const std::int64_t hidden = h.row_numel();
  const std::int64_t top_k = experts.row_numel();
  const std::int64_t peers = dispatcher.count_values();
  // Dispatch: the plan and count exchange, the layer's report to the host, then the rows.
  dispatcher.plan(backend, experts, gate, tables, report.rows(0, peers));
  s.report_host.resize(static_cast<std::size_t>(report.numel()));
  backend.to_host(report, bytes_of(s.report_host), HostSync::moe_dispatch);
  const parallel::TokenDispatcher::Received in = dispatcher.send(
      backend, h, std::span<const std::int64_t>(s.report_host).first(static_cast<std::size_t>(peers)));

  // Experts: the received rows grouped by local expert, the grouped FFN, each row's gate-weighted sum.
  const auto start = Clock::now();
  const std::int64_t in_rows = in.rows.dim(0);
  const auto num_local = static_cast<std::int64_t>(local.size());
  const kernels::ReceivedGroups groups =
      received_groups(backend, s, in.entries, in.entry_start, in.row_start, in_rows, top_k, num_local);
  backend.group_received(groups);
  s.group_offsets_host.resize(static_cast<std::size_t>(num_local + 1));
  backend.to_host(groups.offsets, bytes_of(s.group_offsets_host), HostSync::moe_groups);
  const std::int64_t grouped = s.group_offsets_host.back();
  const Tensor grouped_in = backend.scratch(s.grouped_in, DType::f32, {grouped, hidden});
  const Tensor grouped_out = backend.scratch(s.grouped_out, DType::f32, {grouped, hidden});
  const Tensor results = backend.scratch(s.results, DType::f32, {in_rows, hidden});
  backend.take_rows(in.rows, groups.row_source, grouped_in);
  backend.grouped_expert_ffn(grouped_in, s.group_offsets_host, local, grouped_out);
  backend.combine(grouped_out, groups.position, groups.weights, results);
  const double expert_seconds = seconds_since(start);

  // Combine.
  dispatcher.combine(backend, results, out);
  return expert_seconds;
}

void reserve_moe_scratch(kernels::Backend& backend, const ModelConfig& config,
                         std::span<const kernels::ExpertWeights> local, std::int64_t tokens, MoeScratch& s) {
  const std::int64_t top_k = config.top_k;
  const std::int64_t hidden = config.hidden_size;
  const auto num_local = static_cast<std::int64_t>(local.size());
  // The receiver's grouping of `tokens` rows with no entries: every slot and offset it writes, and the
  // backend's grouping workspace at that size. The starts are four zeros (one source, nothing sent).
  const Tensor starts = backend.scratch(s.report, DType::i64, {4});
  backend.zero(starts);
  const kernels::ReceivedGroups groups =
      received_groups(backend, s, Tensor(nullptr, DType::u8, backend.device(), {0, 1}), starts.rows(0, 2),
                      starts.rows(2, 2), tokens, top_k, num_local);
  backend.group_received(groups);
  const Tensor grouped_in = backend.scratch(s.grouped_in, DType::f32, {tokens * top_k, hidden});
  const Tensor grouped_out = backend.scratch(s.grouped_out, DType::f32, {tokens * top_k, hidden});
  (void)backend.scratch(s.results, DType::f32, {tokens, hidden});
  if (local.empty()) return;
  // One expert given every received row: the backend's per-expert buffers at their largest (the values are
  // whatever the buffers hold; only the sizes matter).
  const std::int64_t all[2] = {0, tokens};
  backend.grouped_expert_ffn(grouped_in.rows(0, tokens), all, local.first(1), grouped_out.rows(0, tokens));
}

void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               const Tensor& h, const Tensor& out, MoeScratch& s, MoeLayerContext& ctx) {
  const std::int64_t rows = h.dim(0);
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t top_k = config.top_k;
  parallel::MoeLayerStats& stats = ctx.stats;

  // The layer's one report to the host: the dispatcher's per-peer counts, then dropped and rerouted slots,
  // routed and kept load per expert, dropped and rerouted slots per row.
  const std::int64_t peers = ctx.dispatcher.count_values();
  const Tensor report = backend.scratch(s.report, DType::i64, {peers + 2 + 2 * num_experts + 2 * rows});
  const Tensor totals = report.rows(peers, 2);
  const Tensor routed_load = report.rows(peers + 2, num_experts);
  const Tensor kept_load = report.rows(peers + 2 + num_experts, num_experts);
  const Tensor row_dropped = report.rows(peers + 2 + 2 * num_experts, rows);
  const Tensor row_rerouted = report.rows(peers + 2 + 2 * num_experts + rows, rows);

  // Router.
  const Tensor logits = backend.scratch(s.router_logits, DType::f32, {rows, num_experts});
  const Tensor probs = backend.scratch(s.probs, DType::f32, {rows, num_experts});
  const Tensor experts = backend.scratch(s.experts, DType::i32, {rows, top_k});
  const Tensor gate = backend.scratch(s.weights, DType::f32, {rows, top_k});
  backend.linear(h, weights.router, {}, logits);
  backend.route(router_params(config, rows), logits, weights.router_bias, probs, experts, gate);
  backend.zero(report.rows(peers + 2, 2 * num_experts));
  backend.count_experts(experts, routed_load);

  // Capacity.
  auto start = Clock::now();
  const Tensor status = backend.scratch(s.status, DType::u8, {rows, top_k});
  ctx.capacity.apply(backend, ctx.layer, ctx.tables,
                     {probs, experts, gate, status, ctx.exempt, totals, config.norm_topk_prob,
                      static_cast<float>(config.router.scaling)});
  backend.count_experts(experts, kept_load);
  backend.count_slot_states(status, row_dropped, row_rerouted);
  stats.scheduler_seconds += seconds_since(start);

  ctx.stats.expert_seconds += expert_parallel_stages(backend, ctx.dispatcher, ctx.tables, weights.experts, h,
                                                     experts, gate, report, s, out);
  const std::span<const std::int64_t> r = s.report_host;

  // Statistics, from the report.
  const auto e = static_cast<std::size_t>(num_experts);
  const auto p = static_cast<std::size_t>(peers);
  stats.tokens += rows;
  stats.assignments += rows * top_k;
  stats.dropped += r[p];
  stats.rerouted += r[p + 1];
  for (std::size_t x = 0; x < e; ++x) {
    stats.routed_load[x] += r[p + 2 + x];
    stats.expert_load[x] += r[p + 2 + e + x];
  }
  for (std::size_t row = 0; row < static_cast<std::size_t>(rows); ++row) {
    ctx.row_dropped[row] += static_cast<std::int32_t>(r[p + 2 + 2 * e + row]);
    ctx.row_rerouted[row] +=
        static_cast<std::int32_t>(r[p + 2 + 2 * e + static_cast<std::size_t>(rows) + row]);
  }
  const parallel::DispatchCounters& moved = ctx.dispatcher.counters();
  stats.rows_dispatched += moved.rows_sent;
  stats.wire_bytes += moved.wire_bytes;
  stats.dispatch_seconds += moved.dispatch_seconds;
  stats.combine_seconds += moved.combine_seconds;

  if (!weights.shared.empty()) {
    const Tensor shared_out = backend.scratch(s.shared_out, DType::f32, {rows, hidden});
    const std::int64_t whole[2] = {0, rows};
    backend.grouped_expert_ffn(h, whole, weights.shared, shared_out);
    if (weights.shared_gate.empty()) {
      backend.add(out, shared_out);
    } else {
      const Tensor shared_gate = backend.scratch(s.shared_gate, DType::f32, {rows});
      backend.linear(h, weights.shared_gate, {}, shared_gate.reshaped({rows, 1}));
      backend.add_sigmoid_gated(out, shared_out, shared_gate);
    }
  }
}

}  // namespace capserve::runtime
