#pragma once
// The values a Jinja2 chat template computes with, modelled on the Python objects Jinja2 passes around:
// None, bool, int, float, str, list (tuples too), dict (insertion-ordered), Jinja's Undefined, namespace
// objects and callables. Lists and dicts are immutable once built (the environment is an
// ImmutableSandboxedEnvironment), so they are shared rather than copied; only a namespace mutates.
// A str also knows which of its bytes came from the client (Str::client), so that the rendered prompt says
// which bytes the tokenizer must encode as plain text: every operation that builds a str from others keeps
// that mark per byte, or marks the whole result as the client's where it cannot (fail closed).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "runtime/chat/jinja_error.h"
#include "runtime/text_range.h"

namespace capserve::runtime::jinja {

struct Value;
// A Python list, or a tuple (printed with parentheses: dict.items() pairs, tuple literals).
struct List : std::vector<Value> {
  using std::vector<Value>::vector;
  bool tuple = false;
  // groupby's (grouper, list) pair, whose items are also its attributes .grouper and .list.
  bool group = false;
};
struct Dict;
struct Namespace;
struct Callable;
class Renderer;

// Jinja's Undefined: falsy, prints as "", iterates as empty; any other use raises `error` with `hint`
// (e.g. "'dict object' has no attribute 'content'"). The sandbox's unsafe attributes are Undefined that raise
// SecurityError.
struct Undefined {
  std::string hint;
  ErrorKind error = ErrorKind::undefined_error;
};
struct None {};

// A Python str and the bytes of it that came from the client (message content, tool calls, tool schemas,
// template kwargs), which must never become special tokens. Template text has no client bytes and
// pays nothing: `client` stays empty and unallocated.
struct Str {
  std::string text;
  std::vector<TextRange> client;  // sorted, disjoint, non-empty, never adjacent (adjacent ones are merged)
};

// `text` wholly the client's (or wholly template text when `from_client` is false).
[[nodiscard]] Str client_str(std::string text, bool from_client = true);
// Appends `piece` (template text, or a str with its client bytes) to `out`; `piece` may be `out` itself.
void append(Str& out, std::string_view piece);
void append(Str& out, const Str& piece);
// The bytes of `s` that `part` (a view into s.text) spans, with their marks.
[[nodiscard]] Str substr(const Str& s, std::string_view part);

struct Value {
  std::variant<Undefined, None, bool, std::int64_t, double, Str, std::shared_ptr<const List>,
               std::shared_ptr<const Dict>, std::shared_ptr<Namespace>, std::shared_ptr<const Callable>>
      v;

  Value() = default;
  Value(Undefined u) : v(std::move(u)) {}
  Value(None n) : v(n) {}
  Value(bool b) : v(b) {}
  Value(std::int64_t i) : v(i) {}
  Value(int i) : v(std::int64_t{i}) {}
  Value(double d) : v(d) {}
  // Template text: a str without client bytes.
  Value(std::string s) : v(Str{std::move(s), {}}) {}
  Value(std::string_view s) : v(Str{std::string(s), {}}) {}
  Value(const char* s) : v(Str{std::string(s), {}}) {}
  Value(Str s) : v(std::move(s)) {}
  Value(List l) : v(std::make_shared<const List>(std::move(l))) {}
  Value(Dict d);
  Value(std::shared_ptr<const List> l) : v(std::move(l)) {}
  Value(std::shared_ptr<const Dict> d) : v(std::move(d)) {}
  Value(std::shared_ptr<Namespace> n) : v(std::move(n)) {}
  Value(std::shared_ptr<const Callable> c) : v(std::move(c)) {}

  [[nodiscard]] bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  [[nodiscard]] bool is_none() const { return std::holds_alternative<None>(v); }
  [[nodiscard]] bool is_bool() const { return std::holds_alternative<bool>(v); }
  [[nodiscard]] bool is_int() const { return std::holds_alternative<std::int64_t>(v); }
  [[nodiscard]] bool is_float() const { return std::holds_alternative<double>(v); }
  [[nodiscard]] bool is_number() const { return is_int() || is_float() || is_bool(); }
  [[nodiscard]] bool is_string() const { return std::holds_alternative<Str>(v); }
  [[nodiscard]] bool is_list() const { return std::holds_alternative<std::shared_ptr<const List>>(v); }
  [[nodiscard]] bool is_dict() const { return std::holds_alternative<std::shared_ptr<const Dict>>(v); }
  [[nodiscard]] bool is_namespace() const { return std::holds_alternative<std::shared_ptr<Namespace>>(v); }
  [[nodiscard]] bool is_callable() const {
    return std::holds_alternative<std::shared_ptr<const Callable>>(v);
  }

