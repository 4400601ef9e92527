#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/grammar/matcher.h"
#include "runtime/grammar/structured_output.h"
#include "runtime/tokenizer/tokenizer.h"

namespace capserve::runtime::grammar {
namespace {

// One token per byte value (id = byte), plus multi-byte tokens, then a stop token.
struct ByteVocabulary {
  std::vector<std::string> extra;
  std::shared_ptr<const TokenVocabulary> vocabulary;
  std::int32_t stop = 0;
};

ByteVocabulary byte_vocabulary(std::vector<std::string> extra = {}) {
  std::vector<std::optional<std::string>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)));
  for (const auto& e : extra) bytes.emplace_back(e);
  const auto stop = static_cast<std::int32_t>(bytes.size());
  bytes.emplace_back(std::nullopt);
  return {extra, std::make_shared<const TokenVocabulary>(std::move(bytes), std::vector<std::int32_t>{stop}),
          stop};
}

std::shared_ptr<const CompiledGrammar> compiled(const OutputConstraint& c, const ByteVocabulary& v) {
  auto out = compile(c, v.vocabulary);
  EXPECT_TRUE(out.ok()) << out.status().message();
  return *out;
}

OutputConstraint schema(const std::string& text) {
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::json_schema;
  c.schema = nlohmann::ordered_json::parse(text);
  return c;
}

OutputConstraint regex(const std::string& pattern) {
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::regex;
  c.regex = pattern;
  return c;
}

// Whether the matcher takes `text` byte by byte and can then stop.
bool matches(const std::shared_ptr<const CompiledGrammar>& grammar, const std::string& text) {
  GrammarMatcher m(grammar);
  for (const char c : text) {
    if (!m.accept_token(static_cast<unsigned char>(c))) return false;
  }
  return m.can_terminate();
}

bool allowed(std::span<const std::int32_t> words, std::int32_t id) {
  return (static_cast<std::uint32_t>(words[static_cast<std::size_t>(id) / 32]) >> (id % 32)) & 1U;
}

TEST(Grammar, RegexLanguage) {
  const auto v = byte_vocabulary();
  const auto g = compiled(regex("^a(b|cd)*[x-z]{1,2}\\d?$"), v);
  for (const std::string yes : {"ax", "abxy", "acdbz1", "abcdcdzz"}) EXPECT_TRUE(matches(g, yes)) << yes;
  for (const std::string no : {"", "a", "ac", "axyz", "abx12", "bx"}) EXPECT_FALSE(matches(g, no)) << no;
}

TEST(Grammar, RegexUnicodeClassesAreUtf8) {
  const auto v = byte_vocabulary();
  const auto g = compiled(regex("[^a]+"), v);
  EXPECT_TRUE(matches(g, "é東😀"));
  EXPECT_FALSE(matches(g, "\xC3"));          // a character cut short
  EXPECT_FALSE(matches(g, "\xED\xA0\x80"));  // an encoded surrogate is not UTF-8
  EXPECT_FALSE(matches(g, "ba"));
}

TEST(Grammar, UnsupportedRegexIsRefusedNamingTheConstruct) {
  const auto v = byte_vocabulary();
  for (const auto& [pattern, construct] :
       std::vector<std::pair<std::string, std::string>>{{"(?=a)b", "lookahead"},
                                                        {"(a)\\1", "\\1"},
                                                        {"a\\bb", "\\b"},
                                                        {"a++", "possessive"},
                                                        {"(a", "unterminated"}}) {
    const auto out = compile(regex(pattern), v.vocabulary);
    ASSERT_FALSE(out.ok()) << pattern;
    EXPECT_EQ(out.status().code(), StatusCode::invalid_argument);
    EXPECT_NE(out.status().message().find(construct), std::string::npos) << out.status().message();
  }
}

