#pragma once
// Regular expressions for the Split pre-tokenizer: PCRE2 (UTF + UCP, JIT-compiled) made to match like the
// Oniguruma engine behind Hugging Face tokenizers. Two differences show on real patterns and are rewritten
// away:
//  - `\s`: PCRE2 counts U+180E MONGOLIAN VOWEL SEPARATOR as space, Oniguruma (and Unicode since 6.3) does
//  not;
//    `\s` and `\S` become the explicit White_Space set.
//  - general categories (`\p{L}`, `\p{N}`, `\P{P}`, ...): PCRE2 10.42 has Unicode 14 tables, HF's Oniguruma
//    Unicode 16; the characters assigned in between are added from unicode_tables.h.
// Escapes whose meaning differs between the engines (\h, \w, \b, ...) are refused at load time rather than
// matched differently. Script properties (\p{Han}, ...) keep PCRE2's Unicode 14 tables.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "runtime/status.h"

struct pcre2_real_code_8;
struct pcre2_real_match_data_8;
struct pcre2_real_match_context_8;
struct pcre2_real_jit_stack_8;

namespace capserve::runtime {

// Per-thread matching state, reused across calls so that matching allocates nothing.
class RegexScratch {
 public:
  RegexScratch();

 private:
  friend class Regex;
  struct Free {
    void operator()(pcre2_real_match_data_8* p) const;
    void operator()(pcre2_real_match_context_8* p) const;
    void operator()(pcre2_real_jit_stack_8* p) const;
  };
  std::unique_ptr<pcre2_real_match_data_8, Free> match_data_;
  std::unique_ptr<pcre2_real_jit_stack_8, Free> jit_stack_;
  std::unique_ptr<pcre2_real_match_context_8, Free> context_;
};

struct RegexMatch {
  std::size_t start = 0;
  std::size_t end = 0;
  bool found = false;
};

class Regex {
 public:
  // Compiles an HF (Oniguruma-syntax) pattern; `context` names it in the LoadError thrown for a pattern that
  // is invalid, uses an unsupported construct, or can match the empty string (whose splitting rules we do not
  // replicate).
  Regex(std::string_view pattern, const std::string& context);

  // The leftmost match in `text` (well-formed UTF-8) starting at or after byte `from`. Fails only when PCRE2
  // hits a resource limit on pathological input.
  Status find(std::string_view text, std::size_t from, RegexScratch& scratch, RegexMatch& match) const;

 private:
  struct Free {
    void operator()(pcre2_real_code_8* p) const;
  };
  std::unique_ptr<pcre2_real_code_8, Free> code_;
};

// Exposed for tests: the pattern PCRE2 is given for an Oniguruma pattern.
std::string onig_to_pcre2(std::string_view pattern, const std::string& context);

}  // namespace capserve::runtime
