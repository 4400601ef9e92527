#include "server/client_json.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>

namespace capserve::server {
namespace {

// The path components a depth error shows: enough to name the field ("messages[0].tool_calls[0]"), short
// enough for a log line.
constexpr int kPathComponents = 4;

// A SAX handler that only follows the nesting: it stops the lexer at the first array or object past the
// limit (or at the first syntax error), remembering where it was. Nothing is built.
class DepthScan {
 public:
  using json = nlohmann::json;

  bool null() { return value(); }
  bool boolean(bool /*v*/) { return value(); }
  bool number_integer(json::number_integer_t /*v*/) { return value(); }
  bool number_unsigned(json::number_unsigned_t /*v*/) { return value(); }
  bool number_float(json::number_float_t /*v*/, const json::string_t& /*text*/) { return value(); }
  bool string(json::string_t& /*v*/) { return value(); }
  bool binary(json::binary_t& /*v*/) { return value(); }
  bool start_object(std::size_t /*size*/) { return open(false); }
  bool start_array(std::size_t /*size*/) { return open(true); }
  bool key(json::string_t& k) {
    // Keys are UTF-8 here (the lexer checks strings); a long one is cut for the message.
    if (depth_ <= kPathComponents) levels_[depth_ - 1].key = k.size() <= 64 ? k : excerpt(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& e) {
    syntax_error_ = e.what();
    return false;
  }

  [[nodiscard]] bool too_deep() const { return too_deep_; }
  [[nodiscard]] const std::string& syntax_error() const { return syntax_error_; }
  [[nodiscard]] bool root_is_object() const { return !levels_[0].array; }
  // Where the scan stopped, from the root: "messages[0].tool_calls[0]...", the first key alone.
  [[nodiscard]] std::string path() const {
    std::string out;
    const int shown = std::min(depth_ - 1, kPathComponents);
    for (int i = 0; i < shown; ++i) {
      const Level& level = levels_[i];
      if (level.array) {
        out += '[';
        out += std::to_string(level.next_index - 1);
        out += ']';
      } else {
        if (i > 0) out += '.';
        out += level.key;
      }
    }
    if (depth_ - 1 > kPathComponents) out += "...";
    return out;
  }
  // The root object's key under which the scan stopped.
  [[nodiscard]] const std::string& top_key() const { return levels_[0].key; }

 private:
  struct Level {
    bool array = false;
    std::size_t next_index = 0;  // arrays: the values started so far
    std::string key;             // objects: the current key
  };

  // A value (or a nested array or object) starts inside the current level.
  bool value() {
    if (depth_ > 0 && depth_ <= kPathComponents && levels_[depth_ - 1].array)
      ++levels_[depth_ - 1].next_index;
    return true;
  }
  bool open(bool array) {
    value();
    if (++depth_ > kMaxClientJsonDepth) {
      too_deep_ = true;
      return false;
    }
    if (depth_ <= kPathComponents) levels_[depth_ - 1] = {array, 0, {}};
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }

  int depth_ = 0;
  std::array<Level, kPathComponents> levels_;
  bool too_deep_ = false;
  std::string syntax_error_;
};

IntakeError invalid(std::string message, std::string param) {
  return {IntakeCode::invalid_argument, std::move(message), std::move(param)};
}

// Scans before anything is built; empty when `text` is one JSON document within the depth limit.
IntakeResult scan(std::string_view text, const std::string& field) {
  DepthScan scan;
  if (nlohmann::json::sax_parse(text, &scan)) return std::nullopt;
  const std::string name = field.empty() ? "the request body" : field;
  if (!scan.too_deep()) return invalid(name + ": not valid JSON (" + scan.syntax_error() + ")", field);
  const std::string limit =
      ": JSON nests deeper than " + std::to_string(kMaxClientJsonDepth) + " levels of arrays and objects";
  // A body's fields are its top-level keys.
  if (field.empty() && scan.root_is_object()) return invalid(scan.path() + limit, scan.top_key());
  return invalid(name + scan.path() + limit, field);
}

template <typename Json>
IntakeResult parse(std::string_view text, const std::string& field, Json& out) {
  if (IntakeResult bad = scan(text, field)) return bad;
  out = Json::parse(text);  // cannot fail: the scan read the same document
  return std::nullopt;
}

}  // namespace

IntakeResult parse_client_json(std::string_view text, const std::string& field, nlohmann::json& out) {
  return parse(text, field, out);
}

IntakeResult parse_client_json(std::string_view text, const std::string& field, nlohmann::ordered_json& out) {
  return parse(text, field, out);
}

}  // namespace capserve::server
