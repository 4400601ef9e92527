// Qwen2-MoE / Qwen1.5-MoE: q/k/v bias, a shared expert behind a sigmoid gate, MoE only on layers where
// (layer + 1) % decoder_sparse_step == 0 and not listed in mlp_only_layers (the rest are dense MLPs).
#include <algorithm>

#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c;
  c.architecture = "Qwen2MoeForCausalLM";
  r.read_common(c);
  c.num_experts = r.integer("num_experts");
  c.top_k = r.integer("num_experts_per_tok");
  c.moe_intermediate_size = r.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size");
  c.dense_intermediate_size = r.integer("intermediate_size");
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", false);
  c.qkv_bias = r.boolean_or("qkv_bias", true);
  c.layer_is_moe = qwen_moe_layers(r, c);
  return c;
}

TensorNames names() {
  TensorNames n;
  n.router = "mlp.gate.weight";
  n.expert_prefix = "mlp.experts.";
  n.expert_gate = "gate_proj.weight";
  n.expert_up = "up_proj.weight";
  n.expert_down = "down_proj.weight";
  n.shared_expert_prefix = "mlp.shared_expert.";
  n.shared_expert_gate = "mlp.shared_expert_gate.weight";
  return n;
}

}  // namespace

std::vector<bool> qwen_moe_layers(const ConfigReader& r, const ModelConfig& c) {
  if (r.boolean_or("use_sliding_window", false)) {
    throw LoadError(
        "config.json: key 'use_sliding_window' is true; per-layer sliding windows of Qwen MoE models are not "
        "supported");
  }
  const std::int64_t step = r.integer_or("decoder_sparse_step", 1);
  if (step <= 0) throw LoadError("config.json: key 'decoder_sparse_step' must be positive");
  const std::vector<std::int64_t> mlp_only = r.integer_list_or_empty("mlp_only_layers");
  std::vector<bool> moe;
  for (std::int64_t layer = 0; layer < c.num_layers; ++layer) {
    const bool dense = std::find(mlp_only.begin(), mlp_only.end(), layer) != mlp_only.end();
    moe.push_back(!dense && c.num_experts > 0 && (layer + 1) % step == 0);
  }
  return moe;
}

const Architecture& qwen2_moe_architecture() {
  static const Architecture a{"Qwen2MoeForCausalLM", &parse, &names};
  return a;
}

}  // namespace capserve::runtime
