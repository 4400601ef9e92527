#include "tools/loadgen/prompts.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <utility>

#include "runtime/tokenizer/utf8.h"

namespace capserve::loadgen {

PromptSource::PromptSource(PromptConfig config, const runtime::Tokenizer* tokenizer)
    : config_(std::move(config)), tokenizer_(tokenizer), rng_(config_.seed) {
  if (config_.domains.empty()) throw std::runtime_error("prompts: no corpus domain given");
  if (config_.burst_length < 1) throw std::runtime_error("prompts: burst length must be >= 1");
  if (!(config_.bytes_per_token > 0)) throw std::runtime_error("prompts: bytes per token must be > 0");
  for (const std::string& domain : config_.domains) {
    const std::filesystem::path path = config_.corpus_dir / (domain + ".txt");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("prompts: cannot open corpus file " + path.string());
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (raw.empty()) throw std::runtime_error("prompts: corpus file " + path.string() + " is empty");
    std::string text;
    text.reserve(raw.size());
    runtime::utf8::append_lossy(text, raw);
    texts_.push_back(std::move(text));
  }
}

std::size_t PromptSource::next_domain() {
  const std::size_t n = texts_.size();
  if (config_.mix == PromptMix::mixed) return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_);
  if (left_in_burst_ <= 0) {
    // A new run: any domain first, then one other than the last run's when there is one.
    if (current_ >= n || n == 1) {
      current_ = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_);
    } else {
      const std::size_t d = std::uniform_int_distribution<std::size_t>(0, n - 2)(rng_);
      current_ = d >= current_ ? d + 1 : d;
    }
    left_in_burst_ = config_.burst_length;
  }
  --left_in_burst_;
  return current_;
}

std::string PromptSource::slice(std::size_t domain, std::size_t bytes) {
  const std::string& text = texts_[domain];
  bytes = std::clamp<std::size_t>(bytes, 1, text.size());
  std::size_t begin = std::uniform_int_distribution<std::size_t>(0, text.size() - bytes)(rng_);
  std::size_t end = begin + bytes;
  while (begin < text.size() && runtime::utf8::is_continuation(text[begin])) ++begin;
  while (end < text.size() && runtime::utf8::is_continuation(text[end])) ++end;
  return text.substr(begin, end - begin);
}

Prompt PromptSource::next(std::int64_t tokens) {
  tokens = std::max<std::int64_t>(tokens, 1);
  Prompt p;
  const std::size_t d = next_domain();
  p.domain = config_.domains[d];
  if (tokenizer_ == nullptr) {
    p.text = slice(d, static_cast<std::size_t>(static_cast<double>(tokens) * config_.bytes_per_token));
    return p;
  }
  // Enough text for `tokens` tokens (a token is rarely more than 8 bytes), then cut to exactly that many.
  std::size_t bytes = static_cast<std::size_t>(tokens) * 8 + 64;
  for (;;) {
    const std::string text = slice(d, bytes);
    if (runtime::Status s = tokenizer_->encode(text, false, p.ids); !s.ok())
      throw std::runtime_error("prompts: cannot tokenize corpus text of " + p.domain + ": " + s.message());
    if (static_cast<std::int64_t>(p.ids.size()) >= tokens || bytes >= texts_[d].size()) break;
    bytes *= 2;
  }
  if (static_cast<std::int64_t>(p.ids.size()) > tokens) p.ids.resize(static_cast<std::size_t>(tokens));
  p.text = tokenizer_->decode(p.ids, false);
  return p;
}

}  // namespace capserve::loadgen
