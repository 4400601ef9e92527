#pragma once
// The tokenizer.json "pre_tokenizer": splits normalized text into the words BPE encodes. Supported: Sequence,
// Split (regex or string pattern, every split behaviour, invert), ByteLevel and Metaspace.
//
// A ByteLevel step must come last. It is then not carried out: words stay raw bytes and the BPE model works
// on bytes directly (its vocabulary converted at load), which is equivalent and saves a re-encoding per word.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"
#include "runtime/tokenizer/json_at.h"
#include "runtime/tokenizer/regex.h"

namespace capserve::runtime {

// Receives the words of a pre-tokenized text, in order.
class WordSink {
 public:
  virtual void word(std::string_view word) = 0;

 protected:
  ~WordSink() = default;
};

struct PreTokenizerScratch {
  RegexScratch regex;
  std::vector<std::string> buffers;  // one per step: the text a transforming step produced
};

class PreTokenizer {
 public:
  static PreTokenizer from_json(const std::optional<JsonAt>& spec);

  // Whether the last step is ByteLevel (words are then raw bytes to be encoded by byte-level BPE).
  [[nodiscard]] bool byte_level() const { return byte_level_; }
  [[nodiscard]] bool has_metaspace_first() const;

  // Splits `text`, one stretch of normalized text; `at_start` tells whether it begins the original input (for
  // Metaspace's prepend_scheme "first").
  Status run(std::string_view text, bool at_start, PreTokenizerScratch& scratch, WordSink& sink) const;

 private:
  enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
  enum class Prepend { always, first, never };
  struct Step {
    enum class Kind { split, byte_level_split, metaspace } kind;
    std::shared_ptr<const Regex> regex;  // split; byte_level_split when use_regex
    Behavior behavior = Behavior::isolated;
    bool invert = false;
    bool add_prefix_space = false;  // byte_level_split
    std::string replacement;        // metaspace
    Prepend prepend = Prepend::always;
    bool split = true;  // metaspace
  };
  class Merger;

  void add_steps(const JsonAt& spec);
  Status run_step(std::size_t index, std::string_view piece, bool at_start, PreTokenizerScratch& scratch,
                  WordSink& sink) const;
  Status split(std::size_t index, std::string_view piece, bool at_start, const Step& step,
               PreTokenizerScratch& scratch, WordSink& sink) const;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace capserve::runtime
