#pragma once
// Checked reading of tokenizer.json / tokenizer_config.json: every failure is a LoadError that names the file
// and the JSON path at fault, e.g. "tokenizer.json: pre_tokenizer.pretokenizers[1].behavior: ...".
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace capserve::runtime {

class JsonAt {
 public:
  // The document root; `file` (which must outlive this and every JsonAt taken from it) names it in errors.
  JsonAt(const nlohmann::json& value, const std::string& file) : value_(&value), file_(&file) {}

  [[nodiscard]] const nlohmann::json& json() const { return *value_; }
  // Where this value is, for messages: "tokenizer.json: model.merges[3]".
  [[nodiscard]] std::string path() const { return *file_ + (path_.empty() ? "" : ": " + path_); }

  [[noreturn]] void fail(std::string_view message) const;

  // A member that must be present and not null.
  [[nodiscard]] JsonAt at(std::string_view key) const;
  [[nodiscard]] JsonAt at(std::size_t index) const;
  // An object member found by iteration.
  [[nodiscard]] JsonAt member(const std::string& key, const nlohmann::json& value) const;
  // A member that may be absent or null.
  [[nodiscard]] std::optional<JsonAt> find(std::string_view key) const;

  [[nodiscard]] std::string string() const;
  [[nodiscard]] bool boolean() const;
  [[nodiscard]] std::int64_t integer() const;
  // The single Unicode character a string must hold (HF's `char` fields).
  [[nodiscard]] std::string character() const;
  void require_object() const;
  void require_array() const;

  [[nodiscard]] std::string string_or(std::string_view key, std::string fallback) const;
  [[nodiscard]] bool boolean_or(std::string_view key, bool fallback) const;
  // The component's "type" tag.
  [[nodiscard]] std::string type() const { return at("type").string(); }

 private:
  JsonAt(const nlohmann::json& value, const std::string* file, std::string path)
      : value_(&value), file_(file), path_(std::move(path)) {}
  [[nodiscard]] JsonAt child(const nlohmann::json& value, std::string_view step) const;

  const nlohmann::json* value_;
  const std::string* file_;
  std::string path_;
};

}  // namespace capserve::runtime
