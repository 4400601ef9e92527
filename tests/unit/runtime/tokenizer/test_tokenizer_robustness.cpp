// Any byte string and any id sequence is handled without crashing: invalid UTF-8 is refused with a Status
// naming the offset, decoded text is always UTF-8, and concurrent use gives the same ids.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "runtime/tokenizer/tokenizer.h"
#include "runtime/tokenizer/utf8.h"
#include "tests/unit/runtime/tokenizer/golden_files.h"

namespace capserve::runtime {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> tokenizer_dirs() {
  std::vector<fs::path> dirs;
  for (const char* name : {"qwen3", "deepseek_v3", "llama2"})
    dirs.push_back(testing::shared_data_dir() / "tokenizers" / name);
  for (const char* name : {"bytelevel", "metaspace", "split", "nodecoder", "strip"})
    dirs.push_back(testing::fixtures_dir() / "synthetic" / name);
  return dirs;
}

// Random bytes (mostly not UTF-8) or random code points (UTF-8), biased towards what tokenizers care about.
std::string random_text(std::mt19937& rng) {
  static constexpr std::string_view kInteresting =
      " \t\n\r'<>|s0aZ\xE2\x96\x81\xF0\x9F\x98\x80\xED\xA0\xC0\xFF\x80";
  const std::size_t length = std::uniform_int_distribution<std::size_t>(0, 48)(rng);
  std::string s;
  if (std::bernoulli_distribution(0.5)(rng)) {
    for (std::size_t i = 0; i < length; ++i) {
      s.push_back(
          std::bernoulli_distribution(0.5)(rng)
              ? kInteresting[std::uniform_int_distribution<std::size_t>(0, kInteresting.size() - 1)(rng)]
              : static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng)));
    }
    return s;
  }
  std::uniform_int_distribution<char32_t> any(0, 0x10FFFF);
  std::uniform_int_distribution<char32_t> ascii(0, 0x7F);
  for (std::size_t i = 0; i < length; ++i) {
    char32_t c = std::bernoulli_distribution(0.5)(rng) ? ascii(rng) : any(rng);
    if (c >= 0xD800 && c <= 0xDFFF) c = 0x2581;
    utf8::append(s, c);
  }
  return s;
}

TEST(TokenizerRobustness, InvalidUtf8IsRefusedWithItsOffset) {
  const Tokenizer t = Tokenizer::load(testing::shared_data_dir() / "tokenizers" / "qwen3");
  std::vector<std::int32_t> ids{1, 2, 3};
  const std::vector<std::pair<std::string, std::size_t>> cases = {
      {"ab\xC3(", 2},           // a lead byte without its continuation
      {"\xC0\x80", 0},          // overlong NUL
      {"x\xED\xA0\x80", 1},     // a UTF-16 surrogate
      {"\xF4\x90\x80\x80", 0},  // above U+10FFFF
      {"ok \xE2\x82", 3},       // cut off at the end
      {"\x80", 0},              // a lone continuation byte
  };
  for (const auto& [text, offset] : cases) {
    const Status status = t.encode(text, true, ids);
    EXPECT_EQ(status.code(), StatusCode::invalid_argument);
    EXPECT_NE(status.message().find("offset " + std::to_string(offset)), std::string::npos)
        << status.message();
    EXPECT_TRUE(ids.empty());
  }
}

// Found by fuzz_tokenizer: a character HF's older NFC data does not know (U+07FD) at the very start left an
// empty segment for utf8proc, whose re-encoding then wrote its terminator through a null buffer. Ids as HF
// tokenizers.
TEST(TokenizerRobustness, NfcBlockerAtTheStartOfTheText) {
  const Tokenizer t = Tokenizer::load(testing::shared_data_dir() / "tokenizers" / "qwen3");
  std::vector<std::int32_t> ids;
  ASSERT_TRUE(t.encode("\xdf\xbd", false, ids).ok());
  EXPECT_EQ(ids, (std::vector<std::int32_t>{155, 121}));
}

