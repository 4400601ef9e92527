#include "runtime/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "parallel/self_communicator.h"
#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

void add_into(std::span<float> dst, std::span<const float> src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

void clamp_all(std::span<float> v, std::size_t n, float c) {
  for (std::size_t i = 0; i < n; ++i) v[i] = std::clamp(v[i], -c, c);
}

template <typename T>
void grow(std::vector<T>& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

std::vector<std::int64_t> moe_layer_indices(const ModelConfig& config) {
  std::vector<std::int64_t> layers;
  for (std::int64_t l = 0; l < config.num_layers; ++l) {
    if (config.layer_is_moe[static_cast<std::size_t>(l)]) layers.push_back(l);
  }
  return layers;
}

parallel::ExpertPlacement make_placement(const ModelConfig& config, const std::string& spec, int ranks) {
  try {
    return parallel::ExpertPlacement::from_spec(spec, config.num_layers, config.num_experts, ranks);
  } catch (const std::exception& e) {
    throw LoadError(e.what());
  }
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir) {
  auto self = std::make_unique<parallel::SelfCommunicator>();
  parallel::Communicator& comm = *self;
  return load_with(dir, std::move(self), comm, ParallelOptions{});
}

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, parallel::Communicator& comm,
                                   const ParallelOptions& options) {
  return load_with(dir, nullptr, comm, options);
}

std::unique_ptr<Model> Model::load_with(const std::filesystem::path& dir,
                                        std::unique_ptr<parallel::Communicator> own_comm,
                                        parallel::Communicator& comm, const ParallelOptions& options) {
  const nlohmann::json json = read_json_file(dir / "config.json");
  if (!json.is_object()) throw LoadError((dir / "config.json").string() + ": must be a JSON object");
  const Architecture& arch = find_architecture(json);
  ModelConfig config = arch.parse_config(ConfigReader(json));
  config.validate();
  if (const std::string why = options.capacity.validate(config.num_layers); !why.empty())
    throw LoadError(why);
  return std::unique_ptr<Model>(new Model(std::move(config), Checkpoint::open(dir), arch.tensor_names(),
                                          std::move(own_comm), comm, options));
}

Model::Model(ModelConfig config, Checkpoint checkpoint, const TensorNames& names,
             std::unique_ptr<parallel::Communicator> own_comm, parallel::Communicator& comm,
             const ParallelOptions& options)
    : config_(std::move(config)),
      own_comm_(std::move(own_comm)),
      comm_(&comm),
      placement_(make_placement(config_, options.placement, comm.size())),
      checkpoint_(std::move(checkpoint)),
      weights_(load_model_weights(checkpoint_, config_, names, placement_, comm.rank())),
      rope_(config_.rotary_dim(), config_.rope_theta, config_.rope_scaling),
      scheduler_(options.capacity, comm),
      dispatcher_(comm),
      stats_(moe_layer_indices(config_), config_.num_experts, comm.size()),
      moe_layers_(moe_layer_indices(config_)),
      moe_index_(static_cast<std::size_t>(config_.num_layers), -1) {
  std::int64_t i = 0;
  for (const std::int64_t l : moe_layers_) moe_index_[static_cast<std::size_t>(l)] = i++;
}

void Model::router_dry_run(std::span<const std::int32_t> tokens, std::int64_t layers,
                           kernels::Backend& backend, std::span<std::int64_t> counts) {
  const auto rows = static_cast<std::int64_t>(tokens.size());
  const std::int64_t hidden = config_.hidden_size;
  const std::int64_t experts = config_.num_experts;
  DryRunScratch& s = dry_run_;
  grow(s.embedded, rows * hidden);
  grow(s.normed, rows * hidden);
  grow(s.logits, rows * experts);
  const std::span<float> embedded(s.embedded.data(), static_cast<std::size_t>(rows * hidden));
  const std::span<float> normed(s.normed.data(), static_cast<std::size_t>(rows * hidden));
  const std::span<float> logits(s.logits.data(), static_cast<std::size_t>(rows * experts));
  backend.embedding(tokens, weights_.embed, embedded);
  const std::int64_t n = std::min<std::int64_t>(layers, static_cast<std::int64_t>(moe_layers_.size()));
  for (std::int64_t i = 0; i < n; ++i) {
    const LayerWeights& lw =
        weights_.layers[static_cast<std::size_t>(moe_layers_[static_cast<std::size_t>(i)])];
    backend.rms_norm(embedded, hidden, lw.post_attention_norm, static_cast<float>(config_.rms_norm_eps),
                     normed);
    backend.linear(normed, rows, lw.moe.router, {}, logits);
    route_softmax_topk(logits, rows, experts, config_.top_k, config_.norm_topk_prob, s.routing,
                       config_.router);
    for (const std::int32_t e : s.routing.experts) ++counts[static_cast<std::size_t>(i * experts + e)];
  }
}

void Model::forward(const ForwardBatch& batch, KvCache& cache, kernels::Backend& backend,
                    std::span<float> logits) {
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t hidden = config_.hidden_size;
  Scratch& s = scratch_;
  grow(s.residual, rows * hidden);
  grow(s.normed, rows * hidden);
  grow(s.proj, rows * hidden);

  backend.embedding(batch.tokens, weights_.embed, s.residual);
  rope_.tables(batch.positions, s.cos, s.sin);

  // Rows of the phase the capacity scheduler leaves alone are exempt from dropping.
  const parallel::CapacityPhase phase = scheduler_.config().apply_to;
  exempt_.assign(static_cast<std::size_t>(rows), 0);
  if (phase != parallel::CapacityPhase::both) {
    const std::uint8_t exempt_decode = phase == parallel::CapacityPhase::prefill ? 1 : 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool decode = !batch.decode_rows.empty() && batch.decode_rows[static_cast<std::size_t>(r)] != 0;
      exempt_[static_cast<std::size_t>(r)] =
          decode ? exempt_decode : static_cast<std::uint8_t>(1 - exempt_decode);
    }
  }
  row_dropped_.assign(static_cast<std::size_t>(rows), 0);
  row_rerouted_.assign(static_cast<std::size_t>(rows), 0);
  stats_.begin_step();
  scheduler_.begin_step(rows);

  for (std::int64_t layer = 0; layer < config_.num_layers; ++layer) {
    attention(layer, batch, cache, backend);
    feed_forward(layer, rows, backend);
  }

  const auto wanted = static_cast<std::int64_t>(batch.logit_rows.size());
  grow(s.final_rows, wanted * hidden);
  for (std::int64_t i = 0; i < wanted; ++i) {
    std::memcpy(s.final_rows.data() + i * hidden,
                s.residual.data() + batch.logit_rows[static_cast<std::size_t>(i)] * hidden,
                static_cast<std::size_t>(hidden) * sizeof(float));
  }
  const std::span<float> final_rows(s.final_rows.data(), static_cast<std::size_t>(wanted * hidden));
  backend.rms_norm(final_rows, hidden, weights_.final_norm, static_cast<float>(config_.rms_norm_eps),
                   final_rows);
  backend.linear(final_rows, wanted, weights_.lm_head, {}, logits);
  stats_.reduce(*comm_, placement_);
  run_stats_.add(stats_.step());
}

