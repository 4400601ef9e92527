#pragma once
// Offline batched generation on one engine: all prompts prefilled in one ragged step, then one decode step
// per token for every unfinished sequence. Used by capserve-generate, the parity tests and the benchmarks;
// prompt i runs as sequence id i, so the engine must hold no other sequences.
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/status.h"

namespace capserve::runtime {

struct Generation {
  std::vector<std::int32_t> tokens;  // new tokens, ending with the stop token when one was sampled
  std::vector<float> logits;         // [tokens.size(), vocab] when recorded
};

// params: one per prompt. On error no sequence is left in the engine. A collective under expert parallelism:
// every rank calls it with its own prompts (possibly none).
Status generate(Engine& engine, std::span<const std::vector<std::int32_t>> prompts,
                std::span<const SamplingParams> params, bool record_logits, std::vector<Generation>& out);

}  // namespace capserve::runtime
