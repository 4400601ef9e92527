#include "runtime/model_config.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

[[noreturn]] void fail(std::string_view key, std::string_view what) {
  throw LoadError("config.json: key '" + std::string(key) + "' " + std::string(what));
}

std::string type_of(const nlohmann::json& v) {
  return v.type_name();
}

}  // namespace

const nlohmann::json* ConfigReader::find(std::string_view key) const {
  const auto it = json_.find(key);
  if (it == json_.end() || it->is_null()) return nullptr;
  return &*it;
}

std::int64_t ConfigReader::integer(std::string_view key) const {
  const nlohmann::json* v = find(key);
  if (v == nullptr) fail(key, "is missing");
  if (!v->is_number_integer()) fail(key, "must be an integer, got " + type_of(*v));
  return v->get<std::int64_t>();
}

std::int64_t ConfigReader::integer_or(std::string_view key, std::int64_t fallback) const {
  return find(key) == nullptr ? fallback : integer(key);
}

double ConfigReader::number(std::string_view key) const {
  const nlohmann::json* v = find(key);
  if (v == nullptr) fail(key, "is missing");
  if (!v->is_number()) fail(key, "must be a number, got " + type_of(*v));
  return v->get<double>();
}

double ConfigReader::number_or(std::string_view key, double fallback) const {
  return find(key) == nullptr ? fallback : number(key);
}

std::optional<double> ConfigReader::optional_number(std::string_view key) const {
  if (find(key) == nullptr) return std::nullopt;
  return number(key);
}

bool ConfigReader::boolean_or(std::string_view key, bool fallback) const {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) fail(key, "must be a boolean, got " + type_of(*v));
  return v->get<bool>();
}

std::string ConfigReader::string_or(std::string_view key, std::string_view fallback) const {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return std::string(fallback);
  if (!v->is_string()) fail(key, "must be a string, got " + type_of(*v));
  return v->get<std::string>();
}

