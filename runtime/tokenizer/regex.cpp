#include "runtime/tokenizer/regex.h"

#include <algorithm>
#include <optional>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "runtime/load_error.h"
#include "runtime/tokenizer/unicode_tables.h"

namespace capserve::runtime {
namespace {

// Unicode White_Space, which is what Oniguruma's \s matches.
constexpr std::string_view kWhiteSpace =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{"
    "3000}";

[[noreturn]] void refuse(const std::string& context, std::string_view what) {
  throw LoadError(context + ": " + std::string(what));
}

// The Unicode 16 additions to general category `name` ("L", "Lu", "LC", ...); nullopt when `name` is not a
// general category (scripts and other properties are left to PCRE2's own tables).
std::optional<std::string> category_additions(std::string_view name, const std::string& context) {
  static constexpr std::string_view kCategories =
      "L Lu Ll Lt Lm Lo LC L& M Mn Mc Me N Nd Nl No P Pc Pd Ps Pe Pi Pf Po "
      "S Sm Sc Sk So Z Zs Zl Zp C Cc Cf Cs Co Cn";
  bool known = false;
  for (std::size_t pos = 0; pos < kCategories.size();) {
    const std::size_t end = std::min(kCategories.find(' ', pos), kCategories.size());
    known = known || kCategories.substr(pos, end - pos) == name;
    pos = end + 1;
  }
  if (!known) return std::nullopt;
  // Characters new since Unicode 14 are Cn to PCRE2, so "other" and "unassigned" cannot be fixed by adding.
  if (name == "C" || name == "Cn")
    refuse(context, std::string("\\p{").append(name).append("} is not supported"));
  std::string ranges;
  for (const auto& [category, text] : unicode::kUnicode16Additions) {
    const bool cased_letter =
        (name == "LC" || name == "L&") && (category == "Lu" || category == "Ll" || category == "Lt");
    if (category == name || (name.size() == 1 && category[0] == name[0]) || cased_letter) ranges += text;
  }
  return ranges;
}

// Rewrites the property escape starting at pattern[i] ('p' or 'P' after the backslash), advancing i past it.
void rewrite_property(std::string_view pattern, std::size_t& i, bool in_class, std::string& out,
                      const std::string& context) {
  bool negated = pattern[i] == 'P';
  const std::size_t start = i - 1;  // the backslash
  std::string_view name;
  if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
    const std::size_t close = pattern.find('}', i + 2);
    if (close == std::string_view::npos) refuse(context, "unterminated \\p{...}");
    name = pattern.substr(i + 2, close - i - 2);
    i = close;
  } else if (i + 1 < pattern.size()) {
    name = pattern.substr(i + 1, 1);
    i += 1;
  }
  const std::string_view original = pattern.substr(start, i + 1 - start);
  if (name.starts_with('^')) {
    negated = !negated;
    name.remove_prefix(1);
  }
  const std::optional<std::string> additions = category_additions(name, context);
  if (!additions || additions->empty()) {
    out += original;
    return;
  }
  // Built with append: GCC 12 warns falsely (-Wrestrict) on `"literal" + std::string(...)` in sanitizer
  // builds.
  const std::string positive = std::string("\\p{").append(name).append("}").append(*additions);
  if (in_class) {
    if (negated) refuse(context, "a negated property inside a character class is not supported");
    out += positive;
  } else {
    out.append(negated ? "[^" : "[").append(positive).append("]");
  }
}

}  // namespace

std::string onig_to_pcre2(std::string_view pattern, const std::string& context) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  std::size_t class_body_start = 0;  // a ']' right at the start of a class body is a literal
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      switch (e) {
        case 's':
          out.append(in_class ? "" : "[").append(kWhiteSpace).append(in_class ? "" : "]");
          continue;
        case 'S':
          if (in_class) refuse(context, "\\S inside a character class is not supported");
          out.append("[^").append(kWhiteSpace).append("]");
          continue;
        case 'p':
        case 'P':
          rewrite_property(pattern, i, in_class, out, context);
          continue;
        case 'h':
        case 'H':
        case 'w':
        case 'W':
        case 'b':
        case 'B':
        case 'Q':
          refuse(context, std::string("the escape \\") + e +
                              " means different things in Oniguruma and PCRE2; not supported");
        default:
          out += c;
          out += e;
          continue;
      }
    }
    if (in_class) {
      if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        const std::size_t close = pattern.find(":]", i + 2);
        if (close == std::string_view::npos) refuse(context, "unterminated POSIX class");
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
      if (c == '[') refuse(context, "nested character classes are not supported");
      if (c == ']' && i != class_body_start) in_class = false;
    } else if (c == '[') {
      in_class = true;
      class_body_start = i + 1;
      if (class_body_start < pattern.size() && pattern[class_body_start] == '^') ++class_body_start;
    }
    out += c;
  }
  return out;
}

void RegexScratch::Free::operator()(pcre2_real_match_data_8* p) const {
  pcre2_match_data_free(p);
}
void RegexScratch::Free::operator()(pcre2_real_match_context_8* p) const {
  pcre2_match_context_free(p);
}
void RegexScratch::Free::operator()(pcre2_real_jit_stack_8* p) const {
  pcre2_jit_stack_free(p);
}
void Regex::Free::operator()(pcre2_real_code_8* p) const {
  pcre2_code_free(p);
}

RegexScratch::RegexScratch()
    : match_data_(pcre2_match_data_create(1, nullptr)),
      jit_stack_(pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr)),
      context_(pcre2_match_context_create(nullptr)) {
  if (!match_data_ || !jit_stack_ || !context_) throw std::bad_alloc();
  pcre2_jit_stack_assign(context_.get(), nullptr, jit_stack_.get());
}

Regex::Regex(std::string_view pattern, const std::string& context) {
  const std::string translated = onig_to_pcre2(pattern, context);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                            PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr));
  if (!code_) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    refuse(context, "invalid regex at offset " + std::to_string(error_offset) + ": " +
                        reinterpret_cast<const char*>(message));
  }
  std::uint32_t min_length = 0;
  pcre2_pattern_info(code_.get(), PCRE2_INFO_MINLENGTH, &min_length);
  if (min_length == 0) refuse(context, "a regex that can match the empty string is not supported");
  // Without JIT support PCRE2 interprets the pattern: slower, same matches.
  pcre2_jit_compile(code_.get(), PCRE2_JIT_COMPLETE);
}

Status Regex::find(std::string_view text, std::size_t from, RegexScratch& scratch, RegexMatch& match) const {
  const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                             PCRE2_NO_UTF_CHECK, scratch.match_data_.get(), scratch.context_.get());
  if (rc == PCRE2_ERROR_NOMATCH) {
    match.found = false;
    return {};
  }
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    return Status::resource_exhausted(std::string("pre-tokenizer regex gave up on this input: ") +
                                      reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.match_data_.get());
  match = {ovector[0], ovector[1], true};
  return {};
}

}  // namespace capserve::runtime