void Model::attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache,
                      kernels::Backend& backend) {
  const LayerWeights& lw = weights_.layers[static_cast<std::size_t>(layer)];
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t hidden = config_.hidden_size;
  Scratch& s = scratch_;
  backend.rms_norm(std::span<const float>(s.residual.data(), static_cast<std::size_t>(rows * hidden)), hidden,
                   lw.input_norm, static_cast<float>(config_.rms_norm_eps), s.normed);
  if (config_.mla) {
    latent_attention(layer, batch, cache, backend);
  } else {
    grouped_query_attention(layer, batch, cache, backend);
  }
  backend.linear(s.attn, rows, lw.attention.o, lw.attention.o_bias, s.proj);
  add_into(s.residual, s.proj, static_cast<std::size_t>(rows * hidden));
}

float Model::softmax_scale() const {
  return static_cast<float>(
      config_.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(config_.head_dim))));
}

void Model::grouped_query_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache,
                                    kernels::Backend& backend) {
  const AttentionWeights& a = weights_.layers[static_cast<std::size_t>(layer)].attention;
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t d = config_.head_dim;
  const std::int64_t q_width = config_.num_heads * d;
  const std::int64_t kv_width = config_.num_kv_heads * d;
  const auto eps = static_cast<float>(config_.rms_norm_eps);
  Scratch& s = scratch_;
  grow(s.q, rows * q_width);
  grow(s.k, rows * kv_width);
  grow(s.v, rows * kv_width);
  grow(s.attn, rows * q_width);
  const std::span<float> q(s.q.data(), static_cast<std::size_t>(rows * q_width));
  const std::span<float> k(s.k.data(), static_cast<std::size_t>(rows * kv_width));
  const std::span<float> v(s.v.data(), static_cast<std::size_t>(rows * kv_width));

  backend.linear(s.normed, rows, a.q, a.q_bias, q);
  backend.linear(s.normed, rows, a.k, a.k_bias, k);
  backend.linear(s.normed, rows, a.v, a.v_bias, v);
  if (config_.qk_norm) {
    backend.rms_norm(q, q_width, a.q_norm, eps, q);
    backend.rms_norm(k, kv_width, a.k_norm, eps, k);
  }
  if (config_.clip_qkv) {
    const auto c = static_cast<float>(*config_.clip_qkv);
    clamp_all(q, q.size(), c);
    clamp_all(k, k.size(), c);
    clamp_all(v, v.size(), c);
  }
  backend.rope(q, {config_.num_heads, d, 0, d, config_.interleaved_rope}, s.cos, s.sin);
  backend.rope(k, {config_.num_kv_heads, d, 0, d, config_.interleaved_rope}, s.cos, s.sin);

  const kernels::PagedKvLayer kv = cache.layer(layer);
  backend.kv_store(batch.seqs, k, v, kv);
  backend.paged_attention(batch.seqs, q, kv, {config_.num_heads, softmax_scale(), config_.sliding_window},
                          s.attn);
}

