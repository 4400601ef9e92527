#include "runtime/chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace capserve::runtime::jinja {
namespace {

[[noreturn]] void type_error(std::string message) {
  throw Error(ErrorKind::type_error, std::move(message));
}

void append_string_repr(std::string_view s, std::string& out) {
  const char quote =
      (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) ? '"' : '\'';
  out += quote;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20 || u == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  out += quote;
}

std::size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;  // an invalid lead byte counts as one character of its own
}

// Marks [begin, end) of out.text as the client's, merging with a range that ends where it begins.
void mark(Str& out, std::size_t begin, std::size_t end) {
  if (begin == end) return;
  if (!out.client.empty() && out.client.back().end == begin) {
    out.client.back().end = end;
  } else {
    out.client.push_back({begin, end});
  }
}

}  // namespace

Str client_str(std::string text, bool from_client) {
  Str out{std::move(text), {}};
  if (from_client) mark(out, 0, out.text.size());
  return out;
}

void append(Str& out, std::string_view piece) {
  out.text.append(piece);
}

void append(Str& out, const Str& piece) {
  const std::size_t shift = out.text.size();
  // `piece` may be `out` itself (a str repeated by doubling): its ranges are read by index, and its last one,
  // which the first range appended may extend, is read before that.
  const std::size_t count = piece.client.size();
  const TextRange last = count == 0 ? TextRange{} : piece.client[count - 1];
  for (std::size_t i = 0; i < count; ++i) {
    const TextRange r = i + 1 == count ? last : piece.client[i];
    mark(out, shift + r.begin, shift + r.end);
  }
  out.text.append(piece.text);
}

Str substr(const Str& s, std::string_view part) {
  if (part.empty()) return {};  // also a default view, which points nowhere in s
  const auto begin = static_cast<std::size_t>(part.data() - s.text.data());
  const std::size_t end = begin + part.size();
  Str out{std::string(part), {}};
  auto r = std::partition_point(s.client.begin(), s.client.end(),
                                [begin](const TextRange& range) { return range.end <= begin; });
  for (; r != s.client.end() && r->begin < end; ++r)
    mark(out, std::max(r->begin, begin) - begin, std::min(r->end, end) - begin);
  return out;
}

Value::Value(Dict d) : v(std::make_shared<const Dict>(std::move(d))) {}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, value] : items) {
    if (k.is_string() && k.str() == key) return &value;
  }
  return nullptr;
}

const Value* Dict::find_key(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, value] : items) {
    if (equals(k, key)) return &value;
  }
  return nullptr;
}