TEST(Grammar, UnsupportedSchemaKeywordIsRefusedNamingIt) {
  const auto v = byte_vocabulary();
  for (const auto& [text, keyword] : std::vector<std::pair<std::string, std::string>>{
           {R"({"type": "object", "minProperties": 1})", "minProperties"},
           {R"({"type": "string", "minLength": 5, "maxLength": 2})", "maxLength"},
           {R"({"type": "array", "minItems": 3, "maxItems": 1})", "maxItems"},
           {R"({"type": "integer", "minimum": 5, "maximum": 4})", "minimum"},
           {R"({"type": "string", "format": "hostname"})", "format"},
           {R"({"not": {"type": "string"}})", "not"},
           {R"({"type": "number", "minimum": 0.5})", "minimum"},
           {R"({"type": "array", "uniqueItems": true})", "uniqueItems"},
           {R"({"type": "integer", "multipleOf": 3})", "multipleOf"},
           {R"({"$ref": "https://example.com/s.json"})", "$ref"},
           {R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})", "$ref"},
           {R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})", "required"},
           {R"({"type": "string", "pattern": "(?<=a)b"})", "pattern"}}) {
    const auto out = compile(schema(text), v.vocabulary);
    ASSERT_FALSE(out.ok()) << text;
    EXPECT_EQ(out.status().code(), StatusCode::invalid_argument);
    EXPECT_NE(out.status().message().find("'" + keyword + "'"), std::string::npos) << out.status().message();
  }
}

TEST(Grammar, IntegerBoundsAreExact) {
  const auto v = byte_vocabulary();
  for (const auto& [lo, hi] :
       std::vector<std::pair<int, int>>{{0, 150}, {-40, 60}, {-1000, -7}, {17, 17}, {95, 1234}}) {
    const auto g = compiled(schema(R"({"type": "integer", "minimum": )" + std::to_string(lo) +
                                   R"(, "maximum": )" + std::to_string(hi) + "}"),
                            v);
    for (int x = -1300; x <= 1300; ++x) {
      EXPECT_EQ(matches(g, std::to_string(x)), x >= lo && x <= hi) << x << " in [" << lo << ", " << hi << "]";
    }
    EXPECT_FALSE(matches(g, "-0"));
    EXPECT_FALSE(matches(g, "007"));
  }
  const auto open = compiled(schema(R"({"type": "integer", "exclusiveMinimum": 9})"), v);
  EXPECT_FALSE(matches(open, "9"));
  EXPECT_TRUE(matches(open, "10"));
  EXPECT_TRUE(matches(open, "123456789012"));
}

// Values k / 100 in a few spellings ("-3", "-3.0", "-3.50", "-0.25") against the bounds in hundredths.
TEST(Grammar, NumberBoundsAreExact) {
  const auto v = byte_vocabulary();
  struct Case {
    std::string bounds;
    long lo;  // in hundredths; lo_open / hi_open: exclusive
    bool lo_open;
    long hi;
    bool hi_open;
  };
  constexpr long kNone = 1L << 40;
  for (const auto& c :
       std::vector<Case>{{R"("minimum": 0, "maximum": 1)", 0, false, 100, false},
                         {R"("exclusiveMinimum": 0, "maximum": 5)", 0, true, 500, false},
                         {R"("minimum": -5, "exclusiveMaximum": 5)", -500, false, 500, true},
                         {R"("maximum": -2)", -kNone, false, -200, false},
                         {R"("exclusiveMinimum": -3)", -300, true, kNone, false},
                         {R"("minimum": 2, "exclusiveMinimum": 2, "maximum": 2.0)", 200, true, 200, false}}) {
    const auto out = compile(schema(R"({"type": "number", )" + c.bounds + "}"), v.vocabulary);
    if (c.lo == 200 && c.hi == 200) {  // (2, 2]: no number
      EXPECT_FALSE(out.ok());
      continue;
    }
    ASSERT_TRUE(out.ok()) << c.bounds << ": " << out.status().message();
    for (long k = -1200; k <= 1200; ++k) {
      const bool in = (c.lo_open ? k > c.lo : k >= c.lo) && (c.hi_open ? k < c.hi : k <= c.hi);
      const std::string sign = k < 0 ? "-" : "";
      const long a = std::labs(k);
      const std::string whole = std::to_string(a / 100);
      const std::string cents = std::to_string(a % 100 / 10) + std::to_string(a % 10);
      std::vector<std::string> spellings{sign + whole + "." + cents + "0"};
      if (a % 100 == 0) spellings.push_back(sign + whole);
      if (a % 10 == 0) spellings.push_back(sign + whole + "." + cents.substr(0, 1));
      for (const auto& text : spellings) EXPECT_EQ(matches(*out, text), in) << c.bounds << ": " << text;
    }
    EXPECT_FALSE(matches(*out, "1e0"));  // bounded numbers are written out, with at most 6 decimals
    EXPECT_EQ(matches(*out, "0.500001"), c.lo < 50 && c.hi > 51);
    EXPECT_FALSE(matches(*out, "0.5000001"));
  }
}