TEST(TokenizerRobustness, RandomBytesAndIdsNeverCrash) {
  std::mt19937 rng(7);
  for (const fs::path& dir : tokenizer_dirs()) {
    const Tokenizer t = Tokenizer::load(dir);
    std::vector<std::int32_t> ids;
    std::size_t encoded = 0;
    for (int i = 0; i < 2000; ++i) {
      const std::string bytes = random_text(rng);
      const Status status = t.encode(bytes, i % 2 == 0, ids);
      ASSERT_EQ(status.ok(), utf8::is_valid(bytes)) << status.message();
      if (!status.ok()) continue;
      ++encoded;
      ASSERT_TRUE(utf8::is_valid(t.decode(ids, false)));
    }
    EXPECT_GT(encoded, 800U) << dir;
    std::uniform_int_distribution<std::int32_t> any_id(-3, t.vocab_size() + 3);
    for (int i = 0; i < 300; ++i) {
      std::vector<std::int32_t> random_ids(std::uniform_int_distribution<std::size_t>(0, 30)(rng));
      for (std::int32_t& id : random_ids) id = any_id(rng);
      for (const bool skip : {false, true}) {
        const std::string text = t.decode(random_ids, skip);
        ASSERT_TRUE(utf8::is_valid(text));
        IncrementalDecoder decoder(t, skip);
        std::string streamed;
        for (const std::int32_t id : random_ids) streamed += decoder.feed(id);
        streamed += decoder.finish();
        ASSERT_EQ(streamed, text) << dir;
      }
    }
  }
}

TEST(TokenizerRobustness, ConcurrentEncodesAgree) {
  const Tokenizer t = Tokenizer::load(testing::shared_data_dir() / "tokenizers" / "qwen3");
  const auto& strings = testing::golden_strings();
  const std::size_t n = std::min<std::size_t>(strings.size(), 3000);
  std::vector<std::vector<std::int32_t>> expected(n);
  for (std::size_t i = 0; i < n; ++i) ASSERT_TRUE(t.encode(strings[i], true, expected[i]).ok());
  std::vector<std::size_t> mismatches(2);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::vector<std::int32_t> ids;
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t i = w == 0 ? k : n - 1 - k;
        if (!t.encode(strings[i], true, ids).ok() || ids != expected[i]) ++mismatches[w];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches[0] + mismatches[1], 0U);
}

TEST(TokenizerRobustness, IncrementalDecodeHoldsBackPartialCharacters) {
  const Tokenizer t = Tokenizer::load(testing::shared_data_dir() / "tokenizers" / "llama2");
  // 😀 as byte-fallback tokens: nothing comes out until its last byte.
  const std::vector<std::int32_t> ids = {*t.token_to_id("<0xF0>"), *t.token_to_id("<0x9F>"),
                                         *t.token_to_id("<0x98>"), *t.token_to_id("<0x80>")};
  IncrementalDecoder decoder(t, true);
  EXPECT_EQ(decoder.feed(ids[0]), "");
  EXPECT_EQ(decoder.feed(ids[1]), "");
  EXPECT_EQ(decoder.feed(ids[2]), "");
  // A run of byte tokens that is not UTF-8 becomes one U+FFFD per byte once the run ends.
  EXPECT_EQ(decoder.feed(*t.token_to_id("▁Hi")), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD Hi");
  EXPECT_EQ(decoder.finish(), "");
  // The decoder starts over after finish(). A run of byte tokens is held until it ends (a later byte could
  // still make the whole run invalid, turning all of it into U+FFFD), here at the end of the stream.
  for (const std::int32_t id : ids) EXPECT_EQ(decoder.feed(id), "");
  EXPECT_EQ(decoder.finish(), "\xF0\x9F\x98\x80");

  const Tokenizer q = Tokenizer::load(testing::shared_data_dir() / "tokenizers" / "qwen3");
  const std::string palm = "\xF0\x9F\xAB\xB8";  // U+1FAF8, which Qwen spells with three byte-level tokens
  std::vector<std::int32_t> emoji;
  ASSERT_TRUE(q.encode(palm, false, emoji).ok());
  ASSERT_EQ(emoji.size(), 3U);
  IncrementalDecoder qd(q, false);
  for (std::size_t i = 0; i + 1 < emoji.size(); ++i) EXPECT_EQ(qd.feed(emoji[i]), "");
  EXPECT_EQ(qd.feed(emoji.back()), palm);
  // An unfinished character at the end of the stream becomes U+FFFD, as in decode().
  EXPECT_EQ(qd.feed(emoji[0]), "");
  EXPECT_EQ(qd.finish(), "\xEF\xBF\xBD");
}

}  // namespace
}  // namespace capserve::runtime
