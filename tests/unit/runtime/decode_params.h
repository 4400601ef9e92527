#pragma once
// The sampling parameters the speculative decoding tests decode with: n new tokens, greedy or at a
// temperature with top-p 0.95, a fixed seed.
#include <cstdint>

#include "runtime/sampler.h"

namespace capserve::testing {

inline runtime::SamplingParams decode_params(std::int64_t n, float temperature = 0.0F,
                                             std::uint64_t seed = 1234) {
  runtime::SamplingParams p;
  p.max_new_tokens = n;
  p.temperature = temperature;
  p.top_p = temperature > 0 ? 0.95F : 1.0F;
  p.seed = seed;
  return p;
}

}  // namespace capserve::testing
