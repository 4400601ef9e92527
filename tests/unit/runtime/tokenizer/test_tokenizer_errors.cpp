// Malformed or unsupported tokenizer files are a LoadError that names the file, the JSON path and the
// problem.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "runtime/load_error.h"
#include "runtime/model_config.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tests/unit/runtime/tokenizer/golden_files.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A temporary tokenizer directory holding an edited copy of one of the synthetic fixture tokenizers.
class EditedTokenizer {
 public:
  explicit EditedTokenizer(const std::string& synthetic)
      : dir_(fs::temp_directory_path() / ("capserve_tok_" + synthetic + "_" + std::to_string(::getpid()))),
        json_(read_json_file(testing::fixtures_dir() / "synthetic" / synthetic / "tokenizer.json")) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~EditedTokenizer() { fs::remove_all(dir_); }
  EditedTokenizer(const EditedTokenizer&) = delete;
  EditedTokenizer& operator=(const EditedTokenizer&) = delete;

  json& spec() { return json_; }
  [[nodiscard]] const fs::path& dir() const { return dir_; }

  // The LoadError message of loading the edited tokenizer, or "" when it loads.
  std::string load_error() { return load_error_of(json_.dump()); }

  std::string load_error_of(const std::string& text) {
    std::ofstream(dir_ / "tokenizer.json") << text;
    try {
      Tokenizer::load(dir_);
    } catch (const LoadError& e) {
      return e.what();
    }
    return "";
  }

 private:
  fs::path dir_;
  json json_;
};

#define EXPECT_LOAD_ERROR(tokenizer, ...)                                                               \
  do {                                                                                                  \
    const std::string message = (tokenizer).load_error();                                               \
    EXPECT_NE(message, "") << "loaded without error";                                                   \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(message.find(part), std::string::npos) << message; \
  } while (0)

TEST(TokenizerErrors, UneditedFixturesLoad) {
  for (const char* name : {"bytelevel", "metaspace", "split", "nodecoder", "strip"}) {
    EditedTokenizer t(name);
    EXPECT_EQ(t.load_error(), "") << name;
  }
}

