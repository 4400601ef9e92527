#include "runtime/chat/jinja_methods.h"

#include <algorithm>
#include <array>

#include "runtime/chat/jinja_renderer.h"
#include "runtime/chat/jinja_strings.h"

namespace capserve::runtime::jinja {
namespace {

constexpr std::array kStrMethods = {"strip",    "lstrip",  "rstrip",  "split",   "rsplit",     "startswith",
                                    "endswith", "replace", "upper",   "lower",   "title",      "capitalize",
                                    "find",     "rfind",   "count",   "join",    "splitlines", "isdigit",
                                    "isalpha",  "isalnum", "isspace", "isupper", "islower"};
constexpr std::array kDictMethods = {"get", "items", "keys", "values", "copy"};
constexpr std::array kListMethods = {"count", "index", "copy"};
// What the immutable sandbox refuses: the methods that modify a dict or list in place.
constexpr std::array kDictUnsafe = {"pop", "popitem", "setdefault", "update", "clear"};
constexpr std::array kListUnsafe = {"append", "extend",  "insert", "pop",
                                    "remove", "reverse", "sort",   "clear"};

template <std::size_t N>
bool listed(const std::array<const char*, N>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

enum class Kind { none, safe, unsafe };

Kind method_kind(const Value& self, std::string_view name) {
  if (self.is_string()) return listed(kStrMethods, name) ? Kind::safe : Kind::none;
  if (self.is_dict()) {
    if (listed(kDictMethods, name)) return Kind::safe;
    return listed(kDictUnsafe, name) ? Kind::unsafe : Kind::none;
  }
  if (self.is_list()) {
    if (listed(kListMethods, name)) return Kind::safe;
    return listed(kListUnsafe, name) ? Kind::unsafe : Kind::none;
  }
  return Kind::none;
}

[[noreturn]] void unsafe(const Value& self, std::string_view name) {
  throw Error(ErrorKind::security_error, "access to attribute '" + std::string(name) + "' of '" +
                                             std::string(type_name(self)) + "' object is unsafe.");
}

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

const std::string& str_arg(const Value* v, std::string_view method) {
  if (v == nullptr || !v->is_string()) {
    require_defined(v == nullptr ? Value(None{}) : *v);
    type_error(std::string(method) + "() argument must be str, not " +
               std::string(v == nullptr ? "nothing" : type_name(*v)));
  }
  return v->str();
}

std::optional<std::string> optional_str(const Value* v, std::string_view method) {
  if (v == nullptr || v->is_none()) return std::nullopt;
  return str_arg(v, method);
}

std::int64_t int_arg(const Value* v, std::int64_t fallback) {
  if (v == nullptr || v->is_none()) return fallback;
  if (!v->is_int() && !v->is_bool())
    type_error("'" + std::string(type_name(*v)) + "' object cannot be interpreted as an integer");
  return v->as_int();
}

template <typename Predicate>
Value all_chars(const std::string& s, Predicate p) {
  if (s.empty()) return false;
  return std::all_of(s.begin(), s.end(), [&](char c) { return p(static_cast<unsigned char>(c)) != 0; });
}

bool affix_match(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    const std::string& x = str_arg(&a, prefix ? "startswith" : "endswith");
    return prefix ? s.starts_with(x) : s.ends_with(x);
  };
  if (affix.is_list()) return std::any_of(affix.list().begin(), affix.list().end(), one);
  return one(affix);
}

// Every str a method returns is made of the receiver's and the arguments' bytes, each keeping its client
// mark; case mapping is per ASCII byte, so the marks stay where they were.
Value str_method(Renderer& r, const Str& self, std::string_view name, const Args& args) {
  const std::string& s = self.text;
  const Value* a0 = args.get(0, "");
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const std::optional<std::string> chars = optional_str(args.get(0, "chars"), name);
    return substr(self, py_strip_chars(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    // Split at most as often as a list within the value bound has room for, and refuse when more is left.
    const std::size_t room = r.options().max_value_bytes / sizeof(Value);
    const std::int64_t maxsplit = int_arg(args.get(1, "maxsplit"), -1);
    const auto capped =
        static_cast<std::int64_t>(maxsplit < 0 ? room : std::min(static_cast<std::size_t>(maxsplit), room));
    const std::vector<std::string_view> pieces =
        py_split(s, optional_str(args.get(0, "sep"), name), capped, name == "rsplit");
    const bool cut = pieces.size() > room && (maxsplit < 0 || maxsplit > capped);
    // Each cut may split one of the receiver's client ranges in two.
    const std::size_t client_ranges = self.client.empty() ? 0 : self.client.size() + pieces.size();
    r.produce(
        Renderer::list_bytes(cut ? SIZE_MAX : pieces.size(), Renderer::str_bytes(s.size(), client_ranges)));
    List parts;
    parts.reserve(pieces.size());
    for (const std::string_view p : pieces) parts.emplace_back(substr(self, p));
    return parts;
  }
  if (name == "startswith" || name == "endswith") {
    if (a0 == nullptr) type_error(std::string(name) + "() takes at least 1 argument (0 given)");
    return affix_match(s, *a0, name == "startswith");
  }
  if (name == "replace") {
    str_arg(args.get(1, "new"), name);
    return replace(r, self, str_arg(args.get(0, "old"), name), args.get(1, "new")->marked(),
                   int_arg(args.get(2, "count"), -1));
  }
  if (name == "upper") return Str{py_upper(s), self.client};
  if (name == "lower") return Str{py_lower(s), self.client};
  if (name == "title") return Str{py_title(s), self.client};
  if (name == "capitalize") return Str{py_capitalize(s), self.client};
  if (name == "find" || name == "rfind") {
    const std::string& sub = str_arg(a0, name);
    const std::size_t at = name == "find" ? s.find(sub) : s.rfind(sub);
    if (at == std::string::npos) return -1;
    return static_cast<std::int64_t>(code_point_count(std::string_view(s).substr(0, at)));
  }
  if (name == "count") {
    const std::string& sub = str_arg(a0, name);
    if (sub.empty()) return static_cast<std::int64_t>(code_point_count(s) + 1);
    std::int64_t n = 0;
    for (std::size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return n;
  }
  if (name == "join") {
    if (a0 == nullptr) type_error("join() takes exactly one argument (0 given)");
    const std::shared_ptr<const List> items = r.items(*a0);
    std::size_t size = 0;
    std::size_t client_ranges = 0;
    for (const Value& item : *items) {
      if (!item.is_string())
        type_error("sequence item: expected str instance, " + std::string(type_name(item)) + " found");
      size = size_add(size, size_add(item.str().size(), s.size()));
      client_ranges = size_add(client_ranges, size_add(item.marked().client.size(), self.client.size()));
    }
    r.produce(Renderer::str_bytes(size, client_ranges));
    Str out;
    out.text.reserve(size);
    bool first = true;
    for (const Value& item : *items) {
      if (!first) append(out, self);
      first = false;
      append(out, item.marked());
    }
    return out;
  }
  if (name == "splitlines") {
    // At most one line per byte.
    r.charge(work(Value(None{})) + s.size() / kBytesPerStep);
    List lines;
    for (const std::string_view line : py_splitlines(s)) lines.emplace_back(substr(self, line));
    return lines;
  }
  if (name == "isdigit") return all_chars(s, ::isdigit);
  if (name == "isalpha") return all_chars(s, ::isalpha);
  if (name == "isalnum") return all_chars(s, ::isalnum);
  if (name == "isspace") return all_chars(s, ::isspace);
  const bool has_alpha =
      std::any_of(s.begin(), s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
  if (name == "isupper") return has_alpha && py_upper(s) == s;
  return has_alpha && py_lower(s) == s;  // islower
}

Value dict_method(Renderer& r, const Value& self, std::string_view name, const Args& args) {
  const Dict& d = self.dict();
  if (name == "get") {
    const Value* key = args.get(0, "key");
    if (key == nullptr) type_error("get expected at least 1 argument, got 0");
    const Value* found = key->is_string() ? d.find(key->str()) : nullptr;
    if (found != nullptr) return *found;
    const Value* fallback = args.get(1, "default");
    return fallback != nullptr ? *fallback : Value(None{});
  }
  if (name == "copy") return self;
  // items() builds a pair (a list of two) per item.
  r.produce(Renderer::list_bytes(size_mul(d.items.size(), name == "items" ? 3 : 1), 0));
  List out;
  out.reserve(d.items.size());
  for (const auto& [k, v] : d.items) {
    if (name == "items") {
      out.push_back(pair(k, v));
    } else if (name == "keys") {
      out.emplace_back(k);
    } else {
      out.push_back(v);
    }
  }
  return out;
}

Value list_method(const Value& self, std::string_view name, const Args& args) {
  if (name == "copy") return self;
  const Value* item = args.get(0, "value");
  if (item == nullptr) type_error(std::string(name) + "() takes exactly one argument (0 given)");
  const List& l = self.list();
  if (name == "count") {
    return static_cast<std::int64_t>(
        std::count_if(l.begin(), l.end(), [&](const Value& v) { return equals(v, *item); }));
  }
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (equals(l[i], *item)) return static_cast<std::int64_t>(i);
  }
  std::string shown;
  append_repr(*item, shown);
  throw Error(ErrorKind::value_error, shown + " is not in list");
}

}  // namespace

// (key, value) as the tuple dict.items() yields.
Value pair(const Value& key, const Value& value) {
  List p{key, value};
  p.tuple = true;
  return p;
}

namespace {

struct BoundMethod final : Callable {
  BoundMethod(Value s, std::string n) : self(std::move(s)), method(std::move(n)) {}
  Value call(Renderer& r, Args& args) const override { return *call_method(r, self, method, args); }
  std::string_view name() const override { return method; }
  Value self;
  std::string method;
};

}  // namespace

std::optional<Value> call_method(Renderer& r, const Value& self, std::string_view name, const Args& args) {
  switch (method_kind(self, name)) {
    case Kind::none:
      return std::nullopt;
    case Kind::unsafe:
      unsafe(self, name);
    case Kind::safe:
      break;
  }
  // Every method looks through its operands at most a few times, except as charged where it does more.
  r.charge(work(self) + work(args));
  if (self.is_string()) return str_method(r, self.marked(), name, args);
  if (self.is_dict()) return dict_method(r, self, name, args);
  return list_method(self, name, args);
}

Str replace(Renderer& r, const Str& s, std::string_view old, const Str& replacement, std::int64_t count) {
  const ReplaceSize size = py_replace_size(s, old, replacement, count);
  r.produce(Renderer::str_bytes(size.bytes, size.client_ranges));
  return py_replace(s, old, replacement, count);
}

std::optional<Value> bound_method(const Value& self, std::string_view name) {
  switch (method_kind(self, name)) {
    case Kind::none:
      return std::nullopt;
    case Kind::unsafe:
      return Value(Undefined{"access to attribute '" + std::string(name) + "' of '" +
                                 std::string(type_name(self)) + "' object is unsafe.",
                             ErrorKind::security_error});
    case Kind::safe:
      break;
  }
  return Value(std::shared_ptr<const Callable>(std::make_shared<const BoundMethod>(self, std::string(name))));
}

}  // namespace capserve::runtime::jinja
