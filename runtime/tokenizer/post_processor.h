#pragma once
// The tokenizer.json "post_processor" for single sequences with add_special_tokens: TemplateProcessing
// (special tokens around the sequence, e.g. Llama's BOS), ByteLevel (no change to ids) and Sequence of these.
#include <cstdint>
#include <optional>
#include <vector>

#include "runtime/tokenizer/json_at.h"

namespace capserve::runtime {

class PostProcessor {
 public:
  static PostProcessor from_json(const std::optional<JsonAt>& spec);

  [[nodiscard]] const std::vector<std::int32_t>& prefix() const { return prefix_; }
  [[nodiscard]] const std::vector<std::int32_t>& suffix() const { return suffix_; }

 private:
  void add(const JsonAt& spec);
  void add_template(const JsonAt& spec);

  std::vector<std::int32_t> prefix_;
  std::vector<std::int32_t> suffix_;
};

}  // namespace capserve::runtime