TEST(TokenizerErrors, MissingOrInvalidFile) {
  try {
    Tokenizer::load(fs::temp_directory_path() / "capserve_no_such_tokenizer");
    ADD_FAILURE() << "loaded a missing directory";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
  EditedTokenizer t("split");
  const std::string message = t.load_error_of("{\"model\": ");
  EXPECT_NE(message.find("invalid JSON"), std::string::npos) << message;
  EXPECT_NE(message.find("tokenizer.json"), std::string::npos) << message;
}

TEST(TokenizerErrors, UnsupportedComponentsAreNamed) {
  {
    EditedTokenizer t("split");
    t.spec()["model"]["type"] = "WordPiece";
    EXPECT_LOAD_ERROR(t, "tokenizer.json: model", "unsupported model type 'WordPiece'");
  }
  {
    EditedTokenizer t("split");
    t.spec()["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Whitespace"}};
    EXPECT_LOAD_ERROR(t, "pre_tokenizer.pretokenizers[1].type",
                      "unsupported pre_tokenizer type 'Whitespace'");
  }
  {
    EditedTokenizer t("split");
    t.spec()["normalizer"] = {{"type", "Lowercase"}};
    EXPECT_LOAD_ERROR(t, "normalizer.type", "unsupported normalizer type 'Lowercase'");
  }
  {
    EditedTokenizer t("split");
    t.spec()["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}};
    EXPECT_LOAD_ERROR(t, "decoder.type", "unsupported decoder type 'WordPiece'");
  }
  {
    EditedTokenizer t("split");
    t.spec()["post_processor"] = {{"type", "RobertaProcessing"}};
    EXPECT_LOAD_ERROR(t, "post_processor.type", "unsupported post_processor type 'RobertaProcessing'");
  }
  {
    EditedTokenizer t("split");
    t.spec()["truncation"] = {{"max_length", 8}};
    EXPECT_LOAD_ERROR(t, "truncation", "not supported");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["dropout"] = 0.1;
    EXPECT_LOAD_ERROR(t, "model.dropout", "dropout");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["continuing_subword_prefix"] = "##";
    EXPECT_LOAD_ERROR(t, "model.continuing_subword_prefix", "not supported");
  }
  {
    EditedTokenizer t("split");
    t.spec()["normalizer"]["normalizers"][0]["pattern"] = {{"Regex", "\\t"}};
    EXPECT_LOAD_ERROR(t, "normalizer.normalizers[0].pattern", "String");
  }
  {
    EditedTokenizer t("bytelevel");
    t.spec()["pre_tokenizer"] = {{"type", "Sequence"},
                                 {"pretokenizers", {t.spec()["pre_tokenizer"], t.spec()["pre_tokenizer"]}}};
    EXPECT_LOAD_ERROR(t, "ByteLevel", "last step");
  }
  {
    EditedTokenizer t("metaspace");
    t.spec()["decoder"]["decoders"][2] = {{"type", "CTC"}};
    EXPECT_LOAD_ERROR(t, "decoder.decoders[2].type", "'CTC'");
  }
}

TEST(TokenizerErrors, BadModelData) {
  {
    EditedTokenizer t("split");
    t.spec()["model"]["merges"][0] = "no_such_token x";
    EXPECT_LOAD_ERROR(t, "model.merges[0]", "'no_such_token' is not in the vocabulary");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["merges"][3] = "a b c";
    EXPECT_LOAD_ERROR(t, "model.merges[3]", "one space");
  }
  {
    EditedTokenizer t("bytelevel");
    t.spec()["model"]["merges"][2] = 7;
    EXPECT_LOAD_ERROR(t, "model.merges[2]", "a pair");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["vocab"]["e"] = -3;
    EXPECT_LOAD_ERROR(t, "model.vocab[\"e\"]", "token id");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["vocab"]["e"] = t.spec()["model"]["vocab"]["a"];
    EXPECT_LOAD_ERROR(t, "model.vocab", "more than one token");
  }
  {
    EditedTokenizer t("split");
    t.spec()["model"]["unk_token"] = "<nope>";
    EXPECT_LOAD_ERROR(t, "model.unk_token", "not in the vocabulary");
  }
  {
    EditedTokenizer t("split");
    t.spec().erase("model");
    EXPECT_LOAD_ERROR(t, "tokenizer.json", "missing key 'model'");
  }
  {
    EditedTokenizer t("metaspace");
    t.spec()["added_tokens"].back()["id"] = 5;
    EXPECT_LOAD_ERROR(t, "added_tokens[", "written with id 5 but HF tokenizers gives it id");
  }
  {
    EditedTokenizer t("metaspace");
    t.spec()["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>";
    EXPECT_LOAD_ERROR(t, "post_processor.single[0]", "'<bos>' is not in special_tokens");
  }
  {
    EditedTokenizer t("metaspace");
    t.spec()["pre_tokenizer"]["add_prefix_space"] = false;
    EXPECT_LOAD_ERROR(t, "pre_tokenizer.add_prefix_space", "prepend_scheme");
  }
}

TEST(TokenizerErrors, BadRegexes) {
  const auto with_regex = [](const std::string& pattern) {
    EditedTokenizer t("split");
    t.spec()["pre_tokenizer"]["pretokenizers"][1]["pattern"] = {{"Regex", pattern}};
    return t.load_error();
  };
  std::string message = with_regex("[a-");
  EXPECT_NE(message.find("pre_tokenizer.pretokenizers[1].pattern.Regex: invalid regex"), std::string::npos)
      << message;
  message = with_regex("a*");
  EXPECT_NE(message.find("empty string"), std::string::npos) << message;
  message = with_regex("\\w+");
  EXPECT_NE(message.find("\\w"), std::string::npos) << message;
}

TEST(TokenizerErrors, TokenizerConfigNamesUnknownSpecialToken) {
  EditedTokenizer t("metaspace");
  std::ofstream(t.dir() / "tokenizer_config.json")
      << R"({"bos_token": "<s>", "eos_token": {"content": "<eot>"}})";
  EXPECT_LOAD_ERROR(t, "tokenizer_config.json: eos_token", "'<eot>' is not in the tokenizer's vocabulary");
}

}  // namespace
}  // namespace capserve::runtime