TEST(Grammar, ObjectsKeepOrderRequiredAndAdditional) {
  const auto v = byte_vocabulary();
  const auto g = compiled(
      schema(
          R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]})"),
      v);
  EXPECT_TRUE(matches(g, R"({"a": 1, "b": "x"})"));
  EXPECT_TRUE(matches(g, "{\n  \"b\" : \"\\u00e9\\n\"\n}"));
  EXPECT_FALSE(matches(g, R"({"b": "x", "a": 1})"));  // schema order
  EXPECT_FALSE(matches(g, R"({"a": 1})"));            // b is required
  EXPECT_FALSE(matches(g, R"({"b": "x", "c": 1})"));  // no additional properties
  const auto extra = compiled(
      schema(
          R"({"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}})"),
      v);
  EXPECT_TRUE(matches(extra, R"({"id": 1, "idx": true, "i": false})"));
  EXPECT_FALSE(matches(extra, R"({"id": 1, "id": true})"));  // a listed name is not an additional property
  EXPECT_FALSE(matches(extra, R"({"x": 1})"));
}

TEST(Grammar, ArraysStringsRefsAndUnions) {
  const auto v = byte_vocabulary();
  const auto arrays = compiled(
      schema(R"({"type": "array", "items": {"enum": [1, "two", null]}, "minItems": 1, "maxItems": 2})"), v);
  EXPECT_TRUE(matches(arrays, R"([1, "two"])"));
  EXPECT_FALSE(matches(arrays, "[]"));
  EXPECT_FALSE(matches(arrays, "[1, 1, 1]"));
  const auto lengths = compiled(schema(R"({"type": "string", "minLength": 2, "maxLength": 3})"), v);
  EXPECT_TRUE(matches(lengths, R"("a\"")"));  // an escape is one character
  EXPECT_FALSE(matches(lengths, R"("a")"));
  EXPECT_FALSE(matches(lengths, "\"ab\x01\""));  // controls are not JSON
  const auto tree = compiled(schema(R"({"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
      "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
      "required": ["v"]}}})"),
                             v);
  EXPECT_TRUE(matches(tree, R"({"v": 1, "kids": [{"v": null}, {"v": 2, "kids": []}]})"));
  EXPECT_FALSE(matches(tree, R"({"v": 1, "kids": [{}]})"));
}

TEST(Grammar, CompactAndBoundedWhitespace) {
  const auto v = byte_vocabulary();
  auto c =
      schema(R"({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}})");
  c.json.whitespace = JsonWhitespace::compact;
  const auto compact = compiled(c, v);
  EXPECT_TRUE(matches(compact, R"({"a": [1, 2]})"));
  EXPECT_FALSE(matches(compact, R"({"a":[1,2]})"));
  EXPECT_FALSE(matches(compact, R"({ "a": [1, 2]})"));
  c.json.whitespace = JsonWhitespace::at_most;
  c.json.max_whitespace = 2;
  const auto bounded = compiled(c, v);
  EXPECT_TRUE(matches(bounded, "{\n \"a\":[1,  2]}"));
  EXPECT_FALSE(matches(bounded, "{\n  \"a\":[1,2]}"));
}

