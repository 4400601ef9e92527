#include "runtime/moe_block.h"

#include <algorithm>
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

// The receiver's grouping of `rows` received rows with their `entries` into `s`'s slots; the caller sets
// where each source's entries and rows are.
kernels::ReceivedGroups received_groups(kernels::Backend& backend, MoeScratch& s, const Tensor& entries,
                                        std::int64_t rows, std::int64_t top_k, std::int64_t num_local) {
  kernels::ReceivedGroups g;
  g.entries = entries;
  g.experts = backend.scratch(s.local_experts, DType::i32, {rows, top_k});
  g.weights = backend.scratch(s.local_weights, DType::f32, {rows, top_k});
  g.offsets = backend.scratch(s.group_offsets, DType::i64, {num_local + 1});
  g.position = backend.scratch(s.group_position, DType::i64, {rows, top_k});
  g.row_source = backend.scratch(s.group_rows, DType::i32, {rows * top_k});
  return g;
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

namespace {

// The counted exchange: the host reads the exchange sizes, then the rows of each local expert.
double counted_stages(kernels::Backend& backend, parallel::TokenDispatcher& dispatcher,
                      std::span<const kernels::ExpertWeights> local, const Tensor& h, const Tensor& counts,
                      std::int64_t top_k, MoeScratch& s, const Tensor& out) {
  const std::int64_t hidden = h.row_numel();
  s.counts_host.resize(static_cast<std::size_t>(counts.numel()));
  backend.to_host(counts, bytes_of(s.counts_host), HostSync::moe_dispatch);
  const parallel::TokenDispatcher::Received in = dispatcher.send(backend, h, s.counts_host);

  // Experts: the received rows grouped by local expert, the grouped FFN, each row's gate-weighted sum.
  const auto start = Clock::now();
  const std::int64_t in_rows = in.rows.dim(0);
  const auto num_local = static_cast<std::int64_t>(local.size());
  kernels::ReceivedGroups groups = received_groups(backend, s, in.entries, in_rows, top_k, num_local);
  groups.entry_start = in.entry_start;
  groups.row_start = in.row_start;
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
  dispatcher.combine(backend, results, out);
  return expert_seconds;
}

// Expert e's rows at [e * rows, e * rows + its count) of the fixed form's expert blocks: host offsets that
// depend on no routing.
std::span<const std::int64_t> expert_block_offsets(MoeScratch& s, std::int64_t num_local, std::int64_t rows) {
  s.expert_offsets_host.resize(static_cast<std::size_t>(num_local + 1));
  for (std::int64_t e = 0; e <= num_local; ++e) s.expert_offsets_host[static_cast<std::size_t>(e)] = e * rows;
  return s.expert_offsets_host;
}

// The fixed form: blocks per peer and per local expert, sized by the capacity bound; the host reads nothing.
// An expert block's rows past its count are zeros the FFN computes on and nothing reads.
double block_stages(kernels::Backend& backend, parallel::TokenDispatcher& dispatcher,
                    std::span<const kernels::ExpertWeights> local, const Tensor& h, const Tensor& counts,
                    std::int64_t top_k, const parallel::CapacityStage::FixedBounds& bounds,
                    const Tensor& overflow, MoeScratch& s, const Tensor& out) {
  const std::int64_t hidden = h.row_numel();
  const parallel::TokenDispatcher::Blocks blocks{bounds.rows, bounds.entries};
  const parallel::TokenDispatcher::ReceivedBlocks in =
      dispatcher.send_blocks(backend, h, counts, blocks, overflow);

  const auto start = Clock::now();
  const std::int64_t in_rows = in.rows.dim(0);
  const auto num_local = static_cast<std::int64_t>(local.size());
  kernels::ReceivedGroups groups = received_groups(backend, s, in.entries, in_rows, top_k, num_local);
  groups.entry_counts = in.entry_counts;
  groups.entry_block = blocks.entries;
  groups.row_block = blocks.rows;
  backend.group_received(groups);
  const std::int64_t expert_rows = bounds.expert_rows;
  const Tensor index = backend.scratch(s.expert_index, DType::i32, {num_local * expert_rows});
  backend.block_index(groups.offsets, groups.row_source, expert_rows, index, overflow);
  const Tensor position = backend.scratch(s.expert_position, DType::i64, {in_rows, top_k});
  if (num_local > 0) backend.block_positions(groups.position, groups.offsets, expert_rows, position);
  const Tensor expert_in = backend.scratch(s.grouped_in, DType::f32, {num_local * expert_rows, hidden});
  const Tensor expert_out = backend.scratch(s.grouped_out, DType::f32, {num_local * expert_rows, hidden});
  const Tensor results = backend.scratch(s.results, DType::f32, {in_rows, hidden});
  backend.take_rows(in.rows, index, expert_in);
  backend.grouped_expert_ffn(expert_in, expert_block_offsets(s, num_local, expert_rows), local, expert_out);
  if (num_local > 0) {
    backend.combine(expert_out, position, groups.weights, results);
  } else {
    backend.zero(results);
  }
  const double expert_seconds = seconds_since(start);
  dispatcher.combine_blocks(backend, results, blocks, out);
  return expert_seconds;
}

}  // namespace

double expert_parallel_stages(kernels::Backend& backend, parallel::TokenDispatcher& dispatcher,
                              const parallel::LayerTables& tables,
                              std::span<const kernels::ExpertWeights> local, const Tensor& h,
                              const Tensor& experts, const Tensor& gate, MoeScratch& s, const Tensor& out,
                              const ExchangeForm& form) {
  // What the caller does not collect goes to the scratch's own report.
  const Tensor own = backend.scratch(s.own_report, DType::i64, {2});
  const Tensor rows_sent = form.rows_sent.empty() ? own.rows(0, 1) : form.rows_sent;
  const Tensor overflow = form.overflow.empty() ? own.rows(1, 1) : form.overflow;
  const Tensor counts = backend.scratch(s.counts, DType::i64, {dispatcher.count_values()});
  dispatcher.plan(backend, experts, gate, tables, counts, rows_sent);
  const std::int64_t top_k = experts.row_numel();
  return form.fixed
             ? block_stages(backend, dispatcher, local, h, counts, top_k, *form.fixed, overflow, s, out)
             : counted_stages(backend, dispatcher, local, h, counts, top_k, s, out);
}

void reserve_moe_scratch(kernels::Backend& backend, const ModelConfig& config,
                         std::span<const kernels::ExpertWeights> local, std::int64_t tokens,
                         const std::optional<parallel::CapacityStage::FixedBounds>& fixed, std::int64_t ranks,
                         MoeScratch& s) {
  const std::int64_t top_k = config.top_k;
  const std::int64_t hidden = config.hidden_size;
  const auto num_local = static_cast<std::int64_t>(local.size());
  // The receiver's grouping of its most rows with no entries: every slot and offset it writes, and the
  // backend's grouping workspace at that size. The starts are four zeros (one source, nothing sent).
  const std::int64_t block_rows = fixed ? ranks * fixed->rows : 0;
  const std::int64_t received = std::max(tokens, block_rows);
  const Tensor starts = backend.scratch(s.counts, DType::i64, {std::max<std::int64_t>(4, 4 * ranks)});
  backend.zero(starts);
  kernels::ReceivedGroups groups = received_groups(
      backend, s, Tensor(nullptr, DType::u8, backend.device(), {0, 1}), received, top_k, num_local);
  groups.entry_start = starts.rows(0, 2);
  groups.row_start = starts.rows(2, 2);
  backend.group_received(groups);
  (void)backend.scratch(s.own_report, DType::i64, {2});
  const std::int64_t expert_rows = fixed ? num_local * fixed->expert_rows : 0;
  const std::int64_t grouped = std::max(tokens * top_k, expert_rows);
  const Tensor grouped_in = backend.scratch(s.grouped_in, DType::f32, {grouped, hidden});
  const Tensor grouped_out = backend.scratch(s.grouped_out, DType::f32, {grouped, hidden});
  (void)backend.scratch(s.results, DType::f32, {received, hidden});
  if (fixed) {
    (void)backend.scratch(s.expert_index, DType::i32, {expert_rows});
    (void)backend.scratch(s.expert_position, DType::i64, {block_rows, top_k});
  }
  if (local.empty()) return;
  // One expert given the most rows one expert can get: the backend's per-expert buffers at their largest (the
  // values are whatever the buffers hold; only the sizes matter).
  const std::int64_t most = std::max(tokens, fixed ? fixed->expert_rows : 0);
  const std::int64_t all[2] = {0, most};
  backend.grouped_expert_ffn(grouped_in.rows(0, most), all, local.first(1), grouped_out.rows(0, most));
}

void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               const Tensor& h, const Tensor& out, MoeScratch& s, MoeLayerContext& ctx) {
  const std::int64_t rows = h.dim(0);
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t top_k = config.top_k;
  parallel::MoeLayerStats& stats = ctx.stats;
  // With replicated experts, the entries go to copies (slots) of their experts before dispatch.
  const bool replicated = !ctx.tables.first_slots.empty();
  const std::int64_t num_copies = replicated ? ctx.tables.owners.numel() : 0;
  const parallel::LayerReport layout{num_experts, num_copies};
  const Tensor totals = ctx.report.rows(parallel::LayerReport::kDropped, 2);
  const Tensor routed_load = ctx.report.rows(parallel::LayerReport::kRoutedLoad, num_experts);
  const Tensor kept_load = ctx.report.rows(layout.kept_load(), num_experts);

  // Router.
  const Tensor logits = backend.scratch(s.router_logits, DType::f32, {rows, num_experts});
  const Tensor probs = backend.scratch(s.probs, DType::f32, {rows, num_experts});
  const Tensor experts = backend.scratch(s.experts, DType::i32, {rows, top_k});
  const Tensor gate = backend.scratch(s.weights, DType::f32, {rows, top_k});
  backend.linear(h, weights.router, {}, logits);
  backend.route(router_params(config, rows), logits, weights.router_bias, probs, experts, gate);
  backend.count_experts(experts, routed_load);
  const Tensor copies = replicated ? backend.scratch(s.copies, DType::i32, {rows, top_k}) : experts;
  if (replicated) {
    backend.assign_copies(experts, ctx.tables.first_slots, ctx.tables.rank, copies);
    backend.count_experts(copies, ctx.report.rows(layout.routed_copy_load(), num_copies));
  }

  // Capacity.
  auto start = Clock::now();
  const Tensor status = backend.scratch(s.status, DType::u8, {rows, top_k});
  ctx.capacity.apply(backend, ctx.layer, ctx.tables,
                     {probs, experts, gate, status, ctx.exempt, totals, config.norm_topk_prob,
                      static_cast<float>(config.router.scaling)});
  backend.count_experts(experts, kept_load);
  if (replicated) {
    backend.assign_copies(experts, ctx.tables.first_slots, ctx.tables.rank, copies);
    backend.count_experts(copies, ctx.report.rows(layout.kept_copy_load(), num_copies));
  }
  backend.count_slot_states(status, ctx.row_dropped, ctx.row_rerouted);
  stats.scheduler_seconds += seconds_since(start);

  ExchangeForm form;
  form.rows_sent = ctx.report.rows(parallel::LayerReport::kRowsSent, 1);
  form.overflow = ctx.overflow;
  if (ctx.fixed_max_tokens > 0 && ctx.capacity.total_tokens() <= ctx.fixed_max_tokens) {
    form.fixed = ctx.capacity.fixed_bounds(ctx.layer, top_k, num_experts, ctx.tables.peer_experts);
  }
  stats.expert_seconds += expert_parallel_stages(backend, ctx.dispatcher, ctx.tables, weights.experts, h,
                                                 copies, gate, s, out, form);

  stats.tokens += rows;
  stats.assignments += rows * top_k;
  const parallel::DispatchCounters& moved = ctx.dispatcher.counters();
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
