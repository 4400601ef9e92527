// A request's output stream over the real tiny tokenizer: stop strings end the text before them wherever the
// token boundaries fall, text that could still become one is held back and sent at the end, and no chunk
// splits a character.
#include "server/output_stream.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "runtime/tokenizer/utf8.h"
#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server {
namespace {

class OutputStreamTest : public testing::Test {
 protected:
  OutputStreamTest() : tokenizer_(load_tiny_tokenizer()) {}

  std::int32_t token(std::string_view text) const { return single_token(tokenizer_, text); }

  // The text of each feed() in order; feeding ends at a stop string.
  static std::vector<std::string> feed_all(OutputStream& stream, std::initializer_list<std::int32_t> tokens,
                                           bool& stopped) {
    std::vector<std::string> chunks;
    stopped = false;
    for (const std::int32_t t : tokens) {
      OutputStream::Chunk chunk = stream.feed(t);
      EXPECT_FALSE(chunk.token.has_value());
      chunks.push_back(std::move(chunk.text));
      if (chunk.stop) {
        stopped = true;
        break;
      }
    }
    return chunks;
  }

  runtime::Tokenizer tokenizer_;
};

TEST_F(OutputStreamTest, AStopStringSplitAcrossTokensEndsTheTextBeforeIt) {
  OutputStream stream(&tokenizer_, {"bcd"});
  bool stopped = false;
  // "a" and "ab" could still end in "bcd" and are held back; "abc" lets "a" go; "d" completes the stop
  // string.
  const auto chunks = feed_all(stream, {token("a"), token("b"), token("c"), token("d"), token("e")}, stopped);
  EXPECT_TRUE(stopped);
  EXPECT_EQ(chunks, (std::vector<std::string>{"", "", "a", ""}));
  EXPECT_EQ(stream.finish(), "");
}

// A special token the model writes spells nothing by default (vLLM's skip_special_tokens) and its text when
// the request keeps special tokens (skip_special_tokens false; the Mistral tool-call parser's [TOOL_CALLS]).
TEST_F(OutputStreamTest, SpecialTokensSpellTheirTextOnlyWhenKept) {
  for (const bool skip : {true, false}) {
    OutputStream stream(&tokenizer_, {}, skip);
    bool stopped = false;
    std::string text;
    for (const std::string& chunk : feed_all(stream, {token("a"), token("<|user|>"), token("b")}, stopped))
      text += chunk;
    text += stream.finish();
    EXPECT_EQ(text, skip ? "ab" : "a<|user|>b");
  }
}

TEST_F(OutputStreamTest, AStopStringAtTheVeryStartSendsNothing) {
  OutputStream stream(&tokenizer_, {"ab"});
  bool stopped = false;
  const auto chunks = feed_all(stream, {token("a"), token("b"), token("c")}, stopped);
  EXPECT_TRUE(stopped);
  EXPECT_EQ(chunks, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(stream.finish(), "");
}

// The hold-back is as long as the longest stop string, and a shorter one still ends the text as soon as it
// appears; the held-back text before it comes out of finish().
TEST_F(OutputStreamTest, StopStringsOfDifferentLengths) {
  {
    OutputStream stream(&tokenizer_, {"wxyz", "cd"});
    bool stopped = false;
    const auto chunks =
        feed_all(stream, {token("a"), token("b"), token("c"), token("d"), token("e")}, stopped);
    EXPECT_TRUE(stopped);
    EXPECT_EQ(chunks, (std::vector<std::string>{"", "", "", ""}));
    EXPECT_EQ(stream.finish(), "ab");
  }
  {
    OutputStream stream(&tokenizer_, {"cd", "wxyz"});
    bool stopped = false;
    const auto chunks =
        feed_all(stream, {token("a"), token("w"), token("x"), token("y"), token("z"), token("e")}, stopped);
    EXPECT_TRUE(stopped);
    EXPECT_EQ(chunks, (std::vector<std::string>{"", "", "", "a", ""}));
    EXPECT_EQ(stream.finish(), "");
  }
}

TEST_F(OutputStreamTest, FinishSendsTheHoldBackOfAStopStringThatNeverCame) {
  OutputStream stream(&tokenizer_, {"zzz"});
  bool stopped = false;
  const auto chunks = feed_all(stream, {token("a"), token("b"), token("c")}, stopped);
  EXPECT_FALSE(stopped);
  EXPECT_EQ(chunks, (std::vector<std::string>{"", "", "a"}));
  EXPECT_EQ(stream.finish(), "bc");
}

// Holding back one byte for "QQ" after the 3-byte "に" would cut the character: the chunk ends before it.
TEST_F(OutputStreamTest, TheHoldBackNeverCutsACharacter) {
  OutputStream stream(&tokenizer_, {"QQ"});
  bool stopped = false;
  const auto chunks = feed_all(stream, {token("a"), token("\xE3\x81\xAB")}, stopped);
  EXPECT_FALSE(stopped);
  EXPECT_EQ(chunks, (std::vector<std::string>{"", "a"}));
  EXPECT_EQ(stream.finish(), "\xE3\x81\xAB");
}

// A character whose bytes come in several tokens is sent whole, once its last byte is decoded; a stream that
// ends inside one finishes with U+FFFD.
TEST_F(OutputStreamTest, ACharacterSplitAcrossTokensIsNeverSentInPart) {
  const std::string crab = "\xF0\x9F\xA6\x80";  // U+1F980, 4 bytes
  std::vector<std::int32_t> ids;
  ASSERT_TRUE(tokenizer_.encode("a" + crab + "b", false, ids).ok());
  ASSERT_GT(ids.size(), 3U) << "the fixture should spell the emoji in several byte tokens";
  for (const std::vector<std::string>& stops :
       {std::vector<std::string>{}, std::vector<std::string>{"QQQ"}}) {
    OutputStream stream(&tokenizer_, stops);
    std::string text;
    for (const std::int32_t id : ids) {
      const OutputStream::Chunk chunk = stream.feed(id);
      EXPECT_FALSE(chunk.stop);
      EXPECT_TRUE(runtime::utf8::is_valid(chunk.text))
          << "a chunk splits a character: " << testing::PrintToString(chunk.text);
      text += chunk.text;
    }
    const std::string rest = stream.finish();
    EXPECT_TRUE(runtime::utf8::is_valid(rest));
    EXPECT_EQ(text + rest, "a" + crab + "b");
  }
  OutputStream cut(&tokenizer_, {});
  for (std::size_t i = 0; i + 2 < ids.size(); ++i)
    EXPECT_TRUE(runtime::utf8::is_valid(cut.feed(ids[i]).text));
  EXPECT_EQ(cut.finish(), std::string(runtime::utf8::kReplacementCharacter));
}

TEST(OutputStream, WithoutATokenizerTokenIdsPassThroughAndStopStringsDoNotApply) {
  OutputStream stream(nullptr, {"a"});
  for (const std::int32_t id : {7, 0, 7}) {
    const OutputStream::Chunk chunk = stream.feed(id);
    EXPECT_EQ(chunk.token, id);
    EXPECT_EQ(chunk.text, "");
    EXPECT_FALSE(chunk.stop);
  }
  EXPECT_EQ(stream.finish(), "");
}

}  // namespace
}  // namespace capserve::server