std::vector<std::int64_t> ConfigReader::integer_list_or_empty(std::string_view key) const {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return {};
  if (!v->is_array()) fail(key, "must be a list of integers, got " + type_of(*v));
  std::vector<std::int64_t> out;
  for (const auto& e : *v) {
    if (!e.is_number_integer()) fail(key, "must be a list of integers, found " + type_of(e));
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

namespace {

// rope_scaling (transformers 4.x, and the Hub) or rope_parameters (transformers 5.x) share their inner keys.
RopeScaling read_rope_scaling(const nlohmann::json& obj, std::string_view key,
                              std::int64_t max_position_embeddings) {
  if (!obj.is_object()) fail(key, "must be an object, got " + type_of(obj));
  const ConfigReader r(obj);
  std::string type = "default";
  for (const char* type_key : {"rope_type", "type"}) {
    if (const nlohmann::json* t = r.find(type_key)) {
      if (!t->is_string()) fail(std::string(key) + "." + type_key, "must be a string, got " + type_of(*t));
      type = t->get<std::string>();
      break;
    }
  }
  RopeScaling s;
  if (type == "default") return s;
  const auto sub = [&](std::string_view k) {
    try {
      return r.number(k);
    } catch (const LoadError&) {
      fail(std::string(key) + "." + std::string(k),
           "is missing or not a number (needed by rope type '" + type + "')");
    }
  };
  if (type == "linear") {
    s.type = RopeScaling::Type::linear;
    s.factor = sub("factor");
  } else if (type == "dynamic") {
    // transformers' _compute_dynamic_ntk_parameters: the threshold and the formula's length are
    // max_position_embeddings; an original_max_position_embeddings here is not read.
    s.type = RopeScaling::Type::dynamic;
    s.factor = sub("factor");
    if (s.factor <= 0)
      fail(std::string(key) + ".factor", "must be positive, got " + r.find("factor")->dump());
    s.original_max_position_embeddings = static_cast<double>(max_position_embeddings);
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::llama3;
    s.factor = sub("factor");
    s.low_freq_factor = sub("low_freq_factor");
    s.high_freq_factor = sub("high_freq_factor");
    s.original_max_position_embeddings = sub("original_max_position_embeddings");
  } else if (type == "yarn") {
    // transformers' _compute_yarn_parameters, defaults included.
    s.type = RopeScaling::Type::yarn;
    s.factor = sub("factor");
    s.original_max_position_embeddings =
        r.number_or("original_max_position_embeddings", static_cast<double>(max_position_embeddings));
    // A 0 or absent beta means the paper's default, as in transformers (`or 32`, `or 1`).
    const double beta_fast = r.number_or("beta_fast", 0.0);
    const double beta_slow = r.number_or("beta_slow", 0.0);
    s.beta_fast = beta_fast != 0.0 ? beta_fast : 32.0;
    s.beta_slow = beta_slow != 0.0 ? beta_slow : 1.0;
    s.truncate = r.boolean_or("truncate", true);
    const double mscale = r.number_or("mscale", 0.0);
    const double mscale_all_dim = r.number_or("mscale_all_dim", 0.0);
    if (const std::optional<double> given = r.optional_number("attention_factor")) {
      s.attention_factor = *given;
    } else if (mscale != 0.0 && mscale_all_dim != 0.0) {
      s.attention_factor = yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, mscale_all_dim);
    } else {
      s.attention_factor = yarn_mscale(s.factor, 1.0);
    }
  } else {
    fail(key, "has rope type '" + type +
                  "', which is not supported (supported: default, linear, dynamic, llama3, yarn)");
  }
  s.mscale_all_dim = r.number_or("mscale_all_dim", 0.0);
  return s;
}

// quantization_config: only DeepSeek-V3's block-quantized FP8 weights (their activations are quantized per
// token group at run time by the reference, "dynamic"; here they stay f32, the weights dequantized).
Fp8BlockShape read_fp8_quantization(const nlohmann::json& q) {
  const std::string key = "quantization_config";
  if (!q.is_object()) fail(key, "must be an object, got " + type_of(q));
  const ConfigReader r(q);
  const auto text = [&](const char* name, const char* fallback) {
    const nlohmann::json* v = r.find(name);
    if (v == nullptr) return std::string(fallback);
    if (!v->is_string()) fail(key + "." + name, "must be a string, got " + type_of(*v));
    return v->get<std::string>();
  };
  if (const std::string method = text("quant_method", ""); method != "fp8")
    fail(key + ".quant_method",
         "is '" + method +
             "', which is not supported (supported: fp8 with a weight_block_size, as DeepSeek-V3)");
  if (const std::string fmt = text("fmt", "e4m3"); fmt != "e4m3")
    fail(key + ".fmt", "is '" + fmt + "', which is not supported (supported: e4m3)");
  if (const std::string scheme = text("activation_scheme", "dynamic"); scheme != "dynamic")
    fail(key + ".activation_scheme", "is '" + scheme + "', which is not supported (supported: dynamic)");
  const nlohmann::json* block = r.find("weight_block_size");
  if (block == nullptr)
    fail(key + ".weight_block_size", "is missing (per-tensor FP8 scales are not supported)");
  if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<std::int64_t>() <= 0 ||
      (*block)[1].get<std::int64_t>() <= 0)
    fail(key + ".weight_block_size", "must be two positive integers, got " + block->dump());
  return {(*block)[0].get<std::int64_t>(), (*block)[1].get<std::int64_t>()};
}

}  // namespace

