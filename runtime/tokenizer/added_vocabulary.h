#pragma once
// The tokenizer.json "added_tokens": tokens matched in the text before anything else, as HF's AddedVocabulary
// does it: leftmost-longest matching, first of the tokens with normalized=false on the raw text, then of
// those with normalized=true on the normalized remainder; single_word, lstrip and rstrip honoured.
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/text_range.h"

namespace capserve::runtime {

struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Receives the pieces of a text in order: plain text (id < 0) or an added token.
class PieceSink {
 public:
  virtual void piece(std::string_view text, std::int32_t added_token_id) = 0;

 protected:
  ~PieceSink() = default;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `patterns[i]` is the text matched for `tokens[i]`.
  AddedTokenMatcher(const std::vector<AddedToken>& tokens, const std::vector<std::string>& patterns);

  // Cuts `text` into plain pieces and added tokens. Empty `text` gives one empty plain piece, as in HF.
  // Special tokens are not matched where they would overlap a range of `plain_text` (sorted byte ranges of
  // `text`): there the text is cut as if they did not exist.
  void split(std::string_view text, PieceSink& sink, std::span<const TextRange> plain_text = {}) const;

  [[nodiscard]] bool empty() const { return nodes_.size() <= 1; }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::int32_t>> children;  // sorted by byte
    std::int32_t token = -1;  // index into tokens_ when a pattern ends here
  };
  // The longest pattern starting at `pos`: its token index, and its length through `length`.
  [[nodiscard]] std::int32_t longest_at(std::string_view text, std::size_t pos, std::size_t& length) const;

  std::vector<Node> nodes_{Node{}};
  std::vector<AddedToken> tokens_;
  std::array<bool, 256> first_byte_{};
};

}  // namespace capserve::runtime
