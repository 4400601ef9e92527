// OLMoE: q_norm/k_norm over the whole q and k projections (before clip_qkv and RoPE); softmax router, top-k,
// renormalized only with norm_topk_prob.
#include "runtime/architectures/architecture.h"

namespace capserve::runtime {
namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c;
  c.architecture = "OlmoeForCausalLM";
  r.read_common(c);
  c.num_experts = r.integer("num_experts");
  c.top_k = r.integer("num_experts_per_tok");
  c.moe_intermediate_size = r.integer("intermediate_size");
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", false);
  c.qkv_bias = r.boolean_or("attention_bias", false);
  c.o_bias = c.qkv_bias;
  c.qk_norm = QkNorm::whole;
  c.clip_qkv = r.optional_number("clip_qkv");
  c.layer_is_moe.assign(static_cast<std::size_t>(c.num_layers), true);
  return c;
}

TensorNames names() {
  TensorNames n;
  n.q_norm = "self_attn.q_norm.weight";
  n.k_norm = "self_attn.k_norm.weight";
  n.router = "mlp.gate.weight";
  n.expert_prefix = "mlp.experts.";
  n.expert_gate = "gate_proj.weight";
  n.expert_up = "up_proj.weight";
  n.expert_down = "down_proj.weight";
  return n;
}

}  // namespace

const Architecture& olmoe_architecture() {
  static const Architecture a{"OlmoeForCausalLM", &parse, &names};
  return a;
}

}  // namespace capserve::runtime