void ConfigReader::read_common(ModelConfig& c) const {
  c.vocab_size = integer("vocab_size");
  c.hidden_size = integer("hidden_size");
  c.num_layers = integer("num_hidden_layers");
  c.num_heads = integer("num_attention_heads");
  c.num_kv_heads = integer_or("num_key_value_heads", c.num_heads);
  c.head_dim = integer_or("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.max_position_embeddings = integer("max_position_embeddings");
  c.rms_norm_eps = number("rms_norm_eps");
  c.tie_word_embeddings = boolean_or("tie_word_embeddings", false);

  if (const nlohmann::json* params = find("rope_parameters")) {
    c.rope_scaling = read_rope_scaling(*params, "rope_parameters", c.max_position_embeddings);
    c.rope_theta = ConfigReader(*params).number_or("rope_theta", number_or("rope_theta", 10000.0));
  } else {
    c.rope_theta = number_or("rope_theta", 10000.0);
    if (const nlohmann::json* scaling = find("rope_scaling"))
      c.rope_scaling = read_rope_scaling(*scaling, "rope_scaling", c.max_position_embeddings);
  }

  if (const nlohmann::json* q = find("quantization_config")) c.fp8_blocks = read_fp8_quantization(*q);
  for (const char* key : {"dtype", "torch_dtype"}) {
    const std::string name = string_or(key, "");
    if (name.empty()) continue;
    if (name == "bfloat16") c.torch_dtype = kernels::DType::bf16;
    if (name == "float16") c.torch_dtype = kernels::DType::f16;
    if (name == "float32") c.torch_dtype = kernels::DType::f32;
    break;
  }

  if (const nlohmann::json* eos = find("eos_token_id")) {
    if (eos->is_number_integer()) {
      c.eos_token_ids = {eos->get<std::int32_t>()};
    } else {
      for (std::int64_t id : integer_list_or_empty("eos_token_id"))
        c.eos_token_ids.push_back(static_cast<std::int32_t>(id));
    }
  }
}

std::int64_t ModelConfig::max_context_length() const {
  if (rope_scaling.type != RopeScaling::Type::dynamic) return max_position_embeddings;
  return std::max(
      max_position_embeddings,
      static_cast<std::int64_t>(rope_scaling.factor * static_cast<double>(max_position_embeddings)));
}

void ModelConfig::validate() const {
  const auto positive = [](std::string_view key, std::int64_t v) {
    if (v <= 0) fail(key, "must be positive, got " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_layers);
  positive("num_attention_heads", num_heads);
  positive("num_key_value_heads", num_kv_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_heads % num_kv_heads != 0) {
    fail("num_key_value_heads", "(" + std::to_string(num_kv_heads) + ") must divide num_attention_heads (" +
                                    std::to_string(num_heads) + ")");
  }
  if (mla) {
    positive("kv_lora_rank", mla->kv_lora_rank);
    positive("qk_rope_head_dim", mla->qk_rope_head_dim);
    positive("v_head_dim", mla->v_head_dim);
    if (mla->q_lora_rank < 0) fail("q_lora_rank", "must not be negative");
    positive("qk_nope_head_dim", mla->qk_nope_head_dim);
    if (mla->qk_rope_head_dim % 2 != 0) fail("qk_rope_head_dim", "must be even for rotary embeddings");
  } else if (head_dim % 2 != 0) {
    fail("head_dim", "must be even for rotary embeddings");
  }
  if (rms_norm_eps <= 0) fail("rms_norm_eps", "must be positive");
  if (rope_theta <= 0) fail("rope_theta", "must be positive");
  if (rope_scaling.factor <= 0) fail("rope_scaling.factor", "must be positive");
  if (rope_scaling.type == RopeScaling::Type::yarn && rope_scaling.original_max_position_embeddings <= 0)
    fail("rope_scaling.original_max_position_embeddings", "must be positive");
  // Dynamic scaling raises the base to the power dim / (dim - 2).
  if (rope_scaling.type == RopeScaling::Type::dynamic && rotary_dim() <= 2)
    fail(mla ? "qk_rope_head_dim" : "head_dim", "must exceed 2 for dynamic rope scaling");
  if (sliding_window < 0) fail("sliding_window", "must not be negative");
  if (static_cast<std::int64_t>(layer_is_moe.size()) != num_layers)
    fail("num_hidden_layers", "does not match the layer plan");
  bool any_moe = false;
  bool any_dense = false;
  for (const bool moe : layer_is_moe) (moe ? any_moe : any_dense) = true;
  for (const bool moe : mtp_layer_is_moe) (moe ? any_moe : any_dense) = true;
  if (any_moe) {
    positive("num_experts", num_experts);
    positive("num_experts_per_tok", top_k);
    positive("moe_intermediate_size", moe_intermediate_size);
    if (top_k > num_experts) {
      fail("num_experts_per_tok", "(" + std::to_string(top_k) + ") exceeds the number of experts (" +
                                      std::to_string(num_experts) + ")");
    }
    positive("n_group", router.n_group);
    if (num_experts % router.n_group != 0) {
      fail("n_group", "(" + std::to_string(router.n_group) + ") must divide the number of experts (" +
                          std::to_string(num_experts) + ")");
    }
    if (router.topk_group <= 0 || router.topk_group > router.n_group) {
      fail("topk_group", "(" + std::to_string(router.topk_group) + ") must be between 1 and n_group (" +
                             std::to_string(router.n_group) + ")");
    }
    if (router.group_top2_sum && num_experts / router.n_group < 2) {
      fail("n_group", "(" + std::to_string(router.n_group) +
                          ") leaves fewer than the two experts per group " + "that rank a group");
    }
    const std::int64_t eligible = router.topk_group * (num_experts / router.n_group);
    if (top_k > eligible) {
      fail("num_experts_per_tok", "(" + std::to_string(top_k) + ") exceeds the " + std::to_string(eligible) +
                                      " experts of the topk_group best groups");
    }
    if (!(router.scaling > 0) || !std::isfinite(router.scaling))
      fail("routed_scaling_factor", "must be a positive number");
  }
  if (any_dense) positive("intermediate_size", dense_intermediate_size);
  for (const std::int32_t id : eos_token_ids) {
    if (id < 0 || id >= vocab_size) fail("eos_token_id", "is outside the vocabulary");
  }
}

}  // namespace capserve::runtime
