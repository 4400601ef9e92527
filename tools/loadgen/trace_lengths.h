#pragma once
// Trace request sizes made to fit a small model: scaled by one stated factor (prompt, output and the trace's
// block size alike, so that a shared prefix still covers the same blocks), then capped to the limits of the
// run and the served context, counting every cut so that the report says how many requests were capped and by
// how much.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/loadgen/arrivals.h"

namespace capserve::loadgen {

// A trace's block size (tokens per hash id) after scaling: round(block_tokens * factor), at least 1.
std::int64_t scaled_block_tokens(std::int64_t block_tokens, double factor);

// Multiplies every record's context and generated tokens by `factor` (rounded to the nearest token). A record
// with hash ids keeps no more tokens than its blocks hold at `scaled_block` tokens each (rounding alone can
// otherwise add a few). Throws std::invalid_argument on a non-positive factor.
void scale_lengths(std::vector<TraceRecord>& rows, double factor, std::int64_t scaled_block);

struct LengthLimits {
  std::int64_t max_prompt_tokens = 0;  // --max-prompt-tokens
  std::int64_t max_output_tokens = 0;  // --max-tokens
  std::int64_t context = 0;            // prompt + output, the served model's; 0: none
};

struct Lengths {
  std::int64_t prompt = 0;
  std::int64_t output = 0;
};

// Tokens cut from one kind of length over a run.
struct Cuts {
  std::int64_t requests = 0;    // seen
  std::int64_t capped = 0;      // of them, cut
  std::int64_t tokens_cut = 0;  // in all
  std::int64_t max_cut = 0;     // from one request

  void add(std::int64_t asked, std::int64_t granted);
};

// The sizes each request is sent with, and the record of what that cost. The output is capped first (to
// --max-tokens, and below the context), then the prompt to --max-prompt-tokens and to the context less the
// output, so that the whole output the trace asks for fits; both are at least 1.
class LengthCaps {
 public:
  explicit LengthCaps(LengthLimits limits) : limits_(limits) {}

  Lengths fit(std::int64_t prompt, std::int64_t output);

  [[nodiscard]] const Cuts& prompts() const { return prompts_; }
  [[nodiscard]] const Cuts& outputs() const { return outputs_; }
  // One line: "capped 84 of 400 prompts (...), 0 of 400 outputs (...)".
  [[nodiscard]] std::string summary() const;
  [[nodiscard]] nlohmann::json to_json() const;

 private:
  LengthLimits limits_;
  Cuts prompts_;
  Cuts outputs_;
};

}  // namespace capserve::loadgen
