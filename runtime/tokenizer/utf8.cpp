#include "runtime/tokenizer/utf8.h"

#include <cstdint>

namespace capserve::runtime::utf8 {
namespace {

// Bytes, starting at `pos`, that form a well-formed sequence or a well-formed beginning of one (at least 1,
// the lead byte itself, when that byte can start nothing). `complete` tells which. This is the per-character
// step of Rust's Utf8Chunks, whose "maximal subpart" rule String::from_utf8_lossy follows.
std::size_t scan_sequence(std::string_view bytes, std::size_t pos, bool& complete) {
  const auto at = [&](std::size_t i) -> unsigned {
    return i < bytes.size() ? static_cast<unsigned char>(bytes[i]) : 0U;
  };
  const unsigned lead = at(pos);
  complete = true;
  if (lead < 0x80) return 1;
  const auto continuation = [](unsigned b) { return b >= 0x80 && b <= 0xBF; };
  std::size_t width = 0;
  unsigned second_lo = 0x80;
  unsigned second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    width = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    width = 3;
    if (lead == 0xE0) second_lo = 0xA0;  // no overlongs
    if (lead == 0xED) second_hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    width = 4;
    if (lead == 0xF0) second_lo = 0x90;  // no overlongs
    if (lead == 0xF4) second_hi = 0x8F;  // nothing above U+10FFFF
  } else {
    complete = false;
    return 1;
  }
  const unsigned second = at(pos + 1);
  if (second < second_lo || second > second_hi) {
    complete = false;
    return 1;
  }
  for (std::size_t k = 2; k < width; ++k) {
    if (!continuation(at(pos + k))) {
      complete = false;
      return k;
    }
  }
  return width;
}

}  // namespace

std::size_t valid_prefix_length(std::string_view bytes) {
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    // Runs of ASCII are by far the common case; test eight bytes at a time.
    while (pos + 8 <= bytes.size()) {
      std::uint64_t word = 0;
      for (std::size_t k = 0; k < 8; ++k)
        word |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[pos + k])) << (8 * k);
      if ((word & 0x8080808080808080ULL) != 0) break;
      pos += 8;
    }
    if (pos >= bytes.size()) break;
    bool complete = false;
    const std::size_t n = scan_sequence(bytes, pos, complete);
    if (!complete) return pos;
    pos += n;
  }
  return bytes.size();
}

char32_t decode(std::string_view text, std::size_t& pos) {
  const auto b = [&](std::size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[i])); };
  const char32_t lead = b(pos);
  if (lead < 0x80) {
    pos += 1;
    return lead;
  }
  if (lead < 0xE0) {
    const char32_t cp = ((lead & 0x1F) << 6) | (b(pos + 1) & 0x3F);
    pos += 2;
    return cp;
  }
  if (lead < 0xF0) {
    const char32_t cp = ((lead & 0x0F) << 12) | ((b(pos + 1) & 0x3F) << 6) | (b(pos + 2) & 0x3F);
    pos += 3;
    return cp;
  }
  const char32_t cp =
      ((lead & 0x07) << 18) | ((b(pos + 1) & 0x3F) << 12) | ((b(pos + 2) & 0x3F) << 6) | (b(pos + 3) & 0x3F);
  pos += 4;
  return cp;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void append_lossy(std::string& out, std::string_view bytes) {
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    const std::size_t valid = valid_prefix_length(bytes.substr(pos));
    out.append(bytes.substr(pos, valid));
    pos += valid;
    if (pos == bytes.size()) break;
    bool complete = false;
    pos += scan_sequence(bytes, pos, complete);
    out.append(kReplacementCharacter);
  }
}

std::size_t incomplete_suffix_length(std::string_view bytes) {
  // A sequence is at most 4 bytes long, so an unfinished one starts within the last 3 bytes.
  const std::size_t first = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (std::size_t start = first; start < bytes.size(); ++start) {
    bool complete = false;
    const std::size_t n = scan_sequence(bytes, start, complete);
    const auto lead = static_cast<unsigned char>(bytes[start]);
    if (!complete && start + n == bytes.size() && lead >= 0xC2 && lead <= 0xF4) {
      return bytes.size() - start;
    }
  }
  return 0;
}

}  // namespace capserve::runtime::utf8
