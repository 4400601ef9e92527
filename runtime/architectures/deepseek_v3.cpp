// DeepSeek-V3 / R1 (and Kimi-K2-style checkpoints): DeepSeek-V2's blocks with another router: sigmoid scores,
// a per-expert correction bias (e_score_correction_bias) added to them only to choose, groups ranked by the
// sum of their best two experts, topk_group groups eligible, the chosen scores renormalized (norm_topk_prob)
// and then scaled by routed_scaling_factor. Multi-token-prediction layers (num_nextn_predict_layers) follow
// the decoder's layers in the checkpoint: a decoder layer each plus enorm, hnorm, eh_proj and shared_head
// (vLLM's and SGLang's DeepSeekMTP read the same names).
#include <string>

#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

ModelConfig parse(const ConfigReader& r) {
  ModelConfig c = parse_deepseek_common(r);
  c.architecture = "DeepseekV3ForCausalLM";
  c.interleaved_rope = r.boolean_or("rope_interleave", true);
  if (const std::string scoring = r.string_or("scoring_func", "sigmoid"); scoring != "sigmoid")
    throw LoadError("config.json: key 'scoring_func' is '" + scoring + "'; DeepSeek-V3 routing is sigmoid");
  if (const std::string method = r.string_or("topk_method", "noaux_tc"); method != "noaux_tc")
    throw LoadError("config.json: key 'topk_method' is '" + method + "'; DeepSeek-V3 routing is noaux_tc");
  c.router.sigmoid = true;
  c.router.group_top2_sum = true;
  c.router.correction_bias = true;
  c.router.n_group = r.integer_or("n_group", 1);
  c.router.topk_group = r.integer_or("topk_group", 1);
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", true);
  c.router.scaling = r.number_or("routed_scaling_factor", 1.0);
  const std::int64_t mtp = r.integer_or("num_nextn_predict_layers", 0);
  if (mtp < 0) throw LoadError("config.json: key 'num_nextn_predict_layers' must not be negative");
  for (std::int64_t i = 0; i < mtp; ++i)
    c.mtp_layer_is_moe.push_back(deepseek_layer_is_moe(r, c.num_layers + i));
  return c;
}

}  // namespace

const Architecture& deepseek_v3_architecture() {
  static const Architecture a{"DeepseekV3ForCausalLM", &parse, [] {
                                TensorNames n = deepseek_tensor_names();
                                n.router_bias = "mlp.gate.e_score_correction_bias";
                                n.mtp_eh_proj = "eh_proj.weight";
                                n.mtp_enorm = "enorm.weight";
                                n.mtp_hnorm = "hnorm.weight";
                                n.mtp_head_norm = "shared_head.norm.weight";
                                n.mtp_embed = "embed_tokens.weight";
                                n.mtp_head = "shared_head.head.weight";
                                return n;
                              }};
  return a;
}

}  // namespace capserve::runtime
