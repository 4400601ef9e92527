#include "runtime/tokenizer/json_at.h"

#include "runtime/load_error.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {

void JsonAt::fail(std::string_view message) const {
  throw LoadError(path() + ": " + std::string(message));
}

JsonAt JsonAt::child(const nlohmann::json& value, std::string_view step) const {
  std::string path = path_;
  if (!path.empty() && step.front() != '[') path += '.';
  path += step;
  return {value, file_, std::move(path)};
}

JsonAt JsonAt::member(const std::string& key, const nlohmann::json& value) const {
  std::string step = "[\"";  // appended piecewise: GCC 12 warns falsely (-Wrestrict) on operator+ here
  step.append(key).append("\"]");
  return child(value, step);
}

JsonAt JsonAt::at(std::string_view key) const {
  require_object();
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) fail("missing key '" + std::string(key) + "'");
  return child(*it, key);
}

JsonAt JsonAt::at(std::size_t index) const {
  require_array();
  if (index >= value_->size()) fail("index " + std::to_string(index) + " out of range");
  std::string step = "[";
  step.append(std::to_string(index)).append("]");
  return child((*value_)[index], step);
}

std::optional<JsonAt> JsonAt::find(std::string_view key) const {
  require_object();
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return child(*it, key);
}

std::string JsonAt::string() const {
  if (!value_->is_string()) fail(std::string("must be a string, got ") + value_->type_name());
  return value_->get<std::string>();
}

bool JsonAt::boolean() const {
  if (!value_->is_boolean()) fail(std::string("must be a boolean, got ") + value_->type_name());
  return value_->get<bool>();
}

std::int64_t JsonAt::integer() const {
  if (!value_->is_number_integer()) fail(std::string("must be an integer, got ") + value_->type_name());
  return value_->get<std::int64_t>();
}

std::string JsonAt::character() const {
  std::string s = string();
  std::size_t pos = 0;
  if (s.empty() || (utf8::decode(s, pos), pos != s.size())) fail("must be exactly one character");
  return s;
}

void JsonAt::require_object() const {
  if (!value_->is_object()) fail(std::string("must be an object, got ") + value_->type_name());
}

void JsonAt::require_array() const {
  if (!value_->is_array()) fail(std::string("must be a list, got ") + value_->type_name());
}

std::string JsonAt::string_or(std::string_view key, std::string fallback) const {
  const auto v = find(key);
  return v ? v->string() : std::move(fallback);
}

bool JsonAt::boolean_or(std::string_view key, bool fallback) const {
  const auto v = find(key);
  return v ? v->boolean() : fallback;
}

}  // namespace capserve::runtime
