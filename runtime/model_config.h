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

#include "runtime/json_file.h"

namespace capserve::runtime {

struct RopeScaling {
  enum class Type { none, linear, llama3 };
  Type type = Type::none;
  double factor = 1.0;
  // llama3 only
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;
};

struct ModelConfig {
  std::string architecture;  // the Hugging Face class name, e.g. "MixtralForCausalLM"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;             // RMSNorm over the whole q and k projections (OLMoE)
  std::optional<double> clip_qkv;   // clamp q/k/v projections to [-c, c] (OLMoE)
  std::int64_t sliding_window = 0;  // 0: full attention
  bool tie_word_embeddings = false;

  // Feed-forward: MoE layers and dense MLP layers.
  std::int64_t num_experts = 0;
  std::int64_t top_k = 0;
  bool norm_topk_prob = false;
  std::int64_t moe_intermediate_size = 0;
  std::int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  std::int64_t dense_intermediate_size = 0;          // dense MLP layers
  std::vector<bool> layer_is_moe;                    // per layer

  std::vector<std::int32_t> eos_token_ids;

  // Checks the cross-field invariants (divisibility, ranges); throws LoadError naming the key.
  void validate() const;
};

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
  [[nodiscard]] std::vector<std::int64_t> integer_list_or_empty(std::string_view key) const;
  [[nodiscard]] const nlohmann::json* find(std::string_view key) const;

  // Fields every decoder here shares: sizes, heads, norms, RoPE (rope_theta/rope_scaling, or
  // rope_parameters), tying, eos ids.
  void read_common(ModelConfig& c) const;

 private:
  const nlohmann::json& json_;
};

}  // namespace capserve::runtime
