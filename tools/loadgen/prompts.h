#pragma once
// Prompt text for the load generator: random slices of the real domain corpus
// (../shared/data/corpus/<domain>.txt), sized in tokens, either in semantic bursts (runs of one domain, as
// when one tenant or one application sends many similar requests) or mixed (an independent random domain per
// request). Bursts are what makes the experts' load skewed from step to step, which batch selection exploits.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace capserve::loadgen {

enum class PromptMix { bursts, mixed };

// The corpus's domains (../shared/data/corpus/<domain>.txt).
inline const std::vector<std::string> kCorpusDomains{"arxiv", "books", "code", "web", "wikipedia"};

struct PromptConfig {
  std::filesystem::path corpus_dir;
  std::vector<std::string> domains;  // file stems under corpus_dir
  PromptMix mix = PromptMix::bursts;
  std::int64_t burst_length = 16;  // requests per run of one domain
  std::uint64_t seed = 1;
  double bytes_per_token = 4;  // sizing without a tokenizer
};

struct Prompt {
  std::string domain;
  std::string text;               // valid UTF-8
  std::vector<std::int32_t> ids;  // exactly the requested tokens; only with a tokenizer
};

class PromptSource {
 public:
  // Loads every domain's text (invalid UTF-8 replaced). With a tokenizer, prompts have exactly the requested
  // number of tokens of that tokenizer (ids and their decoded text); without, about tokens * bytes_per_token
  // bytes. Throws std::runtime_error naming a missing or empty corpus file.
  PromptSource(PromptConfig config, const runtime::Tokenizer* tokenizer);

  // The next prompt of `tokens` tokens (>= 1), from the domain the mix picks next.
  Prompt next(std::int64_t tokens);

 private:
  std::size_t next_domain();
  // A random slice of about `bytes` bytes of one domain's text, on character boundaries.
  std::string slice(std::size_t domain, std::size_t bytes);

  PromptConfig config_;
  const runtime::Tokenizer* tokenizer_;
  std::vector<std::string> texts_;
  std::mt19937_64 rng_;
  std::size_t current_ = std::numeric_limits<std::size_t>::max();  // the current run's domain; none yet
  std::int64_t left_in_burst_ = 0;
};

}  // namespace capserve::loadgen