  [[nodiscard]] const std::string& str() const { return std::get<Str>(v).text; }
  // The str with its client marks.
  [[nodiscard]] const Str& marked() const { return std::get<Str>(v); }
  [[nodiscard]] const List& list() const { return *std::get<std::shared_ptr<const List>>(v); }
  [[nodiscard]] const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(v); }
  [[nodiscard]] Namespace& ns() const { return *std::get<std::shared_ptr<Namespace>>(v); }
  [[nodiscard]] const Callable& callable() const { return *std::get<std::shared_ptr<const Callable>>(v); }
  [[nodiscard]] const Undefined& undefined() const { return std::get<Undefined>(v); }
  [[nodiscard]] std::int64_t as_int() const {
    return is_bool() ? std::get<bool>(v) : std::get<std::int64_t>(v);
  }
  [[nodiscard]] double as_double() const {
    return is_float() ? std::get<double>(v) : static_cast<double>(as_int());
  }
};

// A Python dict: insertion-ordered; keys compare as Python's do (1 == 1.0 == True).
struct Dict {
  std::vector<std::pair<Value, Value>> items;

  [[nodiscard]] const Value* find(std::string_view key) const;
  [[nodiscard]] const Value* find_key(const Value& key) const;
  void set(Value key, Value value);
};

struct Namespace {
  Dict attrs;
};

// Keyword and positional arguments of a call.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The argument at `index` or named `name`, or nullptr.
  [[nodiscard]] const Value* get(std::size_t index, std::string_view name) const;
};

// Globals, macros, bound methods, caller(): anything a template can call.
struct Callable {
  virtual ~Callable() = default;
  [[nodiscard]] virtual Value call(Renderer& renderer, Args& args) const = 0;
  [[nodiscard]] virtual std::string_view name() const = 0;
};

// Python's type name, for error messages ("NoneType", "str", "dict", ...).
[[nodiscard]] std::string_view type_name(const Value& v);
// The "'dict object'" / "'None'" that Jinja's attribute errors start with.
[[nodiscard]] std::string object_description(const Value& v);

// Raises the value's stored error when it is Undefined.
void require_defined(const Value& v);

// Python bool(v).
[[nodiscard]] bool truthy(const Value& v);
// Python str(v) (Undefined prints as ""), appended to `out`.
void append_str(const Value& v, std::string& out);
[[nodiscard]] std::string to_str(const Value& v);
// The same with client marks: a str keeps its own; any other value's text is the client's as a whole when
// anything in it came from the client (a list or dict printed whole).
void append_str(const Value& v, Str& out);
[[nodiscard]] Str to_marked_str(const Value& v);
// Whether any str in `v` (in a list, dict or namespace too) holds client bytes: the text an operation
// derives from `v` without keeping marks per byte (tojson, repr, escape) is then the client's.
[[nodiscard]] bool from_client(const Value& v);
// Python repr(v).
void append_repr(const Value& v, std::string& out);
// Python repr(float): the shortest string that reads back as the same double.
void append_float(double d, std::string& out);

// Python ==, and the ordering <, which raises TypeError for types Python cannot order.
[[nodiscard]] bool equals(const Value& a, const Value& b);
[[nodiscard]] bool less(const Value& a, const Value& b);

// groupby's pair's .grouper or .list; nullptr for any other list or name.
[[nodiscard]] const Value* group_field(const List& l, std::string_view name);

// Python len(v); TypeError for values without one.
[[nodiscard]] std::size_t length(const Value& v);
// The items of iterating over v (list items, dict keys, string characters); Undefined iterates as nothing;
// TypeError "'X' object is not iterable" otherwise.
[[nodiscard]] std::shared_ptr<const List> iterate(const Value& v);

// UTF-8 helpers: Python indexes strings by code point.
[[nodiscard]] std::vector<std::string_view> code_points(std::string_view s);
[[nodiscard]] std::size_t code_point_count(std::string_view s);

}  // namespace capserve::runtime::jinja
