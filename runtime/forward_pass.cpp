#include "runtime/forward_pass.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

namespace capserve::runtime {
namespace {

using kernels::DType;
using kernels::HostSync;
using kernels::Tensor;

template <typename T>
std::span<const std::byte> bytes_of(std::span<T> values) {
  return std::as_bytes(values);
}

}  // namespace

namespace {

std::span<const std::int64_t> stack_moe_layers(const Model& model, LayerStack stack) {
  return stack == LayerStack::decoder ? model.moe_layers() : model.mtp_moe_layers();
}

// The step's report, int64 on the backend: what the MoE layers count on the device, read by the host once
// per step. The rows past their fixed-size blocks (a broken capacity bound), one parallel::LayerReport per
// MoE layer (these first two summed over the ranks), then this rank's slots dropped and rerouted per row.
struct StepReport {
  std::int64_t layers = 0;
  parallel::LayerReport layer;
  std::int64_t rows = 0;
  static constexpr std::int64_t kOverflow = 0;
  [[nodiscard]] std::int64_t layer_at(std::int64_t moe_index) const { return 1 + moe_index * layer.size(); }
  [[nodiscard]] std::int64_t summed() const { return layer_at(layers); }  // the part summed over ranks
  [[nodiscard]] std::int64_t size() const { return summed() + 2 * rows; }
};

// The placement's slots when it replicates experts (counted per copy), else 0.
std::int64_t copy_slots(const Model& model) {
  return model.placement().replicated() ? model.placement().num_slots() : 0;
}

StepReport step_report(const Model& model, LayerStack stack, std::int64_t rows) {
  return {static_cast<std::int64_t>(stack_moe_layers(model, stack).size()),
          parallel::LayerReport{model.config().num_experts, copy_slots(model)}, rows};
}

}  // namespace

ForwardPass::ForwardPass(const Model& model, LayerStack stack)
    : model_(model),
      config_(model.config()),
      weights_(model.weights()),
      stack_(stack),
      scheduler_(stack == LayerStack::decoder ? model.capacity() : model.mtp_capacity(), model.communicator(),
                 model.control()),
      dispatcher_(model.communicator()),
      stats_({stack_moe_layers(model, stack).begin(), stack_moe_layers(model, stack).end()},
             model.config().num_experts, model.communicator().size(), copy_slots(model)) {}

void ForwardPass::router_dry_run(std::span<const std::int32_t> tokens, std::int64_t layers,
                                 std::span<std::int64_t> counts) {
  kernels::Backend& backend = model_.backend();
  const auto rows = static_cast<std::int64_t>(tokens.size());
  const std::int64_t hidden = config_.hidden_size;
  const std::int64_t experts = config_.num_experts;
  DryRunScratch& s = dry_run_;
  const Tensor ids = backend.scratch(s.tokens, DType::i32, {rows});
  const Tensor embedded = backend.scratch(s.embedded, DType::f32, {rows, hidden});
  const Tensor normed = backend.scratch(s.normed, DType::f32, {rows, hidden});
  const Tensor logits = backend.scratch(s.logits, DType::f32, {rows, experts});
  const Tensor probs = backend.scratch(s.probs, DType::f32, {rows, experts});
  const Tensor chosen = backend.scratch(s.experts, DType::i32, {rows, config_.top_k});
  const Tensor weights = backend.scratch(s.weights, DType::f32, {rows, config_.top_k});
  const std::int64_t n =
      std::min<std::int64_t>(layers, static_cast<std::int64_t>(model_.moe_layers().size()));
  const Tensor found = backend.scratch(s.counts, DType::i64, {n * experts});
  backend.zero(found);
  backend.from_host(bytes_of(tokens), ids);
  backend.embedding(ids, weights_.embed, embedded);
  for (std::int64_t i = 0; i < n; ++i) {
    const LayerWeights& lw =
        weights_.layers[static_cast<std::size_t>(model_.moe_layers()[static_cast<std::size_t>(i)])];
    backend.rms_norm(embedded, lw.post_attention_norm, static_cast<float>(config_.rms_norm_eps), normed);
    backend.linear(normed, lw.moe.router, {}, logits);
    backend.route(router_params(config_, rows), logits, lw.moe.router_bias, probs, chosen, weights);
    backend.count_experts(chosen, found.rows(i * experts, experts));
  }
  dry_run_counts_.resize(static_cast<std::size_t>(n * experts));
  backend.to_host(found, std::as_writable_bytes(std::span<std::int64_t>(dry_run_counts_)), HostSync::dry_run);
  for (std::size_t i = 0; i < dry_run_counts_.size(); ++i) counts[i] += dry_run_counts_[i];
}

void ForwardPass::reserve_routed(std::int64_t tokens) {
  kernels::Backend& backend = model_.backend();
  const std::int64_t ranks = model_.communicator().size();
  parallel::TokenDispatcher::Blocks largest;
  for (const std::int64_t layer : stack_moe_layers(model_, stack_)) {
    const std::optional<parallel::CapacityStage::FixedBounds> fixed =
        fixed_exchange_tokens_ > 0
            ? scheduler_.largest_fixed_bounds(std::min(tokens, fixed_exchange_tokens_), config_.top_k,
                                              config_.num_experts, model_.tables().layer(layer).peer_experts)
            : std::nullopt;
    if (fixed) {
      largest.rows = std::max(largest.rows, fixed->rows);
      largest.entries = std::max(largest.entries, fixed->entries);
    }
    reserve_moe_scratch(backend, config_, model_.layer(layer).moe.experts, tokens, fixed, ranks,
                        scratch_.moe);
  }
  dispatcher_.reserve(backend, tokens, config_.top_k, config_.hidden_size, largest);
}

void ForwardPass::begin_step(const ForwardBatch& batch) {
  kernels::Backend& backend = model_.backend();
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t hidden = config_.hidden_size;
  const std::int64_t half = config_.rotary_dim() / 2;
  Scratch& s = scratch_;
  Activations& a = act_;
  a.residual = backend.scratch(s.residual, DType::f32, {rows, hidden});
  a.normed = backend.scratch(s.normed, DType::f32, {rows, hidden});
  a.proj = backend.scratch(s.proj, DType::f32, {rows, hidden});
  a.cos = backend.scratch(s.cos, DType::f32, {rows, half});
  a.sin = backend.scratch(s.sin, DType::f32, {rows, half});
  model_.rope().tables(batch.positions, batch.seqs, batch.decode_rows, s.cos_host, s.sin_host,
                       s.dynamic_inv_freq);
  backend.from_host(bytes_of(std::span<const float>(s.cos_host)), a.cos);
  backend.from_host(bytes_of(std::span<const float>(s.sin_host)), a.sin);

  // Rows of the phase the capacity scheduler leaves alone, and protected requests' rows, are exempt from
  // dropping.
  const parallel::CapacityPhase phase = scheduler_.config().apply_to;
  a.exempt = {};
  std::int64_t exempt_rows = 0;
  if (phase != parallel::CapacityPhase::both || !batch.protected_rows.empty()) {
    exempt_.resize(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto row = static_cast<std::size_t>(r);
      const bool decode = !batch.decode_rows.empty() && batch.decode_rows[row] != 0;
      const bool scheduled =
          phase == parallel::CapacityPhase::both || (phase == parallel::CapacityPhase::decode) == decode;
      const bool exempt = !scheduled || (!batch.protected_rows.empty() && batch.protected_rows[row] != 0);
      exempt_[row] = exempt ? 1 : 0;
      exempt_rows += exempt ? 1 : 0;
    }
    a.exempt = backend.scratch(s.exempt, DType::u8, {rows});
    backend.from_host(std::as_bytes(std::span<const std::uint8_t>(exempt_)), a.exempt);
  }
  settle_stats();  // the previous step's, before its figures are overwritten
  a.report = backend.scratch(s.report, DType::i64, {step_report(model_, stack_, rows).size()});
  backend.zero(a.report);
  stats_.begin_step();
  scheduler_.begin_step(rows, exempt_rows);
}

void ForwardPass::end_step() {
  kernels::Backend& backend = model_.backend();
  parallel::Communicator& comm = model_.communicator();
  const StepReport layout = step_report(model_, stack_, act_.residual.dim(0));
  if (comm.size() > 1) comm.allreduce_sum(act_.report.rows(0, layout.summed()), backend.stream());
  report_rows_ = layout.rows;
  report_host_.resize(static_cast<std::size_t>(layout.size()));
  backend.to_host_later(act_.report, std::as_writable_bytes(std::span<std::int64_t>(report_host_)));
  report_pending_ = true;
  stats_.reduce(model_.control());
}

void ForwardPass::settle_stats() {
  if (!report_pending_) return;
  model_.backend().finish_host_copies(HostSync::moe_stats);
  report_pending_ = false;
  const std::span<const std::int64_t> report(report_host_);
  const StepReport layout = step_report(model_, stack_, report_rows_);
  if (const std::int64_t past = report[StepReport::kOverflow]; past > 0) {
    throw std::logic_error(
        "MoE exchange: " + std::to_string(past) +
        " rows or entries past their fixed-size blocks (the capacity bound they were sized "
        "by did not hold)");
  }
  stats_.add_reports(report.subspan(1, static_cast<std::size_t>(layout.summed() - 1)), model_.placement());
  row_counts_ = report.subspan(static_cast<std::size_t>(layout.summed()));
  run_stats_.add(stats_.step());
}

void ForwardPass::forward(const ForwardBatch& batch, KvCache& cache, const Tensor& logits,
                          const Tensor& hidden) {
  kernels::Backend& backend = model_.backend();
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  Scratch& s = scratch_;
  begin_step(batch);
  const Tensor ids = backend.scratch(s.tokens, DType::i32, {rows});
  backend.from_host(bytes_of(batch.tokens), ids);
  backend.embedding(ids, weights_.embed, act_.residual);

  for (std::int64_t layer = 0; layer < config_.num_layers; ++layer) {
    attention(layer, batch, cache);
    feed_forward(layer, rows);
  }

  const auto wanted = static_cast<std::int64_t>(batch.logit_rows.size());
  const auto eps = static_cast<float>(config_.rms_norm_eps);
  const Tensor final_rows = backend.scratch(s.final_rows, DType::f32, {wanted, config_.hidden_size});
  if (hidden.empty()) {
    backend.gather_rows(act_.residual, batch.logit_rows, final_rows);
    backend.rms_norm(final_rows, weights_.final_norm, eps, final_rows);
  } else {
    // Row-wise, so each row's state and logits are those of the form above.
    backend.rms_norm(act_.residual, weights_.final_norm, eps, hidden);
    backend.gather_rows(hidden, batch.logit_rows, final_rows);
  }
  backend.linear(final_rows, weights_.lm_head, {}, logits);
  end_step();
}

void ForwardPass::mtp_forward(std::int64_t depth, const ForwardBatch& batch, const Tensor& hidden,
                              KvCache& cache, const Tensor& logits, const Tensor& out_hidden) {
  kernels::Backend& backend = model_.backend();
  const MtpWeights& m = weights_.mtp[static_cast<std::size_t>(depth)];
  const std::int64_t layer = config_.num_layers + depth;
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t width = config_.hidden_size;
  const auto eps = static_cast<float>(config_.rms_norm_eps);
  Scratch& s = scratch_;
  begin_step(batch);
  // [enorm(embed(tokens)); hnorm(hidden)] stacked, then interleaved so that row r of [rows, 2 * hidden] is
  // its embedding and its state side by side: eh_proj's input.
  const Tensor ids = backend.scratch(s.tokens, DType::i32, {rows});
  const Tensor parts = backend.scratch(s.mtp_parts, DType::f32, {2 * rows, width});
  const Tensor joined = backend.scratch(s.mtp_joined, DType::f32, {2 * rows, width});
  const Tensor embedded = parts.rows(0, rows);
  backend.from_host(bytes_of(batch.tokens), ids);
  backend.embedding(ids, m.embed, embedded);
  backend.rms_norm(embedded, m.enorm, eps, embedded);
  backend.rms_norm(hidden, m.hnorm, eps, parts.rows(rows, rows));
  mtp_join_.resize(static_cast<std::size_t>(2 * rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    mtp_join_[static_cast<std::size_t>(2 * r)] = r;
    mtp_join_[static_cast<std::size_t>(2 * r + 1)] = rows + r;
  }
  backend.gather_rows(parts, mtp_join_, joined);
  backend.linear(joined.reshaped({rows, 2 * width}), m.eh_proj, {}, act_.residual);

  attention(layer, batch, cache);
  feed_forward(layer, rows);

  backend.gather_rows(act_.residual, batch.logit_rows, out_hidden);
  backend.rms_norm(out_hidden, m.head_norm, eps, out_hidden);
  backend.linear(out_hidden, m.lm_head, {}, logits);
  end_step();
}

void ForwardPass::attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache) {
  kernels::Backend& backend = model_.backend();
  const LayerWeights& lw = model_.layer(layer);
  const Activations& a = act_;
  backend.rms_norm(a.residual, lw.input_norm, static_cast<float>(config_.rms_norm_eps), a.normed);
  const Tensor attn =
      config_.mla ? latent_attention(layer, batch, cache) : grouped_query_attention(layer, batch, cache);
  backend.linear(attn, lw.attention.o, lw.attention.o_bias, a.proj);
  backend.add(a.residual, a.proj);
}

float ForwardPass::softmax_scale() const {
  return static_cast<float>(
      config_.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(config_.head_dim))));
}

