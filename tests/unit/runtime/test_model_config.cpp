// Bad config.json values and checkpoints that do not match their config get a LoadError naming the key or
// tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

// The backend the models load onto (the CPU: their weights stay views of the checkpoint).
kernels::Backend& cpu_backend() {
  static kernels::cpu::CpuBackend backend(1);
  return backend;
}

// A temporary model directory: the fixture's safetensors files linked in, config.json edited by the test.
class EditedModel {
 public:
  explicit EditedModel(const std::string& fixture)
      : dir_(fs::temp_directory_path() / ("capserve_cfg_" + fixture + "_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const fs::path src = testing::fixture_models_dir() / fixture;
    for (const auto& e : fs::directory_iterator(src)) {
      const std::string name = e.path().filename().string();
      if (name.find("safetensors") != std::string::npos) fs::create_symlink(e.path(), dir_ / name);
    }
    config_ = read_json_file(src / "config.json");
  }
  ~EditedModel() { fs::remove_all(dir_); }
  EditedModel(const EditedModel&) = delete;
  EditedModel& operator=(const EditedModel&) = delete;

  nlohmann::json& config() { return config_; }
  [[nodiscard]] const fs::path& dir() const { return dir_; }

  // The LoadError message of loading the edited model, or "" when it loads.
  std::string load_error() { return load_error_of(config_.dump()); }

  std::string load_error_of(const std::string& config_text) {
    std::ofstream(dir_ / "config.json") << config_text;
    try {
      Model::load(dir_, cpu_backend());
    } catch (const LoadError& e) {
      return e.what();
    }
    return "";
  }

 private:
  fs::path dir_;
  nlohmann::json config_;
};

#define EXPECT_ERROR_MENTIONS(model, text) \
  EXPECT_NE((model).load_error().find(text), std::string::npos) << (model).load_error()

TEST(ModelConfig, UneditedFixtureLoads) {
  EditedModel m("mixtral_sharded");
  EXPECT_EQ(m.load_error(), "");
}

// Hub configs written by transformers 4.x carry top-level rope_theta + rope_scaling instead of
// rope_parameters.
TEST(ModelConfig, LegacyRopeKeysGiveTheSameModel) {
  EditedModel m("olmoe_bf16");
  const nlohmann::json params = m.config()["rope_parameters"];
  m.config().erase("rope_parameters");
  m.config()["rope_theta"] = params["rope_theta"];
  m.config()["rope_scaling"] = {{"type", params["rope_type"]}, {"factor", params["factor"]}};
  ASSERT_EQ(m.load_error(), "");
  const auto legacy = Model::load(m.dir(), cpu_backend());
  const auto current = Model::load(testing::fixture_models_dir() / "olmoe_bf16", cpu_backend());
  EXPECT_EQ(legacy->config().rope_theta, current->config().rope_theta);
  EXPECT_EQ(legacy->config().rope_scaling.type, RopeScaling::Type::linear);
  EXPECT_EQ(legacy->config().rope_scaling.factor, current->config().rope_scaling.factor);
}

TEST(ModelConfig, MissingKeyIsNamed) {
  EditedModel m("mixtral_sharded");
  m.config().erase("hidden_size");
  EXPECT_ERROR_MENTIONS(m, "'hidden_size' is missing");
}

TEST(ModelConfig, WrongTypeIsNamed) {
  EditedModel m("mixtral_sharded");
  m.config()["num_hidden_layers"] = "two";
  EXPECT_ERROR_MENTIONS(m, "'num_hidden_layers' must be an integer, got string");
  EditedModel q("qwen2_moe");
  q.config()["mlp_only_layers"] = {1, "x"};
  EXPECT_ERROR_MENTIONS(q, "'mlp_only_layers' must be a list of integers");
  EditedModel o("olmoe_bf16");
  o.config()["norm_topk_prob"] = 1;
  EXPECT_ERROR_MENTIONS(o, "'norm_topk_prob' must be a boolean");
}

TEST(ModelConfig, UnsupportedArchitectureListsTheSupportedOnes) {
  EditedModel m("mixtral_sharded");
  m.config()["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_ERROR_MENTIONS(m,
                        "supported: MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, "
                        "Qwen3MoeForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)");
  m.config().erase("architectures");
  EXPECT_ERROR_MENTIONS(m, "'architectures' is missing");
}

TEST(ModelConfig, InconsistentValuesAreNamed) {
  EditedModel m("mixtral_sharded");
  m.config()["num_key_value_heads"] = 3;
  EXPECT_ERROR_MENTIONS(m, "'num_key_value_heads' (3) must divide num_attention_heads (4)");
  m.config()["num_key_value_heads"] = 2;
  m.config()["num_experts_per_tok"] = 9;
  EXPECT_ERROR_MENTIONS(m, "'num_experts_per_tok' (9) exceeds the number of experts (8)");
}

TEST(ModelConfig, UnsupportedRopeTypeIsNamed) {
  EditedModel m("mixtral_sharded");
  m.config()["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 10000.0}};
  EXPECT_ERROR_MENTIONS(m, "rope type 'longrope'");
  m.config()["rope_parameters"] = {{"rope_type", "linear"}, {"rope_theta", 10000.0}};
  EXPECT_ERROR_MENTIONS(m, "rope_parameters.factor");
}

// Dynamic (NTK) scaling, as rope_parameters (transformers 5.x) or rope_scaling with "type" or "rope_type"
// (4.x): the threshold is max_position_embeddings (transformers 5.23 reads no
// original_max_position_embeddings for it), and the engine runs sequences up to factor x
// max_position_embeddings.
TEST(ModelConfig, DynamicRopeIsAcceptedInEveryForm) {
  EditedModel m("mixtral_dynamic_rope");
  ASSERT_EQ(m.load_error(), "");
  const auto expect_dynamic = [](const ModelConfig& c) {
    EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::dynamic);
    EXPECT_EQ(c.rope_scaling.factor, 4.0);
    EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 16.0);
    EXPECT_EQ(c.rope_theta, 10000.0);
    EXPECT_EQ(c.max_context_length(), 64);
  };
  expect_dynamic(Model::load(m.dir(), cpu_backend())->config());
  m.config().erase("rope_parameters");
  m.config()["rope_theta"] = 10000.0;
  for (const char* type_key : {"type", "rope_type"}) {
    m.config()["rope_scaling"] = {
        {type_key, "dynamic"}, {"factor", 4}, {"original_max_position_embeddings", 8}};
    ASSERT_EQ(m.load_error(), "") << type_key;
    expect_dynamic(Model::load(m.dir(), cpu_backend())->config());
  }
}

