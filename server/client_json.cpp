#include "server/client_json.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "server/request_intake.h"

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

runtime::Status invalid(std::string message, std::string field) {
  return runtime::Status::invalid_argument(std::move(message), std::move(field));
}

// Scans before anything is built; ok when `text` is one JSON document within the depth limit.
runtime::Status scan(std::string_view text, const std::string& field) {
  DepthScan scan;
  if (nlohmann::json::sax_parse(text, &scan)) return {};
  const std::string name = field.empty() ? "the request body" : field;
  if (!scan.too_deep()) return invalid(name + ": not valid JSON (" + scan.syntax_error() + ")", field);
  const std::string limit =
      ": JSON nests deeper than " + std::to_string(kMaxClientJsonDepth) + " levels of arrays and objects";
  // A body's fields are its top-level keys.
  if (field.empty() && scan.root_is_object()) return invalid(scan.path() + limit, scan.top_key());
  return invalid(name + scan.path() + limit, field);
}

// Builds an ordered_json in time linear in the document. nlohmann's own parser inserts each key through
// ordered_map::operator[], a linear search of the object, so one object of n keys costs n² (a tool schema of
// 60k properties: tens of seconds). Here a key is appended, and only a repeated key (JSON allows them; the
// last value wins at the first one's place, as nlohmann and Python's json do) needs a search: a scan in a
// small object, a hash index built once an object grows past kIndexFrom keys.
class OrderedBuilder {
 public:
  using json = nlohmann::ordered_json;

  explicit OrderedBuilder(json& root) : root_(root) {}

  bool null() { return add(nullptr); }
  bool boolean(bool v) { return add(v); }
  bool number_integer(json::number_integer_t v) { return add(v); }
  bool number_unsigned(json::number_unsigned_t v) { return add(v); }
  bool number_float(json::number_float_t v, const json::string_t& /*text*/) { return add(v); }
  bool string(json::string_t& v) { return add(std::move(v)); }
  bool binary(json::binary_t& v) { return add(json::binary(std::move(v))); }
  bool start_object(std::size_t /*size*/) { return open(json::object()); }
  bool start_array(std::size_t /*size*/) { return open(json::array()); }
  bool key(json::string_t& k) {
    open_.back().key = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& /*e*/) {
    return false;  // not reached: the depth scan has read the same document
  }

 private:
  static constexpr std::size_t kIndexFrom = 16;
  using Pairs = json::object_t::Container;

  // An array or object being filled. Pointers into parents stay valid: a parent gets no new element while a
  // child is open.
  struct Open {
    json* node = nullptr;
    std::string key;  // objects: the key of the value that comes next
    std::unique_ptr<std::unordered_map<std::string, std::size_t>> index;  // objects past kIndexFrom keys
  };

  // Places `v` in the open container (or as the root); returns where it went.
  json* place(json&& v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Open& o = open_.back();
    if (o.node->is_array()) {
      auto& array = o.node->get_ref<json::array_t&>();
      array.push_back(std::move(v));
      return &array.back();
    }
    // The object's pairs as the vector they are, past ordered_map's searching insert.
    auto& object = static_cast<Pairs&>(o.node->get_ref<json::object_t&>());
    if (const std::size_t at = find(o, object); at != object.size()) {
      object[at].second = std::move(v);
      return &object[at].second;
    }
    object.emplace_back(o.key, std::move(v));
    if (o.index != nullptr) {
      o.index->emplace(std::move(o.key), object.size() - 1);
    } else if (object.size() > kIndexFrom) {
      o.index = std::make_unique<std::unordered_map<std::string, std::size_t>>();
      for (std::size_t i = 0; i < object.size(); ++i) o.index->emplace(object[i].first, i);
    }
    return &object.back().second;
  }
  // The index of the open object's current key among its keys, or its size when the key is new.
  static std::size_t find(const Open& o, const Pairs& object) {
    if (o.index != nullptr) {
      const auto it = o.index->find(o.key);
      return it == o.index->end() ? object.size() : it->second;
    }
    for (std::size_t i = 0; i < object.size(); ++i)
      if (object[i].first == o.key) return i;
    return object.size();
  }
  bool add(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& empty) {
    open_.push_back({place(std::move(empty)), {}, nullptr});
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }

  json& root_;
  std::vector<Open> open_;
};

}  // namespace

template <>
runtime::StatusOr<nlohmann::json> parse_client_json(std::string_view text, const std::string& field) {
  if (runtime::Status bad = scan(text, field); !bad.ok()) return bad;
  return nlohmann::json::parse(text);  // cannot fail: the scan read the same document
}

template <>
runtime::StatusOr<nlohmann::ordered_json> parse_client_json(std::string_view text, const std::string& field) {
  if (runtime::Status bad = scan(text, field); !bad.ok()) return bad;
  nlohmann::ordered_json built;
  OrderedBuilder builder(built);
  nlohmann::ordered_json::sax_parse(text, &builder);  // cannot fail: the scan read the same document
  return built;
}

}  // namespace capserve::server
