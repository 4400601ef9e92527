#pragma once
// The tokenizer.json "normalizer": a sequence of NFC, Prepend and Replace (string pattern) steps, applied to
// each stretch of text between added tokens.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer/json_at.h"

namespace capserve::runtime {

// Buffers reused across calls so that normalizing allocates nothing once warm.
struct NormalizerScratch {
  std::vector<std::int32_t> code_points;
  std::string text;
};

class Normalizer {
 public:
  Normalizer() = default;  // the identity
  // `spec` is the "normalizer" value (absent/null means the identity).
  static Normalizer from_json(const std::optional<JsonAt>& spec);

  [[nodiscard]] bool is_identity() const { return steps_.empty(); }
  [[nodiscard]] bool prepends() const;

  // Writes the normalized form of `text` (well-formed UTF-8) into `out`, reusing its capacity.
  void normalize(std::string_view text, std::string& out, NormalizerScratch& scratch) const;

 private:
  struct Step {
    enum class Kind { nfc, prepend, replace } kind;
    std::string pattern;  // replace: the literal to find
    std::string content;  // prepend: the prefix; replace: the replacement
  };
  void add_steps(const JsonAt& spec);

  std::vector<Step> steps_;
};

}  // namespace capserve::runtime
