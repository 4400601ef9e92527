#pragma once
// UTF-8 helpers with the exact rules of Rust's `str` (which Hugging Face tokenizers inherits):
// well-formedness as in the Unicode standard (no overlongs, surrogates or code points above U+10FFFF), and
// the lossy decoding of String::from_utf8_lossy (one U+FFFD per maximal ill-formed subpart).
#include <cstddef>
#include <string>
#include <string_view>

namespace capserve::runtime::utf8 {

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Length of the longest well-formed prefix of `bytes`; equals bytes.size() exactly when all of it is UTF-8.
std::size_t valid_prefix_length(std::string_view bytes);

inline bool is_valid(std::string_view bytes) {
  return valid_prefix_length(bytes) == bytes.size();
}

// Whether `c` continues a multi-byte sequence (so that no character starts at it).
inline bool is_continuation(char c) {
  return (static_cast<unsigned char>(c) & 0xC0) == 0x80;
}

// Byte length of the character that starts with `lead` in well-formed text.
inline std::size_t sequence_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// The code point starting at `pos` of well-formed `text`; advances `pos` past it.
char32_t decode(std::string_view text, std::size_t& pos);

void append(std::string& out, char32_t code_point);

// Appends `bytes` as String::from_utf8_lossy would decode them.
void append_lossy(std::string& out, std::string_view bytes);

// Number of trailing bytes (0 to 3) that start a well-formed sequence but do not finish it, so that more
// bytes could still complete it; lossy decoding must hold these back while a stream is open.
std::size_t incomplete_suffix_length(std::string_view bytes);

}  // namespace capserve::runtime::utf8
