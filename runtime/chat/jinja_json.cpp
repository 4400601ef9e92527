#include "runtime/chat/jinja_json.h"

#include <algorithm>
#include <cstdio>
#include <limits>

namespace capserve::runtime::jinja {
namespace {

// Nesting beyond this is refused (the values come from requests; recursion must stay bounded).
constexpr int kMaxJsonDepth = 256;

std::uint32_t decode_utf8(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  auto cont = [&](std::size_t k) {
    return i + k < s.size() ? static_cast<std::uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F) : 0U;
  };
  if (b0 < 0x80) {
    i += 1;
    return b0;
  }
  if ((b0 & 0xE0) == 0xC0) {
    const std::uint32_t cp = ((b0 & 0x1FU) << 6) | cont(1);
    i += 2;
    return cp;
  }
  if ((b0 & 0xF0) == 0xE0) {
    const std::uint32_t cp = ((b0 & 0x0FU) << 12) | (cont(1) << 6) | cont(2);
    i += 3;
    return cp;
  }
  const std::uint32_t cp = ((b0 & 0x07U) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
  i += 4;
  return cp;
}

void append_u_escape(std::uint32_t unit, std::string& out) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\u%04x", unit);
  out += buf;
}

void append_json_string(std::string_view s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      if (!ensure_ascii) {
        out += c;
        ++i;
        continue;
      }
      const std::uint32_t cp = decode_utf8(s, i);
      if (cp >= 0x10000) {
        append_u_escape(0xD800 + ((cp - 0x10000) >> 10), out);
        append_u_escape(0xDC00 + ((cp - 0x10000) & 0x3FF), out);
      } else {
        append_u_escape(cp, out);
      }
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (u < 0x20 || (ensure_ascii && u == 0x7f)) {
          append_u_escape(u, out);
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// json.dumps turns int, float, bool and None keys into strings.
std::string key_text(const Value& key) {
  if (key.is_string()) return key.str();
  if (key.is_bool()) return key.as_int() != 0 ? "true" : "false";
  if (key.is_none()) return "null";
  if (key.is_int() || key.is_float()) return to_str(key);
  throw Error(ErrorKind::type_error,
              "keys must be str, int, float, bool or None, not " + std::string(type_name(key)));
}

void check_size(const JsonOptions& o, std::size_t size) {
  if (size > o.max_bytes)
    throw Error(ErrorKind::limit_error,
                "tojson's text would exceed " + std::to_string(o.max_bytes) + " bytes");
}

void newline(const JsonOptions& o, int level, std::string& out) {
  check_size(o, out.size() + 1 + static_cast<std::size_t>(level) * o.indent->size());
  out += '\n';
  for (int i = 0; i < level; ++i) out += *o.indent;
}

void append_json_at(const Value& v, const JsonOptions& o, int level, std::string& out) {
  if (level > kMaxJsonDepth) throw Error(ErrorKind::value_error, "JSON nesting is too deep");
  check_size(o, out.size());
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_int() != 0 ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    const double d = v.as_double();
    if (d != d) {
      out += "NaN";
    } else if (d == std::numeric_limits<double>::infinity()) {
      out += "Infinity";
    } else if (d == -std::numeric_limits<double>::infinity()) {
      out += "-Infinity";
    } else {
      append_float(d, out);
    }
  } else if (v.is_string()) {
    append_json_string(v.str(), o.ensure_ascii, out);
  } else if (v.is_list()) {
    const List& l = v.list();
    if (l.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (std::size_t i = 0; i < l.size(); ++i) {
      if (i > 0) out += o.item_separator;
      if (o.indent) newline(o, level + 1, out);
      append_json_at(l[i], o, level + 1, out);
    }
    if (o.indent) newline(o, level, out);
    out += ']';
  } else if (v.is_dict()) {
    const Dict& d = v.dict();
    if (d.items.empty()) {
      out += "{}";
      return;
    }
    std::vector<const std::pair<Value, Value>*> entries;
    entries.reserve(d.items.size());
    for (const auto& entry : d.items) entries.push_back(&entry);
    if (o.sort_keys) {
      std::stable_sort(entries.begin(), entries.end(),
                       [](auto* a, auto* b) { return less(a->first, b->first); });
    }
    out += '{';
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (i > 0) out += o.item_separator;
      if (o.indent) newline(o, level + 1, out);
      append_json_string(key_text(entries[i]->first), o.ensure_ascii, out);
      out += o.key_separator;
      append_json_at(entries[i]->second, o, level + 1, out);
    }
    if (o.indent) newline(o, level, out);
    out += '}';
  } else {
    throw Error(ErrorKind::type_error,
                "Object of type " + std::string(type_name(v)) + " is not JSON serializable");
  }
}

Value from_json_at(const nlohmann::ordered_json& json, int depth) {
  if (depth > kMaxJsonDepth) throw Error(ErrorKind::value_error, "JSON nesting is too deep");
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None{};
    case nlohmann::ordered_json::value_t::boolean:
      return json.get<bool>();
    case nlohmann::ordered_json::value_t::number_integer:
      return json.get<std::int64_t>();
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = json.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(INT64_MAX)) return static_cast<double>(u);
      return static_cast<std::int64_t>(u);
    }
    case nlohmann::ordered_json::value_t::number_float:
      return json.get<double>();
    case nlohmann::ordered_json::value_t::string:
      return client_str(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      l.reserve(json.size());
      for (const auto& item : json) l.push_back(from_json_at(item, depth + 1));
      return l;
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.items.reserve(json.size());
      for (const auto& [k, item] : json.items())
        d.items.emplace_back(client_str(k), from_json_at(item, depth + 1));
      return d;
    }
    default:
      return None{};
  }
}

}  // namespace

Value from_json(const nlohmann::ordered_json& json) {
  return from_json_at(json, 0);
}

void append_json(const Value& value, const JsonOptions& options, std::string& out) {
  append_json_at(value, options, 0, out);
}

}  // namespace capserve::runtime::jinja