TEST(ModelConfig, DynamicRopeFactorErrorsAreNamed) {
  EditedModel m("mixtral_dynamic_rope");
  m.config()["rope_parameters"].erase("factor");
  EXPECT_ERROR_MENTIONS(
      m, "'rope_parameters.factor' is missing or not a number (needed by rope type 'dynamic')");
  m.config()["rope_parameters"]["factor"] = 0;
  EXPECT_ERROR_MENTIONS(m, "'rope_parameters.factor' must be positive, got 0");
  m.config().erase("rope_parameters");
  m.config()["rope_scaling"] = {{"type", "dynamic"}, {"factor", -2.5}};
  EXPECT_ERROR_MENTIONS(m, "'rope_scaling.factor' must be positive, got -2.5");
  m.config()["rope_scaling"] = {{"type", "dynamic"}, {"factor", "4"}};
  EXPECT_ERROR_MENTIONS(m, "'rope_scaling.factor' is missing or not a number");
}

TEST(ModelConfig, MissingTensorIsNamed) {
  EditedModel m("mixtral_sharded");
  m.config()["num_hidden_layers"] = 3;
  EXPECT_ERROR_MENTIONS(m, "model.layers.2.");
}

TEST(ModelConfig, ExtraTensorsAreListed) {
  EditedModel m("mixtral_sharded");
  m.config()["num_hidden_layers"] = 1;
  EXPECT_ERROR_MENTIONS(m, "model.layers.1.");
}

TEST(ModelConfig, WrongShapeNamesTensorAndFile) {
  EditedModel m("mixtral_sharded");
  m.config()["intermediate_size"] = 95;
  const std::string err = m.load_error();
  EXPECT_NE(err.find("block_sparse_moe.experts.0.w1.weight"), std::string::npos) << err;
  EXPECT_NE(err.find(".safetensors"), std::string::npos) << err;
}

TEST(ModelConfig, MissingOrBrokenConfigFile) {
  EXPECT_THROW(Model::load("/nonexistent/capserve", cpu_backend()), LoadError);
  EditedModel m("mixtral_sharded");
  m.config() = nlohmann::json::array({1, 2});
  EXPECT_ERROR_MENTIONS(m, "must be a JSON object");
  EXPECT_NE(m.load_error_of("{\"vocab_size\": 12,").find("invalid JSON"), std::string::npos);
}

