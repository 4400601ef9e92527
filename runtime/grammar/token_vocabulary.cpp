#include "runtime/grammar/token_vocabulary.h"

#include <algorithm>
#include <utility>

#include "runtime/tokenizer/byte_level.h"

namespace capserve::runtime::grammar {
namespace {

// "<0xHH>" -> the byte.
std::optional<std::uint8_t> byte_fallback(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return std::nullopt;
  unsigned value = 0;
  for (const char c : token.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9')
      value += static_cast<unsigned>(c - '0');
    else if (c >= 'A' && c <= 'F')
      value += static_cast<unsigned>(c - 'A' + 10);
    else if (c >= 'a' && c <= 'f')
      value += static_cast<unsigned>(c - 'a' + 10);
    else
      return std::nullopt;
  }
  return static_cast<std::uint8_t>(value);
}

std::string metaspace_bytes(std::string_view token) {
  static constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581
  std::string out;
  for (std::size_t i = 0; i < token.size();) {
    if (token.substr(i).starts_with(kMetaspace)) {
      out += ' ';
      i += kMetaspace.size();
    } else {
      out += token[i++];
    }
  }
  return out;
}

}  // namespace

TokenVocabulary TokenVocabulary::from_tokenizer(const Tokenizer& tokenizer,
                                                std::vector<std::int32_t> stop_tokens) {
  const bool sentencepiece = tokenizer.token_to_id("<0x0A>").has_value();
  std::vector<std::optional<std::string>> bytes(static_cast<std::size_t>(tokenizer.vocab_size()));
  for (std::int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const auto token = tokenizer.id_to_token(id);
    if (!token || tokenizer.is_special(id)) continue;
    auto& out = bytes[static_cast<std::size_t>(id)];
    if (sentencepiece) {
      const auto single = byte_fallback(*token);
      out = single ? std::string(1, static_cast<char>(*single)) : metaspace_bytes(*token);
    } else {
      // Added (non-special) tokens outside the byte alphabet are spelled as their text.
      out = byte_level::to_bytes(*token).value_or(std::string(*token));
    }
  }
  return {std::move(bytes), std::move(stop_tokens)};
}

TokenVocabulary::TokenVocabulary(std::vector<std::optional<std::string>> token_bytes,
                                 std::vector<std::int32_t> stop_tokens)
    : bytes_(std::move(token_bytes)), stop_tokens_(std::move(stop_tokens)) {
  std::vector<std::int32_t> order;
  for (std::int32_t id = 0; id < size(); ++id) {
    if (bytes_[static_cast<std::size_t>(id)] && !bytes_[static_cast<std::size_t>(id)]->empty() &&
        !is_stop(id)) {
      order.push_back(id);
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return *bytes_[static_cast<std::size_t>(a)] < *bytes_[static_cast<std::size_t>(b)];
  });
  trie_.push_back({0, 0, 0, 0});
  std::vector<std::int32_t> path{0};  // path[d]: the node at depth d of the current token
  std::string_view previous;
  const auto close_to = [&](std::size_t depth) {
    while (path.size() > depth + 1) {
      trie_[static_cast<std::size_t>(path.back())].subtree_end = static_cast<std::int32_t>(trie_.size());
      path.pop_back();
    }
  };
  for (const std::int32_t id : order) {
    const std::string_view text = *bytes_[static_cast<std::size_t>(id)];
    const auto common = static_cast<std::size_t>(
        std::mismatch(text.begin(), text.end(), previous.begin(), previous.end()).first - text.begin());
    close_to(common);
    for (std::size_t d = common; d < text.size(); ++d) {
      path.push_back(static_cast<std::int32_t>(trie_.size()));
      trie_.push_back({static_cast<std::int32_t>(d + 1), static_cast<std::uint8_t>(text[d]), 0,
                       static_cast<std::int32_t>(trie_tokens_.size())});
    }
    trie_tokens_.push_back(id);
    previous = text;
  }
  close_to(0);
  trie_[0].subtree_end = static_cast<std::int32_t>(trie_.size());
}

bool TokenVocabulary::is_stop(std::int32_t id) const {
  return std::find(stop_tokens_.begin(), stop_tokens_.end(), id) != stop_tokens_.end();
}

std::int32_t TokenVocabulary::tokens_begin(std::int32_t node) const {
  return node < static_cast<std::int32_t>(trie_.size()) ? trie_[static_cast<std::size_t>(node)].tokens_begin
                                                        : static_cast<std::int32_t>(trie_tokens_.size());
}

}  // namespace capserve::runtime::grammar
