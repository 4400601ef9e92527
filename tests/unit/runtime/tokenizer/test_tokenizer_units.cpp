// The pieces with rules of their own: Rust's lossy UTF-8 decoding, the Oniguruma-compatible \s, both merge
// encodings, and the special-token API.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "runtime/model_config.h"
#include "runtime/tokenizer/regex.h"
#include "runtime/tokenizer/tokenizer.h"
#include "runtime/tokenizer/utf8.h"
#include "tests/unit/runtime/tokenizer/golden_files.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

std::string lossy(std::string_view bytes) {
  std::string out;
  utf8::append_lossy(out, bytes);
  return out;
}

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8, LossyDecodingReplacesEachMaximalIllFormedSubpart) {
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("\xF0\x9F\x98"), kFffd);                              // cut-off 4-byte sequence: one U+FFFD
  EXPECT_EQ(lossy("\xE2\x28\xA1"), kFffd + "(" + kFffd);                // bad continuation
  EXPECT_EQ(lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);              // surrogate: each byte
  EXPECT_EQ(lossy("\xC0\xAF"), kFffd + kFffd);                          // overlong
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(lossy("a\xE2\x82\xACz\xFF"), "a\xE2\x82\xACz" + kFffd);
}

TEST(Utf8, IncompleteSuffixIsWhatMoreBytesCouldFinish) {
  EXPECT_EQ(utf8::incomplete_suffix_length("ab"), 0U);
  EXPECT_EQ(utf8::incomplete_suffix_length("a\xE2"), 1U);
  EXPECT_EQ(utf8::incomplete_suffix_length("a\xE2\x82"), 2U);
  EXPECT_EQ(utf8::incomplete_suffix_length("\xF0\x9F\x98"), 3U);
  EXPECT_EQ(utf8::incomplete_suffix_length("\xF0\x9F\x98\x80"), 0U);
  EXPECT_EQ(utf8::incomplete_suffix_length("a\x82"), 0U);     // can never be finished
  EXPECT_EQ(utf8::incomplete_suffix_length("\xE2\x28"), 0U);  // already broken
  EXPECT_EQ(utf8::incomplete_suffix_length("\xED\xA0"), 0U);  // would be a surrogate
  EXPECT_EQ(utf8::incomplete_suffix_length("\xF5"), 0U);
}

TEST(Regex, WhiteSpaceIsUnicodeWhiteSpaceLikeOniguruma) {
  const Regex space("\\s+", "test");
  const Regex not_space("[^\\s]", "test");
  RegexScratch scratch;
  RegexMatch m;
  // U+180E is no longer White_Space; PCRE2's own \s would still match it.
  ASSERT_TRUE(space
                  .find("a\xE1\xA0\x8E"
                        "b",
                        0, scratch, m)
                  .ok());
  EXPECT_FALSE(m.found);
  ASSERT_TRUE(not_space.find("\xE1\xA0\x8E", 0, scratch, m).ok());
  EXPECT_TRUE(m.found);
  ASSERT_TRUE(space
                  .find("a\xC2\x85\xE3\x80\x80"
                        "b",
                        0, scratch, m)
                  .ok());  // NEL and ideographic space
  EXPECT_TRUE(m.found);
  EXPECT_EQ(m.end - m.start, 5U);
  // Escaped backslashes and bracket expressions are left alone.
  EXPECT_EQ(onig_to_pcre2("\\\\s[\\]a]", "test"), "\\\\s[\\]a]");
}

TEST(Tokenizer, BothMergeEncodingsGiveTheSameIds) {
  const fs::path source = testing::fixtures_dir() / "synthetic" / "bytelevel";
  nlohmann::json spec = read_json_file(source / "tokenizer.json");
  ASSERT_TRUE(spec["model"]["merges"][0].is_array());  // ["a", "b"] pairs
  for (auto& merge : spec["model"]["merges"])
    merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  const fs::path dir = fs::temp_directory_path() / ("capserve_merges_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << spec.dump();
  const Tokenizer pairs = Tokenizer::load(source);
  const Tokenizer strings = Tokenizer::load(dir);
  fs::remove_all(dir);
  std::vector<std::int32_t> a;
  std::vector<std::int32_t> b;
  for (std::size_t i = 0; i < testing::golden_strings().size(); i += 7) {
    ASSERT_TRUE(pairs.encode(testing::golden_strings()[i], true, a).ok());
    ASSERT_TRUE(strings.encode(testing::golden_strings()[i], true, b).ok());
    ASSERT_EQ(a, b) << "string " << i;
  }
}

TEST(Tokenizer, SpecialTokensAndLookups) {
  const fs::path shared = testing::shared_data_dir() / "tokenizers";
  const Tokenizer qwen = Tokenizer::load(shared / "qwen3");
  EXPECT_EQ(qwen.vocab_size(), 151669);
  EXPECT_EQ(qwen.bos_id(), std::nullopt);
  EXPECT_EQ(qwen.eos_id(), 151645);  // <|im_end|>
  EXPECT_EQ(qwen.pad_id(), 151643);
  EXPECT_TRUE(qwen.is_special(151645));
  EXPECT_FALSE(qwen.is_special(151667));  // <think> is an added token but not special
  EXPECT_EQ(qwen.token_to_id("<think>"), 151667);
  EXPECT_EQ(qwen.id_to_token(9707), "Hello");
  EXPECT_EQ(qwen.id_to_token(-1), std::nullopt);
  EXPECT_EQ(qwen.id_to_token(151669), std::nullopt);

  const Tokenizer llama = Tokenizer::load(shared / "llama2");
  EXPECT_EQ(llama.bos_id(), 1);
  EXPECT_EQ(llama.eos_id(), 2);
  std::vector<std::int32_t> ids;
  ASSERT_TRUE(llama.encode("", true, ids).ok());
  EXPECT_EQ(ids, std::vector<std::int32_t>{1});  // BOS from the TemplateProcessing post-processor
  ASSERT_TRUE(llama.encode("", false, ids).ok());
  EXPECT_TRUE(ids.empty());

  const Tokenizer deepseek = Tokenizer::load(shared / "deepseek_v3");
  EXPECT_EQ(deepseek.bos_id(), 0);
  EXPECT_EQ(deepseek.eos_id(), 1);
  // tokenizer.json's ByteLevel post-processor adds no BOS (whatever add_bos_token says), as in HF.
  ASSERT_TRUE(deepseek.encode("Hi", true, ids).ok());
  EXPECT_NE(ids.front(), 0);
}

}  // namespace
}  // namespace capserve::runtime
