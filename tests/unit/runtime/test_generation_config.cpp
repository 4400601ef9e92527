#include "runtime/generation_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "runtime/load_error.h"
#include "tests/unit/runtime/weights/safetensors_test_files.h"

namespace {

using capserve::runtime::GenerationDefaults;
using capserve::runtime::LoadError;
using capserve::runtime::read_generation_config;
using capserve::testing::TempDir;

constexpr std::int64_t kVocab = 1000;

class GenerationConfig : public ::testing::Test {
 protected:
  GenerationDefaults read(const std::string& text) {
    std::ofstream(dir_.path() / "generation_config.json") << text;
    return read_generation_config(dir_.path(), kVocab);
  }
  std::string error(const std::string& text) {
    try {
      read(text);
    } catch (const LoadError& e) {
      return e.what();
    }
    return "";
  }
  TempDir dir_;
};

TEST_F(GenerationConfig, AbsentFileLeavesEverythingUnset) {
  const GenerationDefaults d = read_generation_config(dir_.path(), kVocab);
  EXPECT_FALSE(d.temperature || d.top_p || d.top_k);
  EXPECT_TRUE(d.eos_token_ids.empty());
}

// Qwen3's file, with its ids scaled into this vocabulary.
TEST_F(GenerationConfig, ReadsSamplingDefaultsAndEveryEosId) {
  const GenerationDefaults d = read(R"({"bos_token_id": 1, "do_sample": true, "eos_token_id": [645, 643],
                                        "pad_token_id": 643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                        "transformers_version": "4.51.0"})");
  EXPECT_FLOAT_EQ(*d.temperature, 0.6F);
  EXPECT_FLOAT_EQ(*d.top_p, 0.95F);
  EXPECT_EQ(*d.top_k, 20);
  EXPECT_EQ(d.eos_token_ids, (std::vector<std::int32_t>{645, 643}));
  EXPECT_EQ(read(R"({"eos_token_id": 7, "temperature": null})").eos_token_ids, std::vector<std::int32_t>{7});
}

TEST_F(GenerationConfig, ErrorsNameTheFileAndKey) {
  EXPECT_NE(error("{").find("generation_config.json: invalid JSON"), std::string::npos);
  EXPECT_NE(error("[]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error(R"({"temperature": "hot"})").find("key 'temperature' must be a number, got string"),
            std::string::npos);
  EXPECT_NE(error(R"({"top_p": 1.5})").find("key 'top_p' must be in [0"), std::string::npos);
  EXPECT_NE(error(R"({"top_k": -1})").find("key 'top_k' must be an integer in [0, 1000]"), std::string::npos);
  EXPECT_NE(error(R"({"eos_token_id": [2, 1000]})").find("key 'eos_token_id' must be token ids in [0, 1000)"),
            std::string::npos);
}

}  // namespace
