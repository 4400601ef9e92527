// Every tokenizer against the Hugging Face `tokenizers` goldens: identical ids for every string (with and
// without special tokens), identical decoded text, and streaming decode equal to full decode.
#include <gtest/gtest.h>

#include <cctype>

#include <memory>

#include "runtime/tokenizer/tokenizer.h"
#include "runtime/tokenizer/utf8.h"
#include "tests/unit/runtime/tokenizer/golden_files.h"

namespace capserve::runtime {
namespace {

using testing::Goldens;

std::string excerpt(std::string_view s) {
  std::string out = nlohmann::json(std::string(s.substr(0, 120))).dump();
  if (s.size() > 120) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string ids_text(const std::vector<std::int32_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size() && i < 40; ++i) out += std::to_string(ids[i]) + " ";
  if (ids.size() > 40) out += "... (" + std::to_string(ids.size()) + " ids)";
  return out;
}

// Loaded once per test process (each test runs in its own process under ctest).
struct Fixture {
  Goldens goldens;
  std::unique_ptr<Tokenizer> tokenizer;
};

const Fixture& fixture(const std::string& name) {
  static std::unique_ptr<Fixture> cached;
  if (!cached || cached->goldens.name != name) {
    auto f = std::make_unique<Fixture>();
    f->goldens = testing::load_goldens(name);
    f->tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(f->goldens.tokenizer_dir));
    cached = std::move(f);
  }
  return *cached;
}

class TokenizerGoldens : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerGoldens, EncodeMatchesHf) {
  const Fixture& f = fixture(GetParam());
  const auto& strings = testing::golden_strings();
  std::size_t same = 0;
  std::size_t plain_total = 0;
  std::size_t plain_same = 0;
  std::vector<std::int32_t> ids;
  for (const auto& e : f.goldens.encodings) {
    const std::string& text = strings[e.index];
    ASSERT_TRUE(f.tokenizer->encode(text, true, ids).ok());
    if (ids == e.ids) {
      ++same;
    } else {
      ADD_FAILURE() << "string " << e.index << " " << excerpt(text) << "\n  HF:        " << ids_text(e.ids)
                    << "\n  CapServe:  " << ids_text(ids);
    }
    if (e.has_plain) {
      ++plain_total;
      ASSERT_TRUE(f.tokenizer->encode(text, false, ids).ok());
      if (ids == e.plain) {
        ++plain_same;
      } else {
        ADD_FAILURE() << "string " << e.index << " without special tokens " << excerpt(text)
                      << "\n  HF:        " << ids_text(e.plain) << "\n  CapServe:  " << ids_text(ids);
      }
    }
  }
  std::printf("%s: %zu/%zu strings give HF's ids with special tokens, %zu/%zu without\n", GetParam().c_str(),
              same, f.goldens.encodings.size(), plain_same, plain_total);
  EXPECT_GT(f.goldens.encodings.size(), 5000U);
}

TEST_P(TokenizerGoldens, DecodeMatchesHf) {
  const Fixture& f = fixture(GetParam());
  std::size_t same = 0;
  for (const auto& e : f.goldens.encodings) {
    const std::string text = f.tokenizer->decode(e.ids, false);
    if (text == e.decoded) {
      ++same;
    } else {
      ADD_FAILURE() << "decoding string " << e.index << "\n  HF:        " << excerpt(e.decoded)
                    << "\n  CapServe:  " << excerpt(text);
    }
  }
  std::size_t random_same = 0;
  for (const auto& d : f.goldens.decodings) {
    const std::string text = f.tokenizer->decode(d.ids, false);
    const std::string text_skip = f.tokenizer->decode(d.ids, true);
    EXPECT_EQ(text, d.text) << "ids " << ids_text(d.ids);
    EXPECT_EQ(text_skip, d.text_skip) << "ids " << ids_text(d.ids) << " skipping special tokens";
    random_same += text == d.text && text_skip == d.text_skip;
  }
  std::printf("%s: %zu/%zu decodes of encoded strings and %zu/%zu random id sequences give HF's text\n",
              GetParam().c_str(), same, f.goldens.encodings.size(), random_same, f.goldens.decodings.size());
  EXPECT_GT(f.goldens.decodings.size(), 100U);
}

TEST_P(TokenizerGoldens, IncrementalDecodeEqualsDecode) {
  const Fixture& f = fixture(GetParam());
  const auto check = [&](const std::vector<std::int32_t>& ids, bool skip) {
    IncrementalDecoder decoder(*f.tokenizer, skip);
    std::string streamed;
    for (const std::int32_t id : ids) {
      const std::string_view chunk = decoder.feed(id);
      ASSERT_TRUE(utf8::is_valid(chunk)) << "chunk after id " << id << " of " << ids_text(ids);
      streamed += chunk;
    }
    const std::string_view rest = decoder.finish();
    ASSERT_TRUE(utf8::is_valid(rest));
    streamed += rest;
    ASSERT_EQ(streamed, f.tokenizer->decode(ids, skip)) << "ids " << ids_text(ids) << " skip " << skip;
  };
  for (const auto& e : f.goldens.encodings) {
    check(e.ids, false);
    check(e.ids, true);
  }
  for (const auto& d : f.goldens.decodings) {
    check(d.ids, false);
    check(d.ids, true);
  }
}

INSTANTIATE_TEST_SUITE_P(All, TokenizerGoldens, ::testing::ValuesIn(testing::golden_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           // GoogleTest names allow only [A-Za-z0-9_]; model directories may hold '-'.
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace capserve::runtime
