// Mixtral: softmax router over all experts, top-k, always renormalized; experts named w1 (gate), w3 (up), w2
// (down).
#include "runtime/architectures/architecture.h"

namespace capserve::runtime {
namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c;
  c.architecture = "MixtralForCausalLM";
  r.read_common(c);
  c.num_experts = r.integer("num_local_experts");
  c.top_k = r.integer("num_experts_per_tok");
  c.moe_intermediate_size = r.integer("intermediate_size");
  c.norm_topk_prob = true;
  c.sliding_window = r.integer_or("sliding_window", 0);
  c.layer_is_moe.assign(static_cast<std::size_t>(c.num_layers), true);
  return c;
}

TensorNames names() {
  TensorNames n;
  n.router = "block_sparse_moe.gate.weight";
  n.expert_prefix = "block_sparse_moe.experts.";
  n.expert_gate = "w1.weight";
  n.expert_up = "w3.weight";
  n.expert_down = "w2.weight";
  return n;
}

}  // namespace

const Architecture& mixtral_architecture() {
  static const Architecture a{"MixtralForCausalLM", &parse, &names};
  return a;
}

}  // namespace capserve::runtime