// A bounded exponent (the server bounds it to 3 digits): as many digits and no more; unbounded by default.
TEST(Grammar, BoundedExponentDigits) {
  const auto v = byte_vocabulary();
  auto c = schema(R"({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})");
  EXPECT_TRUE(matches(compiled(c, v), R"({"x": 1.5e-12345})"));
  c.json.max_exponent_digits = 3;
  const auto bounded = compiled(c, v);
  for (const char* ok : {R"({"x": 1.5e-123})", R"({"x": 2E7})", R"({"x": -0.25e+30})", R"({"x": 12345})"})
    EXPECT_TRUE(matches(bounded, ok)) << ok;
  EXPECT_FALSE(matches(bounded, R"({"x": 1.5e-1234})"));
  auto spec =
      parse_constraint(nlohmann::ordered_json::parse(R"({"json_object": true, "exponent_digits": 3})"));
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->json.max_exponent_digits, 3);
  EXPECT_FALSE(
      parse_constraint(nlohmann::ordered_json::parse(R"({"json_object": true, "exponent_digits": -1})"))
          .ok());
}

TEST(Grammar, MaskAgreesWithAcceptAndStopComesLast) {
  const auto v = byte_vocabulary({"ab", "b\"", "\"}", "1}", "{\"", "\":"});
  const auto g = compiled(
      schema(R"({"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]})"), v);
  GrammarMatcher m(g);
  std::vector<std::int32_t> words(static_cast<std::size_t>(v.vocabulary->mask_words()));
  std::vector<std::int32_t> taken;
  for (const std::string piece : {"{\"", "ab", "\":", " ", "1}"}) {
    ASSERT_TRUE(m.fill_next_token_bitmask(words).ok());
    // Every token the mask allows is accepted, every other one refused.
    for (std::int32_t id = 0; id < v.vocabulary->size(); ++id) {
      GrammarMatcher probe(g);
      for (const std::int32_t t : taken) ASSERT_TRUE(probe.accept_token(t));
      EXPECT_EQ(probe.accept_token(id), allowed(words, id)) << "token " << id << " after " << taken.size();
    }
    const auto extra = std::find(v.extra.begin(), v.extra.end(), piece);
    const std::int32_t id = extra == v.extra.end() ? static_cast<unsigned char>(piece[0])
                                                   : 256 + static_cast<std::int32_t>(extra - v.extra.begin());
    EXPECT_FALSE(allowed(words, v.stop));
    ASSERT_TRUE(m.accept_token(id)) << piece;
    taken.push_back(id);
  }
  ASSERT_TRUE(m.fill_next_token_bitmask(words).ok());
  EXPECT_TRUE(allowed(words, v.stop));
  EXPECT_FALSE(allowed(words, ' '));  // nothing after the root object
  EXPECT_TRUE(m.accept_token(v.stop));
  EXPECT_TRUE(m.is_terminated());
  EXPECT_FALSE(m.accept_token('x'));
}

TEST(Grammar, RollbackRestoresEarlierStates) {
  const auto v = byte_vocabulary();
  const auto g = compiled(regex("(ab|ac)+"), v);
  GrammarMatcher m(g);
  std::vector<std::int32_t> before(static_cast<std::size_t>(v.vocabulary->mask_words()));
  std::vector<std::int32_t> after(before.size());
  ASSERT_TRUE(m.accept_token('a'));
  ASSERT_TRUE(m.fill_next_token_bitmask(before).ok());
  ASSERT_TRUE(m.accept_token('b'));
  ASSERT_TRUE(m.accept_token('a'));
  EXPECT_FALSE(m.accept_token('a'));  // a refused token leaves the state as it was
  ASSERT_TRUE(m.rollback(2).ok());
  ASSERT_TRUE(m.fill_next_token_bitmask(after).ok());
  EXPECT_EQ(before, after);
  EXPECT_TRUE(m.accept_token('c'));
  EXPECT_FALSE(m.rollback(4).ok());
  EXPECT_FALSE(m.fill_next_token_bitmask(std::span(after).first(after.size() - 1)).ok());
}