Tensor ForwardPass::grouped_query_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache) {
  kernels::Backend& backend = model_.backend();
  const AttentionWeights& a = model_.layer(layer).attention;
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t d = config_.head_dim;
  const std::int64_t q_width = config_.num_heads * d;
  const std::int64_t kv_width = config_.num_kv_heads * d;
  const auto eps = static_cast<float>(config_.rms_norm_eps);
  Scratch& s = scratch_;
  const Tensor& normed = act_.normed;
  const Tensor q = backend.scratch(s.q, DType::f32, {rows, q_width});
  const Tensor k = backend.scratch(s.k, DType::f32, {rows, kv_width});
  const Tensor v = backend.scratch(s.v, DType::f32, {rows, kv_width});
  const Tensor attn = backend.scratch(s.attn, DType::f32, {rows, q_width});

  backend.linear(normed, a.q, a.q_bias, q);
  backend.linear(normed, a.k, a.k_bias, k);
  backend.linear(normed, a.v, a.v_bias, v);
  if (config_.qk_norm == QkNorm::whole) {
    backend.rms_norm(q, a.q_norm, eps, q);
    backend.rms_norm(k, a.k_norm, eps, k);
  } else if (config_.qk_norm == QkNorm::per_head) {
    const Tensor q_heads = q.reshaped({rows * config_.num_heads, d});
    const Tensor k_heads = k.reshaped({rows * config_.num_kv_heads, d});
    backend.rms_norm(q_heads, a.q_norm, eps, q_heads);
    backend.rms_norm(k_heads, a.k_norm, eps, k_heads);
  }
  if (config_.clip_qkv) {
    const auto c = static_cast<float>(*config_.clip_qkv);
    backend.clamp(q, c);
    backend.clamp(k, c);
    backend.clamp(v, c);
  }
  backend.rope(q, {config_.num_heads, d, 0, d, config_.interleaved_rope}, act_.cos, act_.sin);
  backend.rope(k, {config_.num_kv_heads, d, 0, d, config_.interleaved_rope}, act_.cos, act_.sin);

  const kernels::PagedKvLayer kv = cache.layer(layer);
  backend.kv_store(batch.seqs, k, v, kv);
  backend.paged_attention(batch.seqs, q, kv, {config_.num_heads, softmax_scale(), config_.sliding_window},
                          attn);
  return attn;
}

