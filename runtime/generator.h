#pragma once
// Offline batched generation on one engine: all prompts prefilled in one ragged step, then one decode step
// per token for every unfinished sequence — or, with a drafter, one verifying step per sequence for its last
// token and its drafts (runtime/speculative/verify.h), which keeps the same tokens for the same seeds. Used
// by capserve-generate, the parity tests and the benchmarks; prompt i runs as sequence id i, so the engine
// must hold no other sequences.
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/speculative/drafter.h"
#include "runtime/speculative/speculation_stats.h"
#include "runtime/status.h"

namespace capserve::runtime {

struct Generation {
  std::vector<std::int32_t> tokens;  // new tokens, ending with the stop token when one was sampled
  std::vector<float> logits;         // [tokens.size(), vocab] when recorded
};

// params: one per prompt. On error no sequence is left in the engine. A collective under expert parallelism:
// every rank calls it with its own prompts (possibly none). `drafter` (optional) turns speculation on;
// `stats` (optional) then adds what it achieved.
Status generate(Engine& engine, std::span<const std::vector<std::int32_t>> prompts,
                std::span<const SamplingParams> params, bool record_logits, std::vector<Generation>& out,
                Drafter* drafter = nullptr, SpeculationStats* stats = nullptr);

}  // namespace capserve::runtime
