#include "runtime/tokenizer/added_vocabulary.h"

#include <algorithm>

#include "runtime/tokenizer/unicode_classes.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {
namespace {

// The last character of non-empty well-formed `text`.
char32_t last_character(std::string_view text) {
  std::size_t start = text.size() - 1;
  while (start > 0 && utf8::is_continuation(text[start])) --start;
  return utf8::decode(text, start);
}

char32_t first_character(std::string_view text) {
  std::size_t pos = 0;
  return utf8::decode(text, pos);
}

// Start of the run of white space that ends `text` (HF: the match of \s*$).
std::size_t trailing_space_start(std::string_view text) {
  std::size_t end = text.size();
  while (end > 0) {
    std::size_t start = end - 1;
    while (start > 0 && utf8::is_continuation(text[start])) --start;
    std::size_t pos = start;
    if (!unicode::is_white_space(utf8::decode(text, pos))) break;
    end = start;
  }
  return end;
}

// Length of the run of white space that starts `text` (HF: the match of ^\s*).
std::size_t leading_space_length(std::string_view text) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t next = pos;
    if (!unicode::is_white_space(utf8::decode(text, next))) break;
    pos = next;
  }
  return pos;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens,
                                     const std::vector<std::string>& patterns)
    : tokens_(tokens) {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const std::string& pattern = patterns[t];
    if (pattern.empty()) continue;
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
    std::size_t node = 0;
    for (const char ch : pattern) {
      const auto byte = static_cast<unsigned char>(ch);
      auto& children = nodes_[node].children;
      const auto it = std::lower_bound(children.begin(), children.end(), byte,
                                       [](const auto& child, unsigned char b) { return child.first < b; });
      if (it != children.end() && it->first == byte) {
        node = static_cast<std::size_t>(it->second);
      } else {
        const auto child = static_cast<std::int32_t>(nodes_.size());
        children.insert(it, {byte, child});
        nodes_.emplace_back();
        node = static_cast<std::size_t>(child);
      }
    }
    nodes_[node].token = static_cast<std::int32_t>(t);
  }
}

std::int32_t AddedTokenMatcher::longest_at(std::string_view text, std::size_t pos,
                                           std::size_t& length) const {
  std::int32_t best = -1;
  std::size_t node = 0;
  for (std::size_t i = pos; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& children = nodes_[node].children;
    const auto it = std::lower_bound(children.begin(), children.end(), byte,
                                     [](const auto& child, unsigned char b) { return child.first < b; });
    if (it == children.end() || it->first != byte) break;
    node = static_cast<std::size_t>(it->second);
    if (nodes_[node].token >= 0) {
      best = nodes_[node].token;
      length = i + 1 - pos;
    }
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, PieceSink& sink,
                              std::span<const TextRange> plain_text) const {
  std::size_t start_offset = 0;  // end of what has been handed to the sink
  std::size_t search = 0;        // where matching resumes: the end of the last match, before any rstrip
  if (!empty()) {
    while (search < text.size()) {
      if (!first_byte_[static_cast<unsigned char>(text[search])]) {
        ++search;
        continue;
      }
      std::size_t length = 0;
      const std::int32_t index = longest_at(text, search, length);
      if (index < 0) {
        ++search;
        continue;
      }
      const AddedToken& token = tokens_[static_cast<std::size_t>(index)];
      if (token.special && overlaps_any(plain_text, search, search + length)) {
        ++search;
        continue;
      }
      std::size_t start = search;
      std::size_t stop = search + length;
      search = stop;
      if (token.single_word) {
        const bool word_before =
            start > 0 && unicode::is_word_character(last_character(text.substr(0, start)));
        const bool word_after =
            stop < text.size() && unicode::is_word_character(first_character(text.substr(stop)));
        if (word_before || word_after) continue;
      }
      if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
      if (token.rstrip) stop += leading_space_length(text.substr(stop));
      // HF slices exactly these offsets, even where an rstrip overlaps a following match.
      if (start_offset < start) sink.piece(text.substr(start_offset, start - start_offset), -1);
      sink.piece(text.substr(start, stop - start), token.id);
      start_offset = stop;
    }
  }
  if (start_offset != text.size() || text.empty()) {
    sink.piece(text.substr(std::min(start_offset, text.size())), -1);
  }
}

}  // namespace capserve::runtime
