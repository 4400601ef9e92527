#include "runtime/tokenizer/normalizer.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

#include <utf8proc.h>

#include "runtime/tokenizer/unicode_tables.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {
namespace {

// Code points below U+0300 are never changed by NFC and never compose with what precedes them, so text whose
// bytes are all below 0xCC (the lead byte of U+0300) is already NFC.
bool trivially_nfc(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0xCC; });
}

// utf8proc's NFC of `text` appended to `out`.
void append_nfc(std::string_view text, std::string& out, std::vector<std::int32_t>& scratch) {
  if (text.empty()) return;
  const auto options = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  const auto* input = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
  const auto length = static_cast<utf8proc_ssize_t>(text.size());
  // Decompose into a reused buffer (utf8proc_map would malloc), compose in place, re-encode in place: the
  // UTF-8 form never needs more bytes than 4 per code point, which is what the buffer holds, plus the NUL.
  utf8proc_ssize_t n = 0;
  for (;;) {
    n = utf8proc_decompose(input, length, reinterpret_cast<utf8proc_int32_t*>(scratch.data()),
                           static_cast<utf8proc_ssize_t>(scratch.size()), options);
    if (n < 0) throw std::logic_error(std::string("utf8proc: ") + utf8proc_errmsg(n));
    // One spare element: utf8proc_reencode appends a NUL after up to 4 bytes per code point.
    if (static_cast<std::size_t>(n) < scratch.size()) break;
    scratch.resize(static_cast<std::size_t>(n) + 1);
  }
  auto* buffer = reinterpret_cast<utf8proc_int32_t*>(scratch.data());
  n = utf8proc_normalize_utf32(buffer, n, options);
  if (n < 0) throw std::logic_error(std::string("utf8proc: ") + utf8proc_errmsg(n));
  n = utf8proc_reencode(buffer, n, options);
  if (n < 0) throw std::logic_error(std::string("utf8proc: ") + utf8proc_errmsg(n));
  out.append(reinterpret_cast<const char*>(buffer), static_cast<std::size_t>(n));
}

bool is_nfc_blocker(char32_t c) {
  return c >= unicode::kNfcBlockers[0] &&
         std::binary_search(std::begin(unicode::kNfcBlockers), std::end(unicode::kNfcBlockers), c);
}

// HF's NFC. Characters its older Unicode data does not know (kNfcBlockers) are starters that nothing reorders
// across or composes with, so the text between them is normalized piece by piece and they are kept as they
// are.
void nfc(std::string& text, NormalizerScratch& scratch) {
  if (trivially_nfc(text)) return;
  std::string& out = scratch.text;
  out.clear();
  std::size_t segment = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t start = pos;
    if (!is_nfc_blocker(utf8::decode(text, pos))) continue;
    append_nfc(std::string_view(text).substr(segment, start - segment), out, scratch.code_points);
    out.append(text, start, pos - start);
    segment = pos;
  }
  append_nfc(std::string_view(text).substr(segment), out, scratch.code_points);
  text.swap(out);
}

void replace_all(std::string& text, std::string_view pattern, std::string_view content, std::string& tmp) {
  if (pattern.empty() || text.find(pattern) == std::string::npos) return;
  tmp.clear();
  std::size_t pos = 0;
  for (std::size_t hit; (hit = text.find(pattern, pos)) != std::string::npos; pos = hit + pattern.size()) {
    tmp.append(text, pos, hit - pos);
    tmp.append(content);
  }
  tmp.append(text, pos);
  text.swap(tmp);
}

}  // namespace

Normalizer Normalizer::from_json(const std::optional<JsonAt>& spec) {
  Normalizer n;
  if (spec) n.add_steps(*spec);
  return n;
}

void Normalizer::add_steps(const JsonAt& spec) {
  const std::string type = spec.type();
  if (type == "Sequence") {
    const JsonAt list = spec.at("normalizers");
    list.require_array();
    for (std::size_t i = 0; i < list.json().size(); ++i) add_steps(list.at(i));
  } else if (type == "NFC") {
    steps_.push_back({Step::Kind::nfc, {}, {}});
  } else if (type == "Prepend") {
    steps_.push_back({Step::Kind::prepend, {}, spec.at("prepend").string()});
  } else if (type == "Replace") {
    const JsonAt pattern = spec.at("pattern");
    const auto literal = pattern.find("String");
    if (!literal) pattern.fail("only {\"String\": ...} patterns are supported in the Replace normalizer");
    if (literal->string().empty()) literal->fail("must not be empty");
    steps_.push_back({Step::Kind::replace, literal->string(), spec.at("content").string()});
  } else {
    spec.at("type").fail("unsupported normalizer type '" + type + "'");
  }
}

bool Normalizer::prepends() const {
  return std::any_of(steps_.begin(), steps_.end(),
                     [](const Step& s) { return s.kind == Step::Kind::prepend; });
}

void Normalizer::normalize(std::string_view text, std::string& out, NormalizerScratch& scratch) const {
  out.assign(text);
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::Kind::nfc:
        nfc(out, scratch);
        break;
      case Step::Kind::prepend:
        // HF prepends only to non-empty text.
        if (!out.empty()) out.insert(0, step.content);
        break;
      case Step::Kind::replace:
        replace_all(out, step.pattern, step.content, scratch.text);
        break;
    }
  }
}

}  // namespace capserve::runtime
