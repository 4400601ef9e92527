// Qwen3-MoE: Qwen2-MoE's layer rule without its shared expert or q/k/v bias, and an RMSNorm over each query
// and key head (q_norm / k_norm of head_dim, before RoPE); softmax router, top-k, renormalized with
// norm_topk_prob.
#include "runtime/architectures/architecture.h"

namespace capserve::runtime {
namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c;
  c.architecture = "Qwen3MoeForCausalLM";
  r.read_common(c);
  // Checkpoints say num_experts; transformers 5 writes num_local_experts.
  c.num_experts =
      r.find("num_experts") != nullptr ? r.integer("num_experts") : r.integer("num_local_experts");
  c.top_k = r.integer("num_experts_per_tok");
  c.moe_intermediate_size = r.integer("moe_intermediate_size");
  c.dense_intermediate_size = r.integer("intermediate_size");
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", false);
  c.qkv_bias = r.boolean_or("attention_bias", false);
  c.o_bias = c.qkv_bias;
  c.qk_norm = QkNorm::per_head;
  c.layer_is_moe = qwen_moe_layers(r, c);
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

const Architecture& qwen3_moe_architecture() {
  static const Architecture a{"Qwen3MoeForCausalLM", &parse, &names};
  return a;
}

}  // namespace capserve::runtime
