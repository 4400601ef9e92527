#include "runtime/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/grammar/regex.h"

namespace capserve::runtime::grammar {
namespace {

// Ordered: properties are generated in the order the schema lists them.
using json = nlohmann::ordered_json;
using Sequence = GrammarBuilder::Sequence;

const std::set<std::string, std::less<>>& annotations() {
  static const std::set<std::string, std::less<>> keys{"title",    "description", "$schema",  "$id",
                                                       "$comment", "default",     "examples", "deprecated",
                                                       "readOnly", "writeOnly",   "$defs",    "definitions"};
  return keys;
}

const std::map<std::string, std::string, std::less<>>& formats() {
  static const std::map<std::string, std::string, std::less<>> patterns{
      {"date", R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))"},
      {"time", R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))"},
      {"date-time",
       R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))"},
      {"uuid", R"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})"},
      {"ipv4", R"(((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))"},
      {"email", R"([a-zA-Z0-9_.+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)+)"},
  };
  return patterns;
}

// Integer bounds are kept within int64; these stand for "no bound".
constexpr std::int64_t kOpenLow = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t kOpenHigh = std::numeric_limits<std::int64_t>::max();

class SchemaConverter {
 public:
  SchemaConverter(const json& root, const JsonOptions& options) : root_(root), options_(options) {}

  StatusOr<Grammar> convert() {
    const std::int32_t rule = b_.new_rule("root");
    Sequence body = value(root_, "");
    if (!error_.ok()) return std::move(error_);
    b_.add_alternative(rule, std::move(body));
    auto grammar = std::move(b_).finish(rule);
    // Only a $ref can make the converter's rules recursive, and one that recurses before any text is refused.
    if (!grammar.ok()) {
      return Status::invalid_argument("JSON schema keyword '$ref': recursion before any text (" +
                                      grammar.status().message() + ")");
    }
    return grammar;
  }

 private:
  Sequence fail(const std::string& keyword, const std::string& path, const std::string& why) {
    if (error_.ok()) {
      error_ = Status::invalid_argument("JSON schema keyword '" + keyword + "' at '" +
                                        (path.empty() ? "#" : path) + "': " + why);
    }
    return {};
  }

  // Whitespace, string characters and strings get a rule of their own at each use: a rule with one caller
  // lets the mask cache see what follows it (Grammar::sole_return), so that a token such as "\n  \"" or
  // "abc\"," is decided at compile time instead of against the stack at every step.

