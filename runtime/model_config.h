#pragma once
// The typed model configuration every architecture maps its config.json onto, and the checked JSON accessors
// the architecture files use: a missing or wrong-typed key is a LoadError naming the key.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/dtype.h"
#include "runtime/generation_config.h"
#include "runtime/json_file.h"
#include "runtime/weights/fp8_blocks.h"

namespace capserve::runtime {

struct RopeScaling {
  enum class Type { none, linear, dynamic, llama3, yarn };
  Type type = Type::none;
  double factor = 1.0;
  // llama3 and yarn; dynamic: max_position_embeddings (transformers 5.23 reads no other key for it), the
  // sequence length past which a forward's frequencies are recomputed from its length.
  double original_max_position_embeddings = 8192.0;
  // llama3 only
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // yarn only: the rotation counts bounding the blend from extrapolated to interpolated frequencies, whether
  // that range is widened to whole dims, and the factor cos/sin are multiplied by.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;
  // Any scaled type, as written in the config (0 when absent): DeepSeek-V2 folds mscale(factor,
  // mscale_all_dim)^2 into its softmax scale.
  double mscale_all_dim = 0.0;
};

// Multi-head latent attention (DeepSeek-V2): queries from q_proj, or through the low-rank q_a_proj ->
// q_a_layernorm -> q_b_proj when q_lora_rank > 0; keys and values of every head recovered by kv_b_proj from
// one compressed latent of kv_lora_rank per token plus one rope key of qk_rope_head_dim shared by the heads.
struct MlaConfig {
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  bool bias = false;  // q_a_proj and kv_a_proj_with_mqa biases (attention_bias)
  // q_a_layernorm and kv_a_layernorm are built without the config's eps in DeepSeek's code and
  // transformers' port alike, so they keep the RMSNorm default.
  double norm_eps = 1e-6;
};

// How the router picks each token's experts from its softmax probabilities.
struct RouterConfig {
  // Group-limited top-k (DeepSeek-V2 group_limited_greedy): the experts form n_group equal groups, ranked by
  // their best expert; only the best topk_group groups are eligible. n_group 1: plain top-k.
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  // The chosen weights, after the optional norm_topk_prob renormalization, are multiplied by this.
  double scaling = 1.0;
  // DeepSeek-V3: sigmoid scores, groups ranked by their best two experts, and a per-expert correction bias
  // added to the scores only to choose (e_score_correction_bias).
  bool sigmoid = false;
  bool group_top2_sum = false;
  bool correction_bias = false;
};

// Where the query and key projections are normalized before RoPE.
enum class QkNorm {
  none,
  whole,     // over the whole q and k projections (OLMoE)
  per_head,  // over each head's head_dim (Qwen3)
};

struct ModelConfig {
  std::string architecture;  // the Hugging Face class name, e.g. "MixtralForCausalLM"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;  // MLA: the query-key head dim, qk_nope_head_dim + qk_rope_head_dim
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool qkv_bias = false;
  bool o_bias = false;
  QkNorm qk_norm = QkNorm::none;    // RMSNorm of q and k before RoPE
  std::optional<double> clip_qkv;   // clamp q/k/v projections to [-c, c] (OLMoE)
  std::int64_t sliding_window = 0;  // 0: full attention
  bool tie_word_embeddings = false;
  std::optional<MlaConfig> mla;         // set: multi-head latent attention replaces q/k/v projections
  std::optional<double> softmax_scale;  // default 1 / sqrt(head_dim)
  bool interleaved_rope = false;        // rotate pairs (2i, 2i+1) instead of (i, i + dim / 2)

  // Feed-forward: MoE layers and dense MLP layers.
  std::int64_t num_experts = 0;
  std::int64_t top_k = 0;
  bool norm_topk_prob = false;
  RouterConfig router;
  std::int64_t moe_intermediate_size = 0;
  // 0: no shared expert. DeepSeek's n_shared_experts are one MLP of n_shared_experts * moe_intermediate_size.
  std::int64_t shared_expert_intermediate_size = 0;
  std::int64_t dense_intermediate_size = 0;  // dense MLP layers
  std::vector<bool> layer_is_moe;            // per layer
  // Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers), one flag each: MoE or dense under
  // the decoder's rule. Layer i is stored as model.layers.<num_layers + i>: a decoder layer's tensors plus
  // the architecture's MTP tensors (TensorNames::mtp_*). They run only as speculative decoding's draft
  // (ParallelOptions::mtp); otherwise the loader checks their tensors and skips them unread.
  std::vector<bool> mtp_layer_is_moe;

  // config.json's eos ids, then generation_config.json's that config.json lacks: generation stops at each.
  std::vector<std::int32_t> eos_token_ids;
  // generation_config.json's sampling defaults (its eos ids are merged above).
  GenerationDefaults generation;

  // quantization_config of block-quantized FP8 weights; unset: unquantized.
  std::optional<Fp8BlockShape> fp8_blocks;
  // The type the unquantized weights are stored in, as config.json declares it (torch_dtype, or dtype in
  // transformers 5: bfloat16, float16, float32); unset when absent or another name. Loading reads each
  // tensor's own type from the checkpoint; the memory plan (memory_plan.h), which has no checkpoint, needs
  // this one.
  std::optional<kernels::DType> torch_dtype;

  // The dims RoPE rotates in each query and key head.
  [[nodiscard]] std::int64_t rotary_dim() const { return mla ? mla->qk_rope_head_dim : head_dim; }

  // The longest sequence the engine runs: max_position_embeddings, or with dynamic rope scaling the context
  // it is meant to stretch to, factor x max_position_embeddings (vLLM's limit; transformers sets none).
  [[nodiscard]] std::int64_t max_context_length() const;

  // Checks the cross-field invariants (divisibility, ranges); throws LoadError naming the key.
  void validate() const;
};

// YaRN's magnitude correction for a context stretched by `scale` (transformers' get_mscale).
double yarn_mscale(double scale, double mscale);

// Checked accessors over one config.json object; errors read "config.json: key 'X' ...".
class ConfigReader {
 public:
  explicit ConfigReader(const nlohmann::json& json) : json_(json) {}

  [[nodiscard]] std::int64_t integer(std::string_view key) const;
  [[nodiscard]] std::int64_t integer_or(std::string_view key, std::int64_t fallback) const;
  [[nodiscard]] double number(std::string_view key) const;
  [[nodiscard]] double number_or(std::string_view key, double fallback) const;
  [[nodiscard]] std::optional<double> optional_number(std::string_view key) const;
  [[nodiscard]] bool boolean_or(std::string_view key, bool fallback) const;
  [[nodiscard]] std::string string_or(std::string_view key, std::string_view fallback) const;
  [[nodiscard]] std::vector<std::int64_t> integer_list_or_empty(std::string_view key) const;
  [[nodiscard]] const nlohmann::json* find(std::string_view key) const;

  // Fields every decoder here shares: sizes, heads, norms, RoPE (rope_theta/rope_scaling, or
  // rope_parameters), tying, eos ids.
  void read_common(ModelConfig& c) const;

 private:
  const nlohmann::json& json_;
};

}  // namespace capserve::runtime