OutputConstraint ebnf(const std::string& text) {
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::grammar;
  c.grammar = text;
  return c;
}

TEST(Grammar, EbnfLanguage) {
  const auto v = byte_vocabulary();
  const auto g = compiled(ebnf(R"ebnf(# arithmetic
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor
    | factor "*" term   # continued on the next line
factor ::= [0-9]+ | "(" expr ")" | "\u00e9"{2,3}
)ebnf"),
                          v);
  for (const std::string yes : {"1+2*3", "(4-1)*2", "((7))", "ééé*1"}) EXPECT_TRUE(matches(g, yes)) << yes;
  for (const std::string no : {"", "1+", "(1", "é", "éééé", "1 + 2"}) EXPECT_FALSE(matches(g, no)) << no;
}

TEST(Grammar, UnsupportedEbnfIsRefusedNamingTheProblem) {
  const auto v = byte_vocabulary();
  for (const auto& [text, problem] :
       std::vector<std::pair<std::string, std::string>>{{"root ::= a", "'a' is not defined"},
                                                        {"start ::= \"x\"", "no rule named root"},
                                                        {"root ::= \"x\" (= \"y\")", "lookahead"},
                                                        {"root ::= root \"x\" | \"y\"", "left-recursive"},
                                                        {"root ::= \"x\"\nroot ::= \"y\"", "defined twice"},
                                                        {"root ::= [z-a]", "bad character range"},
                                                        {"root ::= \"x", "unterminated string"}}) {
    const auto out = compile(ebnf(text), v.vocabulary);
    ASSERT_FALSE(out.ok()) << text;
    EXPECT_EQ(out.status().code(), StatusCode::invalid_argument);
    EXPECT_NE(out.status().message().find(problem), std::string::npos) << out.status().message();
  }
}

TEST(Grammar, LeftRecursionIsRefused) {
  GrammarBuilder b;
  const std::int32_t r = b.new_rule("expr");
  b.add_alternative(r, {GrammarBuilder::ref(r), b.byte('+')});
  b.add_alternative(r, {b.byte('x')});
  const auto out = std::move(b).finish(r);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("left-recursive"), std::string::npos);
}

TEST(Grammar, ChoiceAndJsonObject) {
  const auto v = byte_vocabulary();
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::choice;
  c.choices = {"yes", "no", "yes!"};
  const auto g = compiled(c, v);
  EXPECT_TRUE(matches(g, "yes"));
  EXPECT_TRUE(matches(g, "yes!"));
  EXPECT_FALSE(matches(g, "ye"));
  OutputConstraint object;
  const auto any = compiled(object, v);
  EXPECT_TRUE(matches(any, R"({"a": [1, {"b": null}], "c": -2.5e+3})"));
  EXPECT_FALSE(matches(any, "[1]"));
}

// Token bytes of both tokenizer families: byte-level (the default model) and sentencepiece with byte
// fallback.
TEST(Grammar, VocabularyBytesFromTokenizers) {
  const auto tiny = Tokenizer::load(std::string(CAPSERVE_SOURCE_DIR) + "/deploy/models/capserve-moe-tiny");
  const auto v = TokenVocabulary::from_tokenizer(tiny, {*tiny.eos_id()});
  std::vector<std::int32_t> ids;
  ASSERT_TRUE(tiny.encode(" the\n", false, ids).ok());
  std::string joined;
  for (const auto id : ids) joined += *v.bytes(id);
  EXPECT_EQ(joined, " the\n");
  EXPECT_FALSE(v.bytes(*tiny.eos_id()).has_value());
  const auto llama = Tokenizer::load(std::string(CAPSERVE_SHARED_DATA_DIR) + "/tokenizers/llama2");
  const auto lv = TokenVocabulary::from_tokenizer(llama, {*llama.eos_id()});
  EXPECT_EQ(*lv.bytes(*llama.token_to_id("<0x0A>")), "\n");
  EXPECT_EQ(*lv.bytes(*llama.token_to_id("\xE2\x96\x81the")), " the");
}

}  // namespace
}  // namespace capserve::runtime::grammar
