#include "runtime/tokenizer/byte_level.h"

#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime::byte_level {
namespace {

struct Alphabet {
  std::array<std::string, 256> chars;
  std::array<int, 512> byte_of{};  // indexed by code point; all alphabet characters are below U+0200
};

Alphabet build() {
  Alphabet a;
  a.byte_of.fill(-1);
  const auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  };
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = printable(b) ? static_cast<char32_t>(b) : next++;
    utf8::append(a.chars[static_cast<std::size_t>(b)], c);
    a.byte_of[c] = b;
  }
  return a;
}

const Alphabet& alphabet() {
  static const Alphabet a = build();
  return a;
}

}  // namespace

const std::array<std::string, 256>& byte_chars() {
  return alphabet().chars;
}

std::optional<std::string> to_bytes(std::string_view token) {
  const Alphabet& a = alphabet();
  std::string bytes;
  for (std::size_t pos = 0; pos < token.size();) {
    const char32_t c = utf8::decode(token, pos);
    if (c >= a.byte_of.size() || a.byte_of[c] < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(a.byte_of[c]));
  }
  return bytes;
}

}  // namespace capserve::runtime::byte_level
