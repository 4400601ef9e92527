// DeepSeek-V3 checkpoints as released, beyond the HF parity tests: the multi-token-prediction layer after the
// decoder's (model.layers.<num_hidden_layers>.*) is checked and skipped unread, while every other tensor the
// model does not use still fails the load; the router's correction bias may be stored as BF16 or F16.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/weight_convert.h"
#include "runtime/engine.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "tests/unit/runtime/fixture_models.h"
#include "tests/unit/runtime/weights/safetensors_test_files.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

struct StoredTensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};
using Tensors = std::map<std::string, StoredTensor>;

constexpr std::size_t element_bytes(const std::string& dtype) {
  return dtype == "F32" ? 4 : dtype == "BF16" || dtype == "F16" ? 2 : 1;
}

// A copy of a fixture whose model.safetensors holds the fixture's tensors as `edit` leaves them.
class EditedCheckpoint {
 public:
  EditedCheckpoint(const std::string& fixture, const std::function<void(Tensors&)>& edit) {
    const fs::path src = testing::fixture_models_dir() / fixture;
    fs::copy_file(src / "config.json", dir() / "config.json");
    std::ifstream in(src / "model.safetensors", std::ios::binary);
    const std::string raw{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::uint64_t header_size = 0;
    std::memcpy(&header_size, raw.data(), sizeof header_size);
    const std::string data = raw.substr(8 + header_size);
    Tensors tensors;
    const nlohmann::json stored = nlohmann::json::parse(raw.substr(8, header_size));
    for (const auto& [name, info] : stored.items()) {
      if (name == "__metadata__") continue;
      const auto offsets = info["data_offsets"].get<std::vector<std::size_t>>();
      tensors[name] = {info["dtype"], info["shape"].get<std::vector<std::int64_t>>(),
                       data.substr(offsets[0], offsets[1] - offsets[0])};
    }
    edit(tensors);
    // Widest elements first, so that every tensor starts aligned to its element size.
    std::vector<const Tensors::value_type*> order;
    for (const auto& entry : tensors) order.push_back(&entry);
    std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
      return element_bytes(a->second.dtype) > element_bytes(b->second.dtype);
    });
    nlohmann::json header = nlohmann::json::object();
    std::string out;
    for (const auto* entry : order) {
      const StoredTensor& t = entry->second;
      header[entry->first] = {{"dtype", t.dtype},
                              {"shape", t.shape},
                              {"data_offsets", {out.size(), out.size() + t.bytes.size()}}};
      out += t.bytes;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    testing::write_file(dir() / "model.safetensors", testing::st_bytes(text, out));
  }

  [[nodiscard]] const fs::path& dir() const { return temp_.path(); }

  // The LoadError message of loading it, or "" when it loads.
  [[nodiscard]] std::string load_error(const ParallelOptions& options = {}) const {
    kernels::cpu::CpuBackend backend(1);
    try {
      Model::load(dir(), backend, options);
    } catch (const LoadError& e) {
      return e.what();
    }
    return "";
  }

 private:
  testing::TempDir temp_;
};

bool is_mtp_layer(const std::string& name, const ModelConfig& c) {
  return name.starts_with("model.layers." + std::to_string(c.num_layers) + ".");
}

class DeepSeekV3Mtp : public ::testing::TestWithParam<std::string> {
 protected:
  kernels::cpu::CpuBackend backend_{1};
};

// The fixtures carry the MTP layer as released (deepseek_v3_fp8 with its own embed_tokens and
// shared_head.head, F8_E4M3 matrices; deepseek_v3 without those two). The load skips it without reading: the
// model's resident bytes are those of the same checkpoint without the layer. Old code refused the load: "has
// 66 tensors the model does not use: 'model.layers.3.eh_proj.weight' ...".
TEST_P(DeepSeekV3Mtp, LayerIsCheckedAndSkippedUnread) {
  const auto model = Model::load(testing::fixture_models_dir() / GetParam(), backend_);
  const ModelConfig& c = model->config();
  ASSERT_EQ(c.mtp_layer_is_moe, std::vector<bool>{true}) << "num_nextn_predict_layers 1, layer 3 is MoE";
  const EditedCheckpoint without(GetParam(), [&](Tensors& t) {
    ASSERT_TRUE(t.contains("model.layers.3.eh_proj.weight")) << "the fixture lacks its MTP layer";
    std::erase_if(t, [&](const auto& entry) { return is_mtp_layer(entry.first, c); });
  });
  kernels::cpu::CpuBackend backend(1);
  const auto plain = Model::load(without.dir(), backend);
  EXPECT_EQ(model->weights().bytes, plain->weights().bytes);
  EXPECT_GT(model->weights().bytes, 0);
}

// MTP speculation loads the layer, so a checkpoint without it (the config declaring one) is refused by name.
TEST_P(DeepSeekV3Mtp, LoadingForMtpNeedsTheLayer) {
  const EditedCheckpoint without(GetParam(), [&](Tensors& t) {
    std::erase_if(t, [&](const auto& entry) { return entry.first.starts_with("model.layers.3."); });
  });
  ParallelOptions mtp;
  mtp.mtp = true;
  const std::string error = without.load_error(mtp);
  EXPECT_NE(error.find("model.layers.3.eh_proj.weight"), std::string::npos) << error;
  EXPECT_EQ(without.load_error(), "");
}