  // Whitespace where JSON allows it (none in compact form).
  Sequence ws() {
    if (options_.whitespace == JsonWhitespace::compact) return {};
    ByteSet set;
    for (const char c : std::string_view(" \n\r\t")) set.set(static_cast<unsigned char>(c));
    if (options_.whitespace == JsonWhitespace::any) return {b_.star("ws", {b_.bytes(set)})};
    return {*b_.repeat("ws", {b_.bytes(set)}, 0, options_.max_whitespace)};
  }
  // Between members and items, and between a key and its value.
  Sequence comma() {
    return options_.whitespace == JsonWhitespace::compact ? lit(", ") : cat({ws(), lit(","), ws()});
  }
  Sequence colon() {
    return options_.whitespace == JsonWhitespace::compact ? lit(": ") : cat({ws(), lit(":"), ws()});
  }
  Sequence lit(std::string_view text) { return b_.literal(text); }
  static Sequence cat(std::initializer_list<Sequence> parts) {
    Sequence out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  }
  Element plain_char() { return b_.codepoints(complement({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}})); }
  Element escape() {
    if (!escape_) {
      ByteSet hex_set;
      for (const char c : std::string_view("0123456789abcdefABCDEF"))
        hex_set.set(static_cast<unsigned char>(c));
      const Element hex_digit = b_.bytes(hex_set);
      ByteSet simple;
      for (const char c : std::string_view("\"\\/bfnrt")) simple.set(static_cast<unsigned char>(c));
      escape_ = b_.choice(
          "escape", {{b_.bytes(simple)}, cat({lit("u"), {hex_digit, hex_digit, hex_digit, hex_digit}})});
    }
    return *escape_;
  }
  // Any number of string characters (a fresh rule, its characters inlined).
  Element chars() {
    const std::int32_t rule = b_.new_rule("chars");
    b_.add_alternative(rule, {plain_char(), GrammarBuilder::ref(rule)});
    b_.add_alternative(rule, {b_.byte('\\'), escape(), GrammarBuilder::ref(rule)});
    b_.add_alternative(rule, {});
    return GrammarBuilder::ref(rule);
  }
  // min..max string characters (max < 0: no bound), one fresh rule per place so that each is single-caller.
  StatusOr<Element> bounded_chars(std::int64_t min, std::int64_t max) {
    const std::int64_t places = max < 0 ? min : max;
    if (places > GrammarBuilder::kMaxRepetition) {
      return Status::invalid_argument("above " + std::to_string(GrammarBuilder::kMaxRepetition) +
                                      " characters");
    }
    Element tail = max < 0 ? chars() : b_.choice("chars_end", {{}});
    for (std::int64_t k = places - 1; k >= 0; --k) {
      if (b_.over_budget()) return GrammarBuilder::too_large();
      std::vector<Sequence> alternatives{{plain_char(), tail}, {b_.byte('\\'), escape(), tail}};
      if (k >= min) alternatives.push_back({});
      tail = b_.choice("char_" + std::to_string(k), std::move(alternatives));
    }
    return tail;
  }
  Sequence any_string() { return cat({lit("\""), {chars()}, lit("\"")}); }
  Element any_number() {
    if (!number_) {
      ByteSet digit;
      for (char c = '0'; c <= '9'; ++c) digit.set(static_cast<unsigned char>(c));
      const Element d = b_.bytes(digit);
      const Element more = b_.star("digits", {d});
      ByteSet nonzero = digit;
      nonzero.reset('0');
      ByteSet exp;
      exp.set('e');
      exp.set('E');
      ByteSet sign;
      sign.set('+');
      sign.set('-');
      // Bounded, the exponent's digits after the first are a repetition of at most max - 1 (a small count:
      // the builder cannot refuse it).
      const Element exponent_more =
          options_.max_exponent_digits > 0
              ? *b_.repeat("exponent_digits", {d}, 0, options_.max_exponent_digits - 1)
              : more;
      number_ = b_.choice(
          "number", {{b_.optional("minus", lit("-")), b_.choice("int", {lit("0"), {b_.bytes(nonzero), more}}),
                      b_.optional("fraction", {b_.byte('.'), d, more}),
                      b_.optional("exponent", {b_.bytes(exp), b_.optional("sign", {b_.bytes(sign)}), d,
                                               exponent_more})}});
    }
    return *number_;
  }
  Element any_integer() {
    if (!integer_) integer_ = integer_range(std::nullopt, std::nullopt);
    return *integer_;
  }
  Element any_value() {
    if (!any_) {
      const std::int32_t rule = b_.new_rule("value");
      any_ = GrammarBuilder::ref(rule);
      const Element array = b_.choice(
          "array", {cat({lit("["), ws(), {*any_, b_.star("items", cat({comma(), {*any_}}))}, ws(), lit("]")}),
                    cat({lit("["), ws(), lit("]")})});
      const Element object = any_object();
      for (Sequence alt : {Sequence{any_number()}, any_string(), lit("true"), lit("false"), lit("null"),
                           Sequence{array}, Sequence{object}}) {
        b_.add_alternative(rule, std::move(alt));
      }
    }
    return *any_;
  }
  Element any_object() {
    if (!object_) {
      const std::int32_t rule = b_.new_rule("object");
      object_ = GrammarBuilder::ref(rule);
      const Element member = b_.choice("member", {cat({any_string(), colon(), {any_value()}})});
      b_.add_alternative(
          rule,
          cat({lit("{"), ws(), {member, b_.star("members", cat({comma(), {member}}))}, ws(), lit("}")}));
      b_.add_alternative(rule, cat({lit("{"), ws(), lit("}")}));
    }
    return *object_;
  }

  // Integers in [lo, hi] (either open), spelled without leading zeros ("-0" excluded).
  Element integer_range(std::optional<std::int64_t> lo, std::optional<std::int64_t> hi) {
    const std::int64_t low = lo.value_or(kOpenLow);
    const std::int64_t high = hi.value_or(kOpenHigh);
    std::vector<Sequence> alternatives;
    if (low < 0) {
      // The negatives -m, m in [max(1, -high), -low].
      for (auto& alt : naturals(high < 0 ? -high : 1, low == kOpenLow ? kOpenHigh : -low)) {
        alternatives.push_back(cat({lit("-"), alt}));
      }
    }
    if (high >= 0) {
      for (auto& alt : naturals(std::max<std::int64_t>(0, low), high)) alternatives.push_back(std::move(alt));
    }
    return b_.choice("integer", std::move(alternatives));
  }

  // The decimal spellings of [lo, hi], lo >= 0 (hi == kOpenHigh: no upper bound).
  std::vector<Sequence> naturals(std::int64_t lo, std::int64_t hi) {
    std::vector<Sequence> out;
    if (hi < lo) return out;
    if (lo == 0) {
      out.push_back(lit("0"));
      lo = 1;
      if (hi < 1) return out;
    }
    const bool open = hi == kOpenHigh;
    const auto lo_text = std::to_string(lo);
    const std::size_t last_length = open ? lo_text.size() : std::to_string(hi).size();
    for (std::size_t length = lo_text.size(); length <= last_length; ++length) {
      std::string first(length, '0');
      first[0] = '1';
      if (length == lo_text.size()) first = lo_text;
      const std::string last = !open && length == last_length ? std::to_string(hi) : std::string(length, '9');
      out.push_back({same_length(first, last)});
    }
    if (open) {
      // Longer than lo: [1-9] then at least lo's digit count more.
      ByteSet digit;
      for (char c = '0'; c <= '9'; ++c) digit.set(static_cast<unsigned char>(c));
      ByteSet nonzero = digit;
      nonzero.reset('0');
      Sequence longer{b_.bytes(nonzero)};
      for (std::size_t i = 0; i < lo_text.size(); ++i) longer.push_back(b_.bytes(digit));
      longer.push_back(b_.star("digits", {b_.bytes(digit)}));
      out.push_back(std::move(longer));
    }
    return out;
  }

  // The strings of `lo.size()` digits from lo to hi (lo <= hi).
  Element same_length(const std::string& lo, const std::string& hi) {
    const auto range = [&](char a, char b) {
      ByteSet set;
      for (char c = a; c <= b; ++c) set.set(static_cast<unsigned char>(c));
      return b_.bytes(set);
    };
    if (lo.size() == 1) return range(lo[0], hi[0]);
    const std::string lo_rest = lo.substr(1);
    const std::string hi_rest = hi.substr(1);
    if (lo[0] == hi[0])
      return b_.choice("digits",
                       {{b_.byte(static_cast<std::uint8_t>(lo[0])), same_length(lo_rest, hi_rest)}});
    std::vector<Sequence> alternatives;
    char full_first = lo[0];
    char full_last = hi[0];
    if (lo_rest != std::string(lo_rest.size(), '0')) {
      alternatives.push_back({b_.byte(static_cast<std::uint8_t>(lo[0])),
                              same_length(lo_rest, std::string(lo_rest.size(), '9'))});
      ++full_first;
    }
    if (hi_rest != std::string(hi_rest.size(), '9')) {
      alternatives.push_back({b_.byte(static_cast<std::uint8_t>(hi[0])),
                              same_length(std::string(hi_rest.size(), '0'), hi_rest)});
      --full_last;
    }
    if (full_first <= full_last) {
      Sequence full{range(full_first, full_last)};
      for (std::size_t i = 0; i < lo_rest.size(); ++i) full.push_back(range('0', '9'));
      alternatives.push_back(std::move(full));
    }
    return b_.choice("digits", std::move(alternatives));
  }

  static std::string child(const std::string& path, const std::string& key) { return path + "/" + key; }

  Sequence value(const json& schema, const std::string& path) {
    if (!error_.ok()) return {};
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return {any_value()};
      return fail("false", path, "a schema that matches nothing");
    }
    if (!schema.is_object()) return fail("schema", path, "not an object or boolean");
    if (schema.contains("$ref")) return reference(schema, path);
    if (schema.contains("const")) return lit(schema["const"].dump());
    if (schema.contains("enum")) {
      const json& values = schema["enum"];
      if (!values.is_array() || values.empty()) return fail("enum", path, "not a non-empty array");
      std::vector<Sequence> alternatives;
      for (const auto& v : values) alternatives.push_back(lit(v.dump()));
      return {b_.choice("enum", std::move(alternatives))};
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!schema.contains(key)) continue;
      const json& branches = schema[key];
      if (!branches.is_array() || branches.empty()) return fail(key, path, "not a non-empty array");
      std::vector<Sequence> alternatives;
      for (std::size_t i = 0; i < branches.size(); ++i) {
        alternatives.push_back(
            value(merged(schema, branches[i], key), child(path, key) + "/" + std::to_string(i)));
      }
      return {b_.choice(key, std::move(alternatives))};
    }
    if (!schema.contains("type")) return untyped(schema, path);
    const json& type = schema["type"];
    if (type.is_array()) {
      std::vector<Sequence> alternatives;
      for (const auto& t : type) {
        json one = schema;
        one["type"] = t;
        alternatives.push_back(value(one, path));
      }
      if (alternatives.empty()) return fail("type", path, "an empty list of types");
      return {b_.choice("types", std::move(alternatives))};
    }
    if (!type.is_string()) return fail("type", path, "not a string or list");
    return typed(type.get<std::string>(), schema, path);
  }

  // A branch of anyOf / oneOf with the parent's other keywords (a parent "type" or "properties" beside
  // anyOf).
  static json merged(const json& parent, const json& branch, const char* key) {
    if (!branch.is_object()) return branch;
    json out = branch;
    for (const auto& [k, v] : parent.items()) {
      if (k != key && !annotations().contains(k) && !out.contains(k)) out[k] = v;
    }
    return out;
  }

  // No type: the keywords present say which (a schema of annotations only is any value).
  Sequence untyped(const json& schema, const std::string& path) {
    for (const auto& [key, unused] : schema.items()) {
      if (annotations().contains(key)) continue;
      if (key == "properties" || key == "required" || key == "additionalProperties")
        return typed("object", schema, path);
      if (key == "items" || key == "minItems" || key == "maxItems") return typed("array", schema, path);
      if (key == "pattern" || key == "minLength" || key == "maxLength" || key == "format") {
        return typed("string", schema, path);
      }
      return fail(key, path, "not supported without a type");
    }
    return {any_value()};
  }

  // Refuses the keywords of `schema` outside `handled` and the annotations.
  bool only(const json& schema, std::initializer_list<const char*> handled, const std::string& path) {
    for (const auto& [key, unused] : schema.items()) {
      if (annotations().contains(key) || key == "type") continue;
      if (std::none_of(handled.begin(), handled.end(), [&](const char* h) { return key == h; })) {
        fail(key, path, "not supported");
        return false;
      }
    }
    return true;
  }

  Sequence typed(const std::string& type, const json& schema, const std::string& path) {
    if (type == "string") return string(schema, path);
    if (type == "integer") return integer(schema, path);
    if (type == "number") return number(schema, path);
    if (type == "boolean") {
      if (!only(schema, {}, path)) return {};
      return {b_.choice("boolean", {lit("true"), lit("false")})};
    }
    if (type == "null") {
      if (!only(schema, {}, path)) return {};
      return lit("null");
    }
    if (type == "array") return array(schema, path);
    if (type == "object") return object(schema, path);
    return fail("type", path, "unknown type '" + type + "'");
  }

  std::optional<std::int64_t> count(const json& schema, const char* key, const std::string& path) {
    if (!schema.contains(key)) return std::nullopt;
    const json& v = schema[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0) {
      fail(key, path, "not a non-negative integer");
      return std::nullopt;
    }
    return v.get<std::int64_t>();
  }

  Sequence string(const json& schema, const std::string& path) {
    if (!only(schema, {"pattern", "minLength", "maxLength", "format"}, path)) return {};
    const auto min = count(schema, "minLength", path);
    const auto max = count(schema, "maxLength", path);
    std::optional<std::string> pattern;
    if (schema.contains("pattern")) {
      if (!schema["pattern"].is_string()) return fail("pattern", path, "not a string");
      pattern = schema["pattern"].get<std::string>();
    } else if (schema.contains("format")) {
      const auto format = schema["format"].is_string() ? formats().find(schema["format"].get<std::string>())
                                                       : formats().end();
      if (format == formats().end())
        return fail("format", path, "format " + schema["format"].dump() + " not supported");
      pattern = format->second;
    }
    if (pattern) {
      if (min || max)
        return fail(min ? "minLength" : "maxLength", path, "not supported together with a pattern");
      auto body = regex_sequence(*pattern, RegexText::json_string, b_);
      if (!body.ok())
        return fail(schema.contains("pattern") ? "pattern" : "format", path, body.status().message());
      return cat({lit("\""), {b_.choice("pattern", {std::move(*body)})}, lit("\"")});
    }
    if (!error_.ok()) return {};
    if (!min && !max) return any_string();
    if (min && max && *max < *min) return fail("maxLength", path, "below minLength");
    auto chars = bounded_chars(min.value_or(0), max ? *max : -1);
    if (!chars.ok()) return fail(max ? "maxLength" : "minLength", path, chars.status().message());
    return cat({lit("\""), {*chars}, lit("\"")});
  }

  Sequence integer(const json& schema, const std::string& path) {
    if (!only(schema, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, path)) return {};
    std::optional<std::int64_t> lo;
    std::optional<std::int64_t> hi;
    constexpr double kLimit = 9.0e18;
    for (const char* key : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!schema.contains(key)) continue;
      const json& v = schema[key];
      if (!v.is_number() || std::abs(v.get<double>()) > kLimit)
        return fail(key, path, "not a number within int64");
      const bool lower = std::string_view(key).ends_with("inimum");
      const bool exclusive = std::string_view(key).starts_with("exclusive");
      const double x = v.get<double>();
      if (lower) {
        const auto bound = static_cast<std::int64_t>(exclusive ? std::floor(x) + 1 : std::ceil(x));
        lo = lo ? std::max(*lo, bound) : bound;
      } else {
        const auto bound = static_cast<std::int64_t>(exclusive ? std::ceil(x) - 1 : std::floor(x));
        hi = hi ? std::min(*hi, bound) : bound;
      }
    }
    if (lo && hi && *lo > *hi) return fail("minimum", path, "the bounds leave no integer");
    if (!lo && !hi) return {any_integer()};
    return {integer_range(lo, hi)};
  }

  // Numbers with whole-number bounds, exact: a value n.f is n's decimal spelling (the integer grammar) and a
  // fraction class, split where a bound falls on n. Without an exponent and with at most 6 decimals (a
  // bounded number is written out, as xgrammar writes it).
  struct Bound {
    std::int64_t value = 0;
    bool exclusive = false;
  };
  enum class Fraction { none, any, zero, nonzero };

  static Fraction meet(Fraction a, Fraction b) {
    if (a == Fraction::any) return b;
    if (b == Fraction::any || a == b) return a;
    return Fraction::none;
  }

  // At most kFractionDigits decimals, as xgrammar writes a bounded number (and a small model's digits end).
  static constexpr std::int64_t kFractionDigits = 6;

  Sequence fraction(Fraction f) {
    ByteSet digit;
    for (char c = '0'; c <= '9'; ++c) digit.set(static_cast<unsigned char>(c));
    ByteSet nonzero = digit;
    nonzero.reset('0');
    const auto upto = [&](const ByteSet& set, std::int64_t min, std::int64_t max) {
      return *b_.repeat("digits", {b_.bytes(set)}, min, max);
    };
    switch (f) {
      case Fraction::any:
        return {b_.optional("fraction", {b_.byte('.'), upto(digit, 1, kFractionDigits)})};
      case Fraction::zero:
        return {b_.optional("fraction", {b_.byte('.'), upto(ByteSet().set('0'), 1, kFractionDigits)})};
      case Fraction::nonzero: {
        // The first nonzero digit at place p.
        std::vector<Sequence> alternatives;
        for (std::int64_t p = 0; p < kFractionDigits; ++p) {
          alternatives.push_back(
              {upto(ByteSet().set('0'), p, p), b_.bytes(nonzero), upto(digit, 0, kFractionDigits - 1 - p)});
        }
        return {b_.byte('.'), b_.choice("nonzero_fraction", std::move(alternatives))};
      }
      case Fraction::none:
        break;
    }
    return {};
  }

  // The spellings n.f of the values w >= 0 within [lo, hi].
  std::vector<Sequence> unsigned_decimals(std::optional<Bound> lo, std::optional<Bound> hi) {
    const auto lower = [&](std::int64_t n) {
      if (!lo || n > lo->value) return Fraction::any;
      if (n == lo->value) return lo->exclusive ? Fraction::nonzero : Fraction::any;
      return Fraction::none;
    };
    const auto upper = [&](std::int64_t n) {
      if (!hi || n < hi->value) return Fraction::any;
      if (n == hi->value) return hi->exclusive ? Fraction::none : Fraction::zero;
      return Fraction::none;
    };
    std::vector<Sequence> out;
    const auto emit = [&](std::int64_t a, std::int64_t b, Fraction f) {
      if (f == Fraction::none || b < a) return;
      std::vector<Sequence> ints = naturals(a, b);
      if (ints.empty()) return;
      out.push_back(cat({{b_.choice("int", std::move(ints))}, fraction(f)}));
    };
    const std::int64_t start = lo ? std::max<std::int64_t>(0, lo->value) : 0;
    if (hi && hi->value < start) return out;
    emit(start, start, meet(lower(start), upper(start)));
    if (hi) {
      emit(start + 1, hi->value - 1, Fraction::any);
      if (hi->value > start) emit(hi->value, hi->value, meet(lower(hi->value), upper(hi->value)));
    } else {
      emit(start + 1, kOpenHigh, Fraction::any);
    }
    return out;
  }

  Sequence number(const json& schema, const std::string& path) {
    if (!only(schema, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, path)) return {};
    std::optional<Bound> lo;
    std::optional<Bound> hi;
    constexpr double kLimit = 1.0e15;
    for (const char* key : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!schema.contains(key)) continue;
      const json& v = schema[key];
      if (!v.is_number() || std::abs(v.get<double>()) > kLimit ||
          v.get<double>() != std::floor(v.get<double>())) {
        return fail(key, path, "a bound on a number must be a whole number within 1e15");
      }
      const Bound bound{static_cast<std::int64_t>(v.get<double>()),
                        std::string_view(key).starts_with("exclusive")};
      if (std::string_view(key).ends_with("inimum")) {
        if (!lo || bound.value > lo->value || (bound.value == lo->value && bound.exclusive)) lo = bound;
      } else if (!hi || bound.value < hi->value || (bound.value == hi->value && bound.exclusive)) {
        hi = bound;
      }
    }
    if (!lo && !hi) return {any_number()};
    // v >= 0 as itself, v <= 0 as "-" and w = -v with the bounds mirrored.
    std::vector<Sequence> alternatives = unsigned_decimals(lo, hi);
    const auto mirror = [](std::optional<Bound> b) {
      return b ? std::optional<Bound>(Bound{-b->value, b->exclusive}) : std::nullopt;
    };
    // "-" only before a value below zero ("-0" and "-0.0" are zero, written without it, as xgrammar does).
    std::optional<Bound> above = mirror(hi);
    if (!above || above->value < 0 || (above->value == 0 && !above->exclusive)) above = Bound{0, true};
    for (auto& alt : unsigned_decimals(above, mirror(lo))) alternatives.push_back(cat({lit("-"), alt}));
    if (alternatives.empty()) return fail("minimum", path, "the bounds leave no number");
    return {b_.choice("number", std::move(alternatives))};
  }

  Sequence array(const json& schema, const std::string& path) {
    if (!only(schema, {"items", "minItems", "maxItems"}, path)) return {};
    if (schema.contains("uniqueItems") && schema["uniqueItems"] == true)
      return fail("uniqueItems", path, "not supported");
    const std::int64_t min = count(schema, "minItems", path).value_or(0);
    const auto max = count(schema, "maxItems", path);
    if (!error_.ok()) return {};
    if (max && *max < min) return fail("maxItems", path, "below minItems");
    const Sequence item =
        schema.contains("items") ? value(schema["items"], child(path, "items")) : Sequence{any_value()};
    if (!error_.ok()) return {};
    std::vector<Sequence> alternatives;
    if (min == 0) alternatives.push_back(cat({lit("["), ws(), lit("]")}));
    if (!max || *max > 0) {
      const Element first = b_.choice("item", {item});
      auto rest = b_.repeat("items", cat({comma(), {first}}), std::max<std::int64_t>(min, 1) - 1,
                            max ? *max - 1 : -1);
      if (!rest.ok()) return fail(max ? "maxItems" : "minItems", path, rest.status().message());
      alternatives.push_back(cat({lit("["), ws(), {first, *rest}, ws(), lit("]")}));
    }
    return {b_.choice("array", std::move(alternatives))};
  }

  Sequence object(const json& schema, const std::string& path) {
    if (!only(schema, {"properties", "required", "additionalProperties"}, path)) return {};
    const json empty = json::object();
    const json& properties = schema.contains("properties") ? schema["properties"] : empty;
    if (!properties.is_object()) return fail("properties", path, "not an object");
    std::set<std::string> required;
    if (schema.contains("required")) {
      if (!schema["required"].is_array()) return fail("required", path, "not an array");
      for (const auto& name : schema["required"]) {
        if (!name.is_string() || !properties.contains(name.get<std::string>())) {
          return fail("required", path, "names " + name.dump() + ", which is not among the properties");
        }
        required.insert(name.get<std::string>());
      }
    }
    // Additional properties: false unless said (strict, as xgrammar), except in an object schema that lists
    // no properties, which is any object.
    const json* additional = nullptr;
    json any_schema = true;
    if (schema.contains("additionalProperties")) {
      const json& a = schema["additionalProperties"];
      if (!a.is_boolean() && !a.is_object())
        return fail("additionalProperties", path, "not a boolean or schema");
      if (!(a.is_boolean() && !a.get<bool>())) additional = &a;
    } else if (properties.empty()) {
      additional = &any_schema;
    }
    if (properties.empty() && additional && additional->is_boolean()) return {any_object()};

    std::vector<std::pair<std::string, const json*>> listed;
    for (const auto& [name, sub] : properties.items()) listed.emplace_back(name, &sub);
    std::optional<Sequence> extra;  // one additional member, key and value
    if (additional) {
      Sequence extra_value = value(*additional, child(path, "additionalProperties"));
      if (!error_.ok()) return {};
      std::vector<std::string> names;
      for (const auto& [name, unused] : listed) names.push_back(name);
      for (const auto& name : names) {
        if (std::any_of(name.begin(), name.end(),
                        [](char c) { return static_cast<unsigned char>(c) >= 0x80; })) {
          return fail("additionalProperties", path, "beside a non-ASCII property name");
        }
      }
      extra = {b_.choice("extra_member", {cat({{b_.byte('"'), key_except(names)}, colon(), extra_value})})};
    }
    // after[i]: the members from the i-th on, at least one member already written (each starts with a comma);
    // first[i]: the same with none written yet.
    const std::size_t n = listed.size();
    // first[i] is never empty (an object without members is its own alternative, so that "{" and "}" have
    // one whitespace between them, not two); it is absent where nothing can follow.
    std::vector<Element> after(n + 1);
    std::vector<std::optional<Element>> first(n + 1);
    if (extra) {
      const Element more = b_.star("extra_members", cat({comma(), *extra}));
      after[n] = more;
      first[n] = b_.choice("members_end", {cat({*extra, {more}})});
    } else {
      after[n] = b_.choice("members_end", {{}});
    }
    bool all_optional = true;
    for (std::size_t i = n; i-- > 0;) {
      const auto& [name, sub] = listed[i];
      Sequence member =
          cat({lit(json(name).dump()), colon(), value(*sub, child(path, "properties/" + name))});
      if (!error_.ok()) return {};
      const bool optional = !required.contains(name);
      all_optional = all_optional && optional;
      std::vector<Sequence> a{cat({comma(), member, {after[i + 1]}})};
      std::vector<Sequence> f{cat({member, {after[i + 1]}})};
      if (optional) {
        a.push_back({after[i + 1]});
        if (first[i + 1]) f.push_back({*first[i + 1]});
      }
      after[i] = b_.choice("members", std::move(a));
      first[i] = b_.choice("members", std::move(f));
    }
    std::vector<Sequence> alternatives;
    if (first[0]) alternatives.push_back(cat({lit("{"), ws(), {*first[0]}, ws(), lit("}")}));
    if (all_optional) alternatives.push_back(cat({lit("{"), ws(), lit("}")}));
    return {b_.choice("object", std::move(alternatives))};
  }

  // A JSON string key, after its opening quote, other than `names` (compared as written, escapes not
  // decoded): a trie over the names in which a name's last node refuses the closing quote.
  Element key_except(const std::vector<std::string>& names, std::size_t depth = 0) {
    std::map<unsigned char, std::vector<std::string>> next;
    bool is_name = false;
    for (const auto& name : names) {
      if (name.size() == depth)
        is_name = true;
      else
        next[static_cast<unsigned char>(name[depth])].push_back(name);
    }
    std::vector<Sequence> alternatives;
    if (!is_name) alternatives.push_back(lit("\""));
    // Leaving the trie: a character whose first byte is no edge (or an escape), then any rest of the key.
    std::vector<CodepointRange> off_trie;
    for (const auto& r : complement({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}})) {
      for (std::uint32_t cp = r.first; cp <= r.last && cp < 0x80; ++cp) {
        if (!next.contains(static_cast<unsigned char>(cp))) off_trie.push_back({cp, cp});
      }
      if (r.last >= 0x80) off_trie.push_back({std::max<std::uint32_t>(r.first, 0x80), r.last});
    }
    // (Names are ASCII: object() refuses others beside additional properties.)
    alternatives.push_back({b_.codepoints(off_trie), chars(), b_.byte('"')});
    alternatives.push_back({b_.byte('\\'), escape(), chars(), b_.byte('"')});
    for (const auto& [byte, continuing] : next) {
      alternatives.push_back({b_.byte(byte), key_except(continuing, depth + 1)});
    }
    return b_.choice("key", std::move(alternatives));
  }

  Sequence reference(const json& schema, const std::string& path) {
    if (schema.size() > 1) {
      for (const auto& [key, unused] : schema.items()) {
        if (key != "$ref" && !annotations().contains(key))
          return fail(key, path, "not supported beside $ref");
      }
    }
    if (!schema["$ref"].is_string()) return fail("$ref", path, "not a string");
    const std::string ref = schema["$ref"].get<std::string>();
    if (const auto found = refs_.find(ref); found != refs_.end()) return {found->second};
    const json* target = nullptr;
    if (ref == "#") {
      target = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p(prefix);
        if (!ref.starts_with(p)) continue;
        const std::string section = p.substr(2, p.size() - 3);
        const std::string name = ref.substr(p.size());
        if (root_.contains(section) && root_[section].contains(name)) target = &root_[section][name];
      }
    }
    if (target == nullptr)
      return fail("$ref", path, "cannot resolve " + ref + " (only #, #/$defs/NAME, #/definitions/NAME)");
    const std::int32_t rule = b_.new_rule("ref " + ref);
    refs_.emplace(ref, GrammarBuilder::ref(rule));
    b_.add_alternative(rule, value(*target, ref.substr(1)));
    return {GrammarBuilder::ref(rule)};
  }

  const json& root_;
  JsonOptions options_;
  GrammarBuilder b_;
  Status error_;
  std::optional<Element> escape_;
  std::optional<Element> number_;
  std::optional<Element> integer_;
  std::optional<Element> any_;
  std::optional<Element> object_;
  std::map<std::string, Element> refs_;
};

}  // namespace

StatusOr<Grammar> json_schema_grammar(const nlohmann::ordered_json& schema, const JsonOptions& options) {
  if (options.whitespace == JsonWhitespace::at_most && options.max_whitespace < 0) {
    return Status::invalid_argument("a negative whitespace limit");
  }
  return SchemaConverter(schema, options).convert();
}

}  // namespace capserve::runtime::grammar
