#pragma once
// An architecture is a config.json parser plus the Hugging Face tensor names of its blocks; the shared loader
// (runtime/model_weights.h) and the shared forward pass (runtime/model.h) do the rest. One file per
// architecture.
#include <string>
#include <string_view>
#include <vector>

#include "runtime/model_config.h"

namespace capserve::runtime {

// Names relative to "model.layers.<L>." unless noted. Empty means the block has no such tensor.
struct TensorNames {
  std::string embed = "model.embed_tokens.weight";  // global
  std::string final_norm = "model.norm.weight";     // global
  std::string lm_head = "lm_head.weight";           // global; unused when embeddings are tied
  std::string input_norm = "input_layernorm.weight";
  std::string post_attention_norm = "post_attention_layernorm.weight";
  std::string q_proj = "self_attn.q_proj";  // ".weight" / ".bias" appended
  std::string k_proj = "self_attn.k_proj";
  std::string v_proj = "self_attn.v_proj";
  std::string o_proj = "self_attn.o_proj";
  std::string q_norm;  // full tensor name suffix, e.g. "self_attn.q_norm.weight"
  std::string k_norm;
  // Multi-head latent attention (used when the config has MLA): projections get ".weight" / ".bias"
  // appended, norms are full suffixes. q_proj above serves when there is no q LoRA.
  std::string q_a_proj;
  std::string q_a_norm;
  std::string q_b_proj;
  std::string kv_a_proj;  // [kv_lora_rank + qk_rope_head_dim, hidden]: latent rows, then the rope-key rows
  std::string kv_a_norm;
  std::string kv_b_proj;
  std::string router;         // e.g. "mlp.gate.weight"
  std::string router_bias;    // the selection-only correction bias, e.g. "mlp.gate.e_score_correction_bias"
  std::string expert_prefix;  // followed by "<E>."
  std::string expert_gate;    // e.g. "gate_proj.weight" or "w1.weight"
  std::string expert_up;
  std::string expert_down;
  std::string shared_expert_prefix;       // e.g. "mlp.shared_expert."; empty: none
  std::string shared_expert_gate;         // e.g. "mlp.shared_expert_gate.weight"; empty: ungated
  std::string dense_mlp_prefix = "mlp.";  // dense layers: <prefix>{gate,up,down}_proj.weight
  // A multi-token-prediction layer's own tensors besides a decoder layer's (ModelConfig::mtp_layer_is_moe);
  // empty where the architecture has none.
  std::string mtp_eh_proj;    // [hidden, 2 * hidden]; its presence marks the layer as stored
  std::string mtp_enorm;      // [hidden]
  std::string mtp_hnorm;      // [hidden]
  std::string mtp_head_norm;  // [hidden]
  std::string mtp_embed;      // [vocab, hidden], optional: conversions drop this copy of the model's own
  std::string mtp_head;       // [vocab, hidden], optional likewise
};

struct Architecture {
  std::string_view hf_class;
  ModelConfig (*parse_config)(const ConfigReader& reader);
  TensorNames (*tensor_names)();
};

const Architecture& mixtral_architecture();
const Architecture& olmoe_architecture();
const Architecture& qwen2_moe_architecture();
const Architecture& deepseek_v2_architecture();
const Architecture& qwen3_moe_architecture();
const Architecture& deepseek_v3_architecture();

// What DeepSeek-V2 and V3 share (deepseek_v2.cpp): multi-head latent attention with its softmax scale, the
// routed and shared experts' sizes, the dense-then-MoE layer rule, and the tensor names. The routers differ.
ModelConfig parse_deepseek_common(const ConfigReader& r);
// DeepSeek's layer rule: MoE from first_k_dense_replace on, on the moe_layer_freq grid.
bool deepseek_layer_is_moe(const ConfigReader& r, std::int64_t layer);
TensorNames deepseek_tensor_names();

// Qwen MoE models' layer rule (qwen2_moe.cpp): MoE where (layer + 1) % decoder_sparse_step == 0 and the layer
// is not in mlp_only_layers, a dense MLP elsewhere; LoadError for per-layer sliding windows.
std::vector<bool> qwen_moe_layers(const ConfigReader& r, const ModelConfig& c);

// The architecture named by config.json's "architectures" list; LoadError listing the supported ones
// otherwise.
const Architecture& find_architecture(const nlohmann::json& config);

}  // namespace capserve::runtime
