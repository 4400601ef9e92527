#pragma once
// GPT-2's byte-level alphabet: every byte is spelled as one printable Unicode character (printable ASCII and
// most of Latin-1 stand for themselves, the other bytes map to U+0100 and up), so byte-level BPE vocabularies
// are text. Used by the ByteLevel pre-tokenizer and decoder.
#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace capserve::runtime::byte_level {

// The UTF-8 text of the character standing for each byte.
const std::array<std::string, 256>& byte_chars();

// The raw bytes a token spells, or nullopt when one of its characters is outside the alphabet (the token is
// then not byte-level, e.g. an added "<|im_start|>" with non-alphabet characters or a literal space).
std::optional<std::string> to_bytes(std::string_view token);

}  // namespace capserve::runtime::byte_level
