#include "runtime/model_weights.h"

#include <string>

namespace capserve::runtime {
namespace {

kernels::ExpertWeights load_swiglu(Checkpoint& ckpt, const std::string& prefix, const std::string& gate,
                                   const std::string& up, const std::string& down, std::int64_t hidden,
                                   std::int64_t ffn) {
  return {ckpt.get(prefix + gate, {ffn, hidden}), ckpt.get(prefix + up, {ffn, hidden}),
          ckpt.get(prefix + down, {hidden, ffn})};
}

AttentionWeights load_latent_attention(Checkpoint& ckpt, const ModelConfig& c, const TensorNames& n,
                                       const std::string& p) {
  const MlaConfig& m = *c.mla;
  const std::int64_t q_width = c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
  const std::int64_t r = m.kv_lora_rank;
  const std::int64_t dr = m.qk_rope_head_dim;
  AttentionWeights a;
  if (m.q_lora_rank > 0) {
    a.q_a = ckpt.get(p + n.q_a_proj + ".weight", {m.q_lora_rank, c.hidden_size});
    if (m.bias) a.q_a_bias = ckpt.get(p + n.q_a_proj + ".bias", {m.q_lora_rank});
    a.q_a_norm = ckpt.get(p + n.q_a_norm, {m.q_lora_rank});
    a.q_b = ckpt.get(p + n.q_b_proj + ".weight", {q_width, m.q_lora_rank});
  } else {
    a.q = ckpt.get(p + n.q_proj + ".weight", {q_width, c.hidden_size});
  }
  const kernels::WeightView kv_a = ckpt.get(p + n.kv_a_proj + ".weight", {r + dr, c.hidden_size});
  a.kv_a_latent = kv_a.row_range(0, r);
  a.kv_a_rope = kv_a.row_range(r, dr);
  if (m.bias) {
    const kernels::WeightView bias = ckpt.get(p + n.kv_a_proj + ".bias", {r + dr});
    a.kv_a_latent_bias = bias.element_range(0, r);
    a.kv_a_rope_bias = bias.element_range(r, dr);
  }
  a.kv_a_norm = ckpt.get(p + n.kv_a_norm, {r});
  a.kv_b = ckpt.get(p + n.kv_b_proj + ".weight", {c.num_heads * (m.qk_nope_head_dim + m.v_head_dim), r});
  a.o = ckpt.get(p + n.o_proj + ".weight", {c.hidden_size, c.num_heads * m.v_head_dim});
  if (c.o_bias) a.o_bias = ckpt.get(p + n.o_proj + ".bias", {c.hidden_size});
  return a;
}

AttentionWeights load_attention(Checkpoint& ckpt, const ModelConfig& c, const TensorNames& n,
                                const std::string& p) {
  if (c.mla) return load_latent_attention(ckpt, c, n, p);
  const std::int64_t q_width = c.num_heads * c.head_dim;
  const std::int64_t kv_width = c.num_kv_heads * c.head_dim;
  AttentionWeights a;
  a.q = ckpt.get(p + n.q_proj + ".weight", {q_width, c.hidden_size});
  a.k = ckpt.get(p + n.k_proj + ".weight", {kv_width, c.hidden_size});
  a.v = ckpt.get(p + n.v_proj + ".weight", {kv_width, c.hidden_size});
  a.o = ckpt.get(p + n.o_proj + ".weight", {c.hidden_size, q_width});
  if (c.qkv_bias) {
    a.q_bias = ckpt.get(p + n.q_proj + ".bias", {q_width});
    a.k_bias = ckpt.get(p + n.k_proj + ".bias", {kv_width});
    a.v_bias = ckpt.get(p + n.v_proj + ".bias", {kv_width});
  }
  if (c.o_bias) a.o_bias = ckpt.get(p + n.o_proj + ".bias", {c.hidden_size});
  if (c.qk_norm) {
    a.q_norm = ckpt.get(p + n.q_norm, {q_width});
    a.k_norm = ckpt.get(p + n.k_norm, {kv_width});
  }
  return a;
}

MoeWeights load_moe(Checkpoint& ckpt, const ModelConfig& c, const TensorNames& n, const std::string& p,
                    std::span<const std::int32_t> owners, int rank) {
  MoeWeights m;
  m.router = ckpt.get(p + n.router, {c.num_experts, c.hidden_size});
  for (std::int64_t e = 0; e < c.num_experts; ++e) {
    // Every expert's tensors are checked, but only this rank's are kept: the others' pages are never touched.
    const kernels::ExpertWeights w =
        load_swiglu(ckpt, p + n.expert_prefix + std::to_string(e) + ".", n.expert_gate, n.expert_up,
                    n.expert_down, c.hidden_size, c.moe_intermediate_size);
    if (owners[static_cast<std::size_t>(e)] == rank) m.experts.push_back(w);
  }
  if (c.shared_expert_intermediate_size > 0) {
    m.shared.push_back(load_swiglu(ckpt, p + n.shared_expert_prefix, "gate_proj.weight", "up_proj.weight",
                                   "down_proj.weight", c.hidden_size, c.shared_expert_intermediate_size));
    if (!n.shared_expert_gate.empty()) m.shared_gate = ckpt.get(p + n.shared_expert_gate, {1, c.hidden_size});
  }
  return m;
}

}  // namespace

ModelWeights load_model_weights(Checkpoint& ckpt, const ModelConfig& c, const TensorNames& n,
                                const parallel::ExpertPlacement& placement, int rank) {
  ModelWeights w;
  w.embed = ckpt.get(n.embed, {c.vocab_size, c.hidden_size});
  w.final_norm = ckpt.get(n.final_norm, {c.hidden_size});
  w.lm_head = c.tie_word_embeddings ? w.embed : ckpt.get(n.lm_head, {c.vocab_size, c.hidden_size});
  w.layers.resize(static_cast<std::size_t>(c.num_layers));
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& layer = w.layers[static_cast<std::size_t>(l)];
    layer.input_norm = ckpt.get(p + n.input_norm, {c.hidden_size});
    layer.post_attention_norm = ckpt.get(p + n.post_attention_norm, {c.hidden_size});
    layer.attention = load_attention(ckpt, c, n, p);
    layer.is_moe = c.layer_is_moe[static_cast<std::size_t>(l)];
    if (layer.is_moe) {
      layer.moe = load_moe(ckpt, c, n, p, placement.owners(l), rank);
    } else {
      layer.dense_mlp.push_back(load_swiglu(ckpt, p + n.dense_mlp_prefix, "gate_proj.weight",
                                            "up_proj.weight", "down_proj.weight", c.hidden_size,
                                            c.dense_intermediate_size));
    }
  }
  // Tied checkpoints sometimes still carry lm_head.weight; it is the same matrix, so accept it.
  if (c.tie_word_embeddings && ckpt.contains(n.lm_head)) ckpt.get(n.lm_head, {c.vocab_size, c.hidden_size});
  ckpt.check_all_used();
  return w;
}

}  // namespace capserve::runtime