TEST(ModelConfig, DeepSeekFixturesLoadAndHoldTheirShape) {
  EditedModel lite("deepseek_v2_lite");
  EXPECT_EQ(lite.load_error(), "");
  const auto model = Model::load(testing::fixture_models_dir() / "deepseek_v2", cpu_backend());
  const ModelConfig& c = model->config();
  ASSERT_TRUE(c.mla.has_value());
  EXPECT_EQ(c.mla->q_lora_rank, 48);
  EXPECT_EQ(c.head_dim, 32);  // query-key head dim, not config.json's head_dim (the rope dim)
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::yarn);
  EXPECT_EQ(c.router.n_group, 4);
  EXPECT_EQ(c.router.topk_group, 2);
  EXPECT_EQ(c.router.scaling, 2.5);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2 * c.moe_intermediate_size);
  // first_k_dense_replace 1, moe_layer_freq 2
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, false, true, false, true}));
  // YaRN: mscale(8, 0.707)^2 / sqrt(32) in the softmax scale; mscale(8, 1) / mscale(8, 0.707) on cos/sin
  const double mscale_all = 0.1 * 0.707 * std::log(8.0) + 1.0;
  EXPECT_NEAR(*c.softmax_scale, mscale_all * mscale_all / std::sqrt(32.0), 1e-12);
  EXPECT_NEAR(c.rope_scaling.attention_factor, (0.1 * std::log(8.0) + 1.0) / mscale_all, 1e-12);
}

// Qwen3-MoE: the released checkpoints name the expert count num_experts (transformers 5 writes
// num_local_experts); either gives the same model, with per-head q/k norms and the Qwen layer rule.
TEST(ModelConfig, Qwen3MoeReadsEitherExpertCountKey) {
  EditedModel m("qwen3_moe");
  m.config()["num_experts"] = m.config()["num_local_experts"];
  m.config().erase("num_local_experts");
  ASSERT_EQ(m.load_error(), "");
  const auto hub = Model::load(m.dir(), cpu_backend());
  const ModelConfig& c = hub->config();
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.head_dim, 24);
  EXPECT_EQ(c.qk_norm, QkNorm::per_head);
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  m.config()["use_sliding_window"] = true;
  EXPECT_ERROR_MENTIONS(m, "use_sliding_window");
}

// generation_config.json's eos ids join config.json's (Qwen3 and Llama 3 list several there only); a
// malformed file fails the load naming it.
TEST(ModelConfig, GenerationConfigAddsEosIdsAndSamplingDefaults) {
  EditedModel m("qwen3_moe");
  std::ofstream(m.dir() / "generation_config.json") << R"({"eos_token_id": [7, 2], "temperature": 0.7})";
  ASSERT_EQ(m.load_error(), "");
  const auto model = Model::load(m.dir(), cpu_backend());
  EXPECT_EQ(model->config().eos_token_ids, (std::vector<std::int32_t>{2, 7}));
  EXPECT_FLOAT_EQ(*model->config().generation.temperature, 0.7F);
  std::ofstream(m.dir() / "generation_config.json") << R"({"top_p": 2})";
  EXPECT_ERROR_MENTIONS(m, "generation_config.json: key 'top_p' must be in [0");
}

// FP8 quantization: only DeepSeek-V3's block scheme; each other form is named.
TEST(ModelConfig, Fp8QuantizationConfigErrorsAreNamed) {
  EditedModel m("deepseek_v3_fp8");
  ASSERT_EQ(m.load_error(), "");
  nlohmann::json& q = m.config()["quantization_config"];
  q["weight_block_size"] = {16, 32};
  EXPECT_ERROR_MENTIONS(
      m, "'model.layers.0.self_attn.q_a_proj.weight_scale_inv' has shape [3, 4], expected [3, 2]");
  q["weight_block_size"] = {16};
  EXPECT_ERROR_MENTIONS(m, "'quantization_config.weight_block_size' must be two positive integers, got [16]");
  q.erase("weight_block_size");
  EXPECT_ERROR_MENTIONS(m, "per-tensor FP8 scales are not supported");
  q["weight_block_size"] = {16, 16};
  q["quant_method"] = "awq";
  EXPECT_ERROR_MENTIONS(m, "'quantization_config.quant_method' is 'awq', which is not supported");
  q["quant_method"] = "fp8";
  q["activation_scheme"] = "static";
  EXPECT_ERROR_MENTIONS(m, "'quantization_config.activation_scheme' is 'static'");
  m.config().erase("quantization_config");
  EXPECT_ERROR_MENTIONS(m, "is stored as F8_E4M3 but config.json has no FP8 quantization_config");
}

// Hub configs (DeepSeek's own config.json) use the legacy keys: top-level rope_theta + rope_scaling with
// "type": "yarn", no head_dim, and the routing keys transformers does not know.
TEST(ModelConfig, DeepSeekHubStyleConfigGivesTheSameModel) {
  EditedModel m("deepseek_v2_lite");
  const nlohmann::json params = m.config()["rope_parameters"];
  m.config().erase("rope_parameters");
  m.config().erase("head_dim");
  m.config()["rope_theta"] = params["rope_theta"];
  nlohmann::json scaling = params;
  scaling.erase("rope_type");
  scaling.erase("rope_theta");
  scaling["type"] = "yarn";
  m.config()["rope_scaling"] = scaling;
  m.config()["scoring_func"] = "softmax";
  m.config()["aux_loss_alpha"] = 0.001;
  ASSERT_EQ(m.load_error(), "");
  const auto hub = Model::load(m.dir(), cpu_backend());
  const auto current = Model::load(testing::fixture_models_dir() / "deepseek_v2_lite", cpu_backend());
  EXPECT_EQ(hub->config().softmax_scale, current->config().softmax_scale);
  EXPECT_EQ(hub->config().rope_scaling.attention_factor, current->config().rope_scaling.attention_factor);
  EXPECT_EQ(hub->config().head_dim, current->config().head_dim);
}