// Strict everywhere else: a tensor past the MTP layers, an unknown name inside one, a part of one, a
// misshapen one, and MTP tensors the config does not declare all fail naming the tensor.
TEST_P(DeepSeekV3Mtp, EveryOtherTensorIsStillChecked) {
  const auto copy_of = [&](const std::string& from, const std::string& to) {
    return EditedCheckpoint(GetParam(), [&](Tensors& t) { t[to] = t.at(from); });
  };
  EXPECT_NE(copy_of("model.layers.3.eh_proj.weight", "model.layers.4.eh_proj.weight")
                .load_error()
                .find("1 tensor the model does not use: 'model.layers.4.eh_proj.weight'"),
            std::string::npos);
  EXPECT_NE(copy_of("model.layers.3.enorm.weight", "model.layers.3.self_attn.extra_norm.weight")
                .load_error()
                .find("1 tensor the model does not use: 'model.layers.3.self_attn.extra_norm.weight'"),
            std::string::npos);
  const EditedCheckpoint partial(GetParam(), [](Tensors& t) { t.erase("model.layers.3.eh_proj.weight"); });
  EXPECT_NE(partial.load_error().find("tensors the model does not use: 'model.layers.3."), std::string::npos)
      << partial.load_error();
  const EditedCheckpoint no_enorm(GetParam(), [](Tensors& t) { t.erase("model.layers.3.enorm.weight"); });
  EXPECT_NE(no_enorm.load_error().find("tensor 'model.layers.3.enorm.weight' not found"), std::string::npos);
  const EditedCheckpoint misshapen(GetParam(), [](Tensors& t) {
    StoredTensor& eh = t.at("model.layers.3.eh_proj.weight");
    eh.shape = {128, 64};
  });
  EXPECT_NE(misshapen.load_error().find("'model.layers.3.eh_proj.weight' in "), std::string::npos);
  EXPECT_NE(misshapen.load_error().find("has shape [128, 64], expected [64, 128]"), std::string::npos);

  const EditedCheckpoint undeclared(GetParam(), [](Tensors&) {});
  nlohmann::json config = read_json_file(undeclared.dir() / "config.json");
  config["num_nextn_predict_layers"] = 0;
  std::ofstream(undeclared.dir() / "config.json") << config.dump();
  EXPECT_NE(undeclared.load_error().find("tensors the model does not use: 'model.layers.3.eh_proj.weight'"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSeekV3Mtp, ::testing::Values("deepseek_v3", "deepseek_v3_fp8"));

// f32 -> bf16, round to nearest even.
std::uint16_t to_bf16(float f) {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
}

// An f32 that f16 holds exactly as a normal number, as f16.
std::uint16_t to_f16_exact(float f) {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  const auto h = static_cast<std::uint16_t>(
      ((bits >> 16) & 0x8000U) | ((((bits >> 23) & 0xFFU) - 112U) << 10) | ((bits >> 13) & 0x3FFU));
  EXPECT_EQ(kernels::cpu::f16_to_f32(h), f);
  return h;
}

std::vector<float> prompt_logits(const fs::path& dir) {
  kernels::cpu::CpuBackend backend(1);
  const auto model = Model::load(dir, backend);
  Engine engine(*model, EngineOptions{});
  const auto ids =
      testing::fixture_reference("deepseek_v3")["prompts"][3]["input_ids"].get<std::vector<std::int32_t>>();
  const Engine::Work work{1, ids, true};
  EXPECT_TRUE(engine.step(std::span(&work, 1)).ok());
  const std::span<const float> logits = engine.logits();
  return {logits.begin(), logits.end()};
}

// A BF16 or F16 e_score_correction_bias widens exactly to F32: the same values stored either way give the
// same logits, bit for bit. Old code refused anything but F32: "the router's correction bias must be F32".
TEST(DeepSeekV3, Bf16AndF16CorrectionBiasWidenExactly) {
  // The fixture's biases rounded to BF16 values, which F16 holds too.
  const auto store = [](const std::string& dtype) {
    return [dtype](Tensors& t) {
      for (auto& [name, tensor] : t) {
        if (!name.ends_with("e_score_correction_bias")) continue;
        std::vector<float> values(tensor.bytes.size() / 4);
        std::memcpy(values.data(), tensor.bytes.data(), tensor.bytes.size());
        std::string bytes;
        for (const float v : values) {
          const std::uint16_t b = to_bf16(v);
          const float rounded = kernels::cpu::bf16_to_f32(b);
          const std::uint16_t h = dtype == "F16" ? to_f16_exact(rounded) : b;
          if (dtype == "F32") {
            bytes.append(reinterpret_cast<const char*>(&rounded), sizeof rounded);
          } else {
            bytes.append(reinterpret_cast<const char*>(&h), sizeof h);
          }
        }
        tensor = {dtype, tensor.shape, bytes};
      }
    };
  };
  const EditedCheckpoint f32("deepseek_v3", store("F32"));
  const EditedCheckpoint bf16("deepseek_v3", store("BF16"));
  const EditedCheckpoint f16("deepseek_v3", store("F16"));
  ASSERT_EQ(bf16.load_error(), "");
  const std::vector<float> expected = prompt_logits(f32.dir());
  EXPECT_EQ(prompt_logits(bf16.dir()), expected);
  EXPECT_EQ(prompt_logits(f16.dir()), expected);
}

}  // namespace
}  // namespace capserve::runtime
