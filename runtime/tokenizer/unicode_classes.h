#pragma once
// The character classes of Rust's `regex` crate that HF's AddedVocabulary uses for single_word, lstrip and
// rstrip: \s (Unicode White_Space) and \w (Alphabetic, marks, decimal digits, connector punctuation,
// join controls).
namespace capserve::runtime::unicode {

bool is_white_space(char32_t c);
bool is_word_character(char32_t c);

}  // namespace capserve::runtime::unicode