TEST(ModelConfig, DeepSeekRoutingErrorsAreNamed) {
  EditedModel m("deepseek_v2");
  m.config()["topk_method"] = "noaux_tc";
  EXPECT_ERROR_MENTIONS(m, "'topk_method' is 'noaux_tc'; supported: greedy, group_limited_greedy");
  m.config()["topk_method"] = "group_limited_greedy";
  m.config()["n_group"] = 3;
  EXPECT_ERROR_MENTIONS(m, "'n_group' (3) must divide the number of experts (16)");
  m.config()["n_group"] = 4;
  m.config()["topk_group"] = 5;
  EXPECT_ERROR_MENTIONS(m, "'topk_group' (5) must be between 1 and n_group (4)");
  m.config()["topk_group"] = 1;
  m.config()["num_experts_per_tok"] = 5;
  EXPECT_ERROR_MENTIONS(m, "'num_experts_per_tok' (5) exceeds the 4 experts of the topk_group best groups");
  m.config()["num_experts_per_tok"] = 3;
  m.config().erase("n_group");
  EXPECT_ERROR_MENTIONS(m, "'n_group' is missing");
  m.config()["n_group"] = 4;
  m.config()["scoring_func"] = "sigmoid";
  EXPECT_ERROR_MENTIONS(m, "'scoring_func' is 'sigmoid'");
  m.config()["scoring_func"] = "softmax";
  m.config()["routed_scaling_factor"] = 0;
  EXPECT_ERROR_MENTIONS(m, "'routed_scaling_factor' must be a positive number");
  m.config()["routed_scaling_factor"] = 2.5;
  m.config()["moe_layer_freq"] = 0;
  EXPECT_ERROR_MENTIONS(m, "'moe_layer_freq' must be positive");
}

// DeepSeek's MoEGate: norm_topk_prob renormalizes the top-k weights instead of scaling them.
TEST(ModelConfig, DeepSeekNormTopkProbReplacesTheScaling) {
  EditedModel m("deepseek_v2");
  m.config()["norm_topk_prob"] = true;
  ASSERT_EQ(m.load_error(), "");
  const auto model = Model::load(m.dir(), cpu_backend());
  EXPECT_TRUE(model->config().norm_topk_prob);
  EXPECT_EQ(model->config().router.scaling, 1.0);
}

TEST(ModelConfig, DeepSeekAttentionErrorsAreNamed) {
  EditedModel m("deepseek_v2_lite");
  m.config().erase("kv_lora_rank");
  EXPECT_ERROR_MENTIONS(m, "'kv_lora_rank' is missing");
  m.config()["kv_lora_rank"] = 32;
  m.config()["qk_rope_head_dim"] = 15;
  EXPECT_ERROR_MENTIONS(m, "'qk_rope_head_dim' must be even");
  m.config()["qk_rope_head_dim"] = 16;
  m.config()["rope_parameters"].erase("factor");
  EXPECT_ERROR_MENTIONS(m, "rope_parameters.factor");
}

TEST(ModelConfig, DeepSeekTensorErrorsAreNamed) {
  EditedModel m("deepseek_v2_lite");
  m.config()["q_lora_rank"] = 24;  // the checkpoint has q_proj, not the q LoRA
  EXPECT_ERROR_MENTIONS(m, "model.layers.0.self_attn.q_a_proj.weight");
  m.config()["q_lora_rank"] = nullptr;
  m.config()["kv_lora_rank"] = 30;
  std::string err = m.load_error();
  EXPECT_NE(err.find("self_attn.kv_a_proj_with_mqa.weight"), std::string::npos) << err;
  EXPECT_NE(err.find(".safetensors"), std::string::npos) << err;
  m.config()["kv_lora_rank"] = 32;
  m.config()["moe_layer_freq"] = 2;  // layer 1 becomes dense: no mlp.gate_proj there
  EXPECT_ERROR_MENTIONS(m, "model.layers.1.mlp.gate_proj.weight");
  m.config()["moe_layer_freq"] = 1;
  m.config()["n_shared_experts"] = nullptr;  // the checkpoint's shared experts are then left over
  err = m.load_error();
  EXPECT_NE(err.find("mlp.shared_experts."), std::string::npos) << err;
}

}  // namespace
}  // namespace capserve::runtime