void Dict::set(Value key, Value value) {
  for (auto& [k, existing] : items) {
    if (equals(k, key)) {
      existing = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

const Value* Args::get(std::size_t index, std::string_view name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [k, value] : keyword) {
    if (k == name) return &value;
  }
  return nullptr;
}

std::string_view type_name(const Value& v) {
  switch (v.v.index()) {
    case 0:
      return "Undefined";
    case 1:
      return "NoneType";
    case 2:
      return "bool";
    case 3:
      return "int";
    case 4:
      return "float";
    case 5:
      return "str";
    case 6:
      return "list";
    case 7:
      return "dict";
    case 8:
      return "Namespace";
    default:
      return "function";
  }
}

std::string object_description(const Value& v) {
  if (v.is_none()) return "'None'";
  std::string out(1, '\'');
  out += type_name(v);
  out += " object'";
  return out;
}

void require_defined(const Value& v) {
  if (v.is_undefined()) throw Error(v.undefined().error, v.undefined().hint);
}

bool truthy(const Value& v) {
  switch (v.v.index()) {
    case 0:
    case 1:
      return false;
    case 2:
      return std::get<bool>(v.v);
    case 3:
      return std::get<std::int64_t>(v.v) != 0;
    case 4:
      return std::get<double>(v.v) != 0.0;
    case 5:
      return !v.str().empty();
    case 6:
      return !v.list().empty();
    case 7:
      return !v.dict().items.empty();
    default:
      return true;
  }
}

void append_float(double d, std::string& out) {
  if (std::isnan(d)) {
    out += "nan";
    return;
  }
  if (std::isinf(d)) {
    out += d < 0 ? "-inf" : "inf";
    return;
  }
  // Shortest round-trip digits, laid out as Python's repr: exponent form below 1e-4 and from 1e16 on.
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(end - buf));
  const std::size_t e_at = sci.find('e');
  std::string_view mantissa = sci.substr(0, e_at);
  int exponent = 0;
  std::from_chars(sci.data() + e_at + 1 + (sci[e_at + 1] == '+' ? 1 : 0), sci.data() + sci.size(), exponent);
  const bool negative = mantissa.starts_with('-');
  if (negative) mantissa.remove_prefix(1);
  std::string digits;
  for (const char c : mantissa) {
    if (c != '.') digits += c;
  }
  if (negative) out += '-';
  if (exponent < -4 || exponent >= 16) {
    out += digits[0];
    if (digits.size() > 1) {
      out += '.';
      out.append(digits, 1);
    }
    char exp[16];
    std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  } else if (exponent < 0) {
    out += "0.";
    out.append(static_cast<std::size_t>(-exponent - 1), '0');
    out += digits;
  } else {
    const auto int_digits = static_cast<std::size_t>(exponent) + 1;
    if (digits.size() <= int_digits) {
      out += digits;
      out.append(int_digits - digits.size(), '0');
      out += ".0";
    } else {
      out.append(digits, 0, int_digits);
      out += '.';
      out.append(digits, int_digits);
    }
  }
}

void append_repr(const Value& v, std::string& out) {
  if (v.is_string()) {
    append_string_repr(v.str(), out);
  } else if (v.is_list()) {
    const List& l = v.list();
    out += l.tuple ? '(' : '[';
    bool first = true;
    for (const Value& item : l) {
      if (!first) out += ", ";
      first = false;
      append_repr(item, out);
    }
    if (l.tuple && l.size() == 1) out += ',';
    out += l.tuple ? ')' : ']';
  } else if (v.is_dict()) {
    out += '{';
    bool first = true;
    for (const auto& [k, item] : v.dict().items) {
      if (!first) out += ", ";
      first = false;
      append_repr(k, out);
      out += ": ";
      append_repr(item, out);
    }
    out += '}';
  } else if (v.is_undefined()) {
    out += "Undefined";
  } else {
    append_str(v, out);
  }
}

void append_str(const Value& v, std::string& out) {
  switch (v.v.index()) {
    case 0:
      return;
    case 1:
      out += "None";
      return;
    case 2:
      out += std::get<bool>(v.v) ? "True" : "False";
      return;
    case 3:
      out += std::to_string(std::get<std::int64_t>(v.v));
      return;
    case 4:
      append_float(std::get<double>(v.v), out);
      return;
    case 5:
      out += v.str();
      return;
    case 8: {
      out += "<Namespace ";
      append_repr(Value(v.ns().attrs), out);
      out += '>';
      return;
    }
    case 9:
      out += "<function ";
      out += v.callable().name();
      out += '>';
      return;
    default:
      append_repr(v, out);
  }
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  std::string out;
  append_str(v, out);
  return out;
}

void append_str(const Value& v, Str& out) {
  if (v.is_string()) {
    append(out, v.marked());
    return;
  }
  const std::size_t begin = out.text.size();
  append_str(v, out.text);
  if (from_client(v)) mark(out, begin, out.text.size());
}

Str to_marked_str(const Value& v) {
  if (v.is_string()) return v.marked();
  Str out;
  append_str(v, out);
  return out;
}

bool from_client(const Value& v) {
  const auto dict_from_client = [](const Dict& d) {
    return std::any_of(d.items.begin(), d.items.end(),
                       [](const auto& item) { return from_client(item.first) || from_client(item.second); });
  };
  switch (v.v.index()) {
    case 5:
      return !v.marked().client.empty();
    case 6:
      return std::any_of(v.list().begin(), v.list().end(),
                         [](const Value& item) { return from_client(item); });
    case 7:
      return dict_from_client(v.dict());
    case 8:
      return dict_from_client(v.ns().attrs);
    default:
      return false;
  }
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.v.index() != b.v.index()) return false;
  switch (a.v.index()) {
    case 0:
    case 1:
      return true;
    case 5:
      return a.str() == b.str();
    case 6: {
      const List& x = a.list();
      const List& y = b.list();
      if (x.size() != y.size()) return false;
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (!equals(x[i], y[i])) return false;
      }
      return true;
    }
    case 7: {
      const Dict& x = a.dict();
      const Dict& y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, value] : x.items) {
        const Value* other = y.find_key(k);
        if (other == nullptr || !equals(value, *other)) return false;
      }
      return true;
    }
    case 8:
      return &a.ns() == &b.ns();
    default:
      return &a.callable() == &b.callable();
  }
}

bool less(const Value& a, const Value& b) {
  require_defined(a);
  require_defined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order is code point order
  if (a.is_list() && b.is_list()) {
    const List& x = a.list();
    const List& y = b.list();
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  type_error("'<' not supported between instances of '" + std::string(type_name(a)) + "' and '" +
             std::string(type_name(b)) + "'");
}

const Value* group_field(const List& l, std::string_view name) {
  if (!l.group || l.size() != 2) return nullptr;
  if (name == "grouper") return &l[0];
  if (name == "list") return &l[1];
  return nullptr;
}

std::size_t length(const Value& v) {
  if (v.is_string()) return code_point_count(v.str());
  if (v.is_list()) return v.list().size();
  if (v.is_dict()) return v.dict().items.size();
  if (v.is_undefined()) return 0;
  if (v.is_namespace()) return v.ns().attrs.items.size();
  type_error("object of type '" + std::string(type_name(v)) + "' has no len()");
}

std::shared_ptr<const List> iterate(const Value& v) {
  if (v.is_list()) return std::get<std::shared_ptr<const List>>(v.v);
  auto out = std::make_shared<List>();
  if (v.is_dict()) {
    out->reserve(v.dict().items.size());
    for (const auto& [k, value] : v.dict().items) out->emplace_back(k);
  } else if (v.is_string()) {
    for (const std::string_view c : code_points(v.str())) out->emplace_back(substr(v.marked(), c));
  } else if (!v.is_undefined()) {
    type_error("'" + std::string(type_name(v)) + "' object is not iterable");
  }
  return out;
}

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = std::min(utf8_length(static_cast<unsigned char>(s[i])), s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// Steps exactly as code_points does (invalid UTF-8 included), so that a count and an index agree.
std::size_t code_point_count(std::string_view s) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < s.size(); ++n)
    i += std::min(utf8_length(static_cast<unsigned char>(s[i])), s.size() - i);
  return n;
}

}  // namespace capserve::runtime::jinja
