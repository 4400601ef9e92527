// DeepSeek-V2 / V2-Lite, and the blocks DeepSeek-V3 shares (deepseek_v3.cpp): multi-head latent attention
// (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj with q LoRA; kv_a_proj_with_mqa -> kv_a_layernorm latent
// + shared rope key; kv_b_proj), RoPE on interleaved pairs of the rope dims, YaRN with mscale folded into the
// softmax scale; dense MLPs on the first first_k_dense_replace layers and off the moe_layer_freq grid, MoE
// elsewhere: softmax router, greedy or group-limited top-k, routed_scaling_factor, and n_shared_experts
// always-on experts as one ungated MLP.
#include <cmath>
#include <string>

#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {

ModelConfig parse_deepseek_common(const ConfigReader& r) {
  ModelConfig c;
  r.read_common(c);

  MlaConfig m;
  m.q_lora_rank = r.integer_or("q_lora_rank", 0);  // null on V2-Lite: q_proj
  m.kv_lora_rank = r.integer("kv_lora_rank");
  m.qk_nope_head_dim = r.integer("qk_nope_head_dim");
  m.qk_rope_head_dim = r.integer("qk_rope_head_dim");
  m.v_head_dim = r.integer("v_head_dim");
  m.bias = r.boolean_or("attention_bias", false);
  c.mla = m;
  c.o_bias = m.bias;
  // Every head has its own keys and values (num_key_value_heads, when present, equals the head count);
  // head_dim in transformers' config.json is the rope dim, so the query-key head dim is set here.
  c.num_kv_heads = c.num_heads;
  c.head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim;
  c.interleaved_rope = true;
  // transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim sharpens the softmax by
  // mscale(factor, mscale_all_dim)^2.
  double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  if (c.rope_scaling.type != RopeScaling::Type::none && c.rope_scaling.mscale_all_dim != 0.0) {
    const double mscale = yarn_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    scale *= mscale * mscale;
  }
  c.softmax_scale = scale;

  // Checkpoints say n_routed_experts; transformers 5 writes num_local_experts.
  c.num_experts =
      r.find("n_routed_experts") != nullptr ? r.integer("n_routed_experts") : r.integer("num_local_experts");
  c.top_k = r.integer("num_experts_per_tok");
  c.moe_intermediate_size = r.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = r.integer_or("n_shared_experts", 0) * c.moe_intermediate_size;
  c.dense_intermediate_size = r.integer("intermediate_size");

  for (std::int64_t layer = 0; layer < c.num_layers; ++layer)
    c.layer_is_moe.push_back(deepseek_layer_is_moe(r, layer));
  return c;
}

// transformers' port ignores moe_layer_freq; the released checkpoints use 1.
bool deepseek_layer_is_moe(const ConfigReader& r, std::int64_t layer) {
  const std::int64_t first_dense = r.integer_or("first_k_dense_replace", 0);
  const std::int64_t freq = r.integer_or("moe_layer_freq", 1);
  if (first_dense < 0) throw LoadError("config.json: key 'first_k_dense_replace' must not be negative");
  if (freq <= 0) throw LoadError("config.json: key 'moe_layer_freq' must be positive");
  return layer >= first_dense && layer % freq == 0;
}

TensorNames deepseek_tensor_names() {
  TensorNames n;
  n.q_a_proj = "self_attn.q_a_proj";
  n.q_a_norm = "self_attn.q_a_layernorm.weight";
  n.q_b_proj = "self_attn.q_b_proj";
  n.kv_a_proj = "self_attn.kv_a_proj_with_mqa";
  n.kv_a_norm = "self_attn.kv_a_layernorm.weight";
  n.kv_b_proj = "self_attn.kv_b_proj";
  n.router = "mlp.gate.weight";
  n.expert_prefix = "mlp.experts.";
  n.expert_gate = "gate_proj.weight";
  n.expert_up = "up_proj.weight";
  n.expert_down = "down_proj.weight";
  n.shared_expert_prefix = "mlp.shared_experts.";
  return n;
}

namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c = parse_deepseek_common(r);
  c.architecture = "DeepseekV2ForCausalLM";
  if (const std::string scoring = r.string_or("scoring_func", "softmax"); scoring != "softmax")
    throw LoadError("config.json: key 'scoring_func' is '" + scoring + "'; only softmax is supported");
  const std::string topk_method = r.string_or("topk_method", "greedy");
  if (topk_method == "group_limited_greedy") {
    c.router.n_group = r.integer("n_group");
    c.router.topk_group = r.integer("topk_group");
  } else if (topk_method != "greedy") {
    throw LoadError("config.json: key 'topk_method' is '" + topk_method +
                    "'; supported: greedy, group_limited_greedy");
  }
  // DeepSeek's MoEGate either renormalizes the top-k weights (norm_topk_prob, top_k > 1) or scales them by
  // routed_scaling_factor, never both. (transformers' port ignores norm_topk_prob and always scales; the
  // released checkpoints set it false, where the two agree.)
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", false) && c.top_k > 1;
  c.router.scaling = c.norm_topk_prob ? 1.0 : r.number_or("routed_scaling_factor", 1.0);
  return c;
}

}  // namespace

const Architecture& deepseek_v2_architecture() {
  static const Architecture a{"DeepseekV2ForCausalLM", &parse, &deepseek_tensor_names};
  return a;
}

}  // namespace capserve::runtime
