// Bad config.json values and checkpoints that do not match their config get a LoadError naming the key or
// tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "runtime/load_error.h"
#include "runtime/model.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

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
      Model::load(dir_);
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
  const auto legacy = Model::load(m.dir());
  const auto current = Model::load(testing::fixture_models_dir() / "olmoe_bf16");
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
  EXPECT_ERROR_MENTIONS(m, "MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM");
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
  EXPECT_THROW(Model::load("/nonexistent/capserve"), LoadError);
  EditedModel m("mixtral_sharded");
  m.config() = nlohmann::json::array({1, 2});
  EXPECT_ERROR_MENTIONS(m, "must be a JSON object");
  EXPECT_NE(m.load_error_of("{\"vocab_size\": 12,").find("invalid JSON"), std::string::npos);
}

}  // namespace
}  // namespace capserve::runtime