Tensor ForwardPass::latent_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache) {
  kernels::Backend& backend = model_.backend();
  const AttentionWeights& a = model_.layer(layer).attention;
  const MlaConfig& m = *config_.mla;
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t heads = config_.num_heads;
  const std::int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
  const std::int64_t r = m.kv_lora_rank;
  const std::int64_t dr = m.qk_rope_head_dim;
  const auto eps = static_cast<float>(m.norm_eps);
  Scratch& s = scratch_;
  const Tensor& normed = act_.normed;
  const Tensor q = backend.scratch(s.q, DType::f32, {rows, heads * qk});
  const Tensor latent = backend.scratch(s.k, DType::f32, {rows, r});
  const Tensor rope_key = backend.scratch(s.v, DType::f32, {rows, dr});
  const Tensor attn = backend.scratch(s.attn, DType::f32, {rows, heads * m.v_head_dim});

  if (m.q_lora_rank > 0) {
    const Tensor q_lora = backend.scratch(s.q_lora, DType::f32, {rows, m.q_lora_rank});
    backend.linear(normed, a.q_a, a.q_a_bias, q_lora);
    backend.rms_norm(q_lora, a.q_a_norm, eps, q_lora);
    backend.linear(q_lora, a.q_b, {}, q);
  } else {
    backend.linear(normed, a.q, {}, q);
  }
  backend.linear(normed, a.kv_a_latent, a.kv_a_latent_bias, latent);
  backend.rms_norm(latent, a.kv_a_norm, eps, latent);
  backend.linear(normed, a.kv_a_rope, a.kv_a_rope_bias, rope_key);
  backend.rope(q, {heads, qk, m.qk_nope_head_dim, dr, config_.interleaved_rope}, act_.cos, act_.sin);
  backend.rope(rope_key, {1, dr, 0, dr, config_.interleaved_rope}, act_.cos, act_.sin);

  const kernels::PagedLatentLayer kv = cache.latent_layer(layer);
  backend.latent_store(batch.seqs, latent, rope_key, kv);
  const kernels::LatentAttentionParams params{heads,        m.qk_nope_head_dim, dr,
                                              m.v_head_dim, softmax_scale(),    latent_form_};
  backend.latent_attention(batch.seqs, q, kv, a.kv_b, params, attn);
  return attn;
}

