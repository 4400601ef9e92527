#pragma once
// JSON in and out of template values: template inputs from JSON documents (key order kept), and the tojson
// filter exactly as Python's json.dumps writes it (transformers replaces Jinja's HTML-safe tojson with it).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/chat/jinja_value.h"

namespace capserve::runtime::jinja {

// A request's JSON (tools, tool calls, template kwargs) as template values: every str in it, dict keys
// included, is the client's.
[[nodiscard]] Value from_json(const nlohmann::ordered_json& json);

struct JsonOptions {
  std::optional<std::string> indent;  // nullopt: one line; else each level is indented by this string
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
  // LimitError as soon as the text would pass this many bytes: nested containers that share their items, or
  // a wide indent at every level, make text far larger than the value it writes.
  std::size_t max_bytes = SIZE_MAX;
};

// json.dumps(value, ...); TypeError for a value JSON cannot hold (Undefined, a namespace, a function).
void append_json(const Value& value, const JsonOptions& options, std::string& out);

}  // namespace capserve::runtime::jinja