void Model::latent_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache,
                             kernels::Backend& backend) {
  const AttentionWeights& a = weights_.layers[static_cast<std::size_t>(layer)].attention;
  const MlaConfig& m = *config_.mla;
  const auto rows = static_cast<std::int64_t>(batch.tokens.size());
  const std::int64_t heads = config_.num_heads;
  const std::int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
  const std::int64_t r = m.kv_lora_rank;
  const std::int64_t dr = m.qk_rope_head_dim;
  const auto eps = static_cast<float>(m.norm_eps);
  Scratch& s = scratch_;
  grow(s.q, rows * heads * qk);
  grow(s.k, rows * r);
  grow(s.v, rows * dr);
  grow(s.attn, rows * heads * m.v_head_dim);
  const std::span<float> q(s.q.data(), static_cast<std::size_t>(rows * heads * qk));
  const std::span<float> latent(s.k.data(), static_cast<std::size_t>(rows * r));
  const std::span<float> rope_key(s.v.data(), static_cast<std::size_t>(rows * dr));

  if (m.q_lora_rank > 0) {
    grow(s.q_lora, rows * m.q_lora_rank);
    const std::span<float> q_lora(s.q_lora.data(), static_cast<std::size_t>(rows * m.q_lora_rank));
    backend.linear(s.normed, rows, a.q_a, a.q_a_bias, q_lora);
    backend.rms_norm(q_lora, m.q_lora_rank, a.q_a_norm, eps, q_lora);
    backend.linear(q_lora, rows, a.q_b, {}, q);
  } else {
    backend.linear(s.normed, rows, a.q, {}, q);
  }
  backend.linear(s.normed, rows, a.kv_a_latent, a.kv_a_latent_bias, latent);
  backend.rms_norm(latent, r, a.kv_a_norm, eps, latent);
  backend.linear(s.normed, rows, a.kv_a_rope, a.kv_a_rope_bias, rope_key);
  backend.rope(q, {heads, qk, m.qk_nope_head_dim, dr, config_.interleaved_rope}, s.cos, s.sin);
  backend.rope(rope_key, {1, dr, 0, dr, config_.interleaved_rope}, s.cos, s.sin);

  const kernels::PagedLatentLayer kv = cache.latent_layer(layer);
  backend.latent_store(batch.seqs, latent, rope_key, kv);
  const kernels::LatentAttentionParams params{heads,        m.qk_nope_head_dim, dr,
                                              m.v_head_dim, softmax_scale(),    latent_form_};
  backend.latent_attention(batch.seqs, q, kv, a.kv_b, params, s.attn);
}

void Model::feed_forward(std::int64_t layer, std::int64_t rows, kernels::Backend& backend) {
  const LayerWeights& lw = weights_.layers[static_cast<std::size_t>(layer)];
  const std::int64_t hidden = config_.hidden_size;
  Scratch& s = scratch_;
  const std::span<const float> normed(s.normed.data(), static_cast<std::size_t>(rows * hidden));
  backend.rms_norm(std::span<const float>(s.residual.data(), static_cast<std::size_t>(rows * hidden)), hidden,
                   lw.post_attention_norm, static_cast<float>(config_.rms_norm_eps), s.normed);
  if (lw.is_moe) {
    MoeLayerContext context{layer,
                            placement_,
                            scheduler_,
                            dispatcher_,
                            std::span<const std::uint8_t>(exempt_.data(), static_cast<std::size_t>(rows)),
                            stats_.layer(moe_index_[static_cast<std::size_t>(layer)]),
                            row_dropped_,
                            row_rerouted_};
    moe_block(backend, config_, lw.moe, normed, rows, s.proj, s.moe, context);
  } else {
    const std::int64_t whole[2] = {0, rows};
    backend.grouped_expert_ffn(normed, whole, lw.dense_mlp, s.proj);
  }
  add_into(s.residual, s.proj, static_cast<std::size_t>(rows * hidden));
}

}  // namespace capserve::runtime