void ForwardPass::feed_forward(std::int64_t layer, std::int64_t rows) {
  kernels::Backend& backend = model_.backend();
  const LayerWeights& lw = model_.layer(layer);
  const Activations& a = act_;
  backend.rms_norm(a.residual, lw.post_attention_norm, static_cast<float>(config_.rms_norm_eps), a.normed);
  if (lw.is_moe) {
    const std::int64_t moe_index = model_.moe_index(layer);
    const StepReport report = step_report(model_, stack_, rows);
    MoeLayerContext context{layer,
                            model_.tables().layer(layer),
                            scheduler_,
                            dispatcher_,
                            a.exempt,
                            stats_.layer(moe_index),
                            a.report.rows(report.layer_at(moe_index), report.layer.size()),
                            a.report.rows(report.summed(), rows),
                            a.report.rows(report.summed() + rows, rows),
                            a.report.rows(StepReport::kOverflow, 1),
                            fixed_exchange_tokens_};
    moe_block(backend, config_, lw.moe, a.normed, a.proj, scratch_.moe, context);
  } else {
    const std::int64_t whole[2] = {0, rows};
    backend.grouped_expert_ffn(a.normed, whole, lw.dense_mlp, a.proj);
  }
  backend.add(a.residual, a.proj);
}

}  // namespace capserve::runtime
