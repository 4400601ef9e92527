#pragma once
// What rank 0 tells every rank to do in one engine step, and what each rank answers; both travel over the MPI
// control plane as compact byte strings (little-endian PODs, length-prefixed vectors).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "server/logprob_entries.h"

namespace capserve::server {

// A sequence joining the batch on `rank`. Its first `cached` prompt tokens come from the rank's prefix cache
// (whole blocks); the rest is prefilled in the plan's chunks, this step's first.
struct SequenceStart {
  std::uint64_t id = 0;
  std::int32_t rank = 0;
  std::vector<std::int32_t> prompt;
  std::int64_t cached = 0;
  runtime::SamplingParams params;  // travels whole (serialize below)
};

// The next `tokens` prompt tokens of a sequence being prefilled; the chunk that ends the prompt samples the
// sequence's first token.
struct PrefillChunk {
  std::uint64_t id = 0;
  std::int64_t tokens = 0;
};

struct StepPlan {
  bool shutdown = false;              // every rank leaves its loop after this plan (nothing else in it runs)
  std::vector<std::uint64_t> frees;   // sequences to release first (finished, cancelled, failed)
  std::vector<SequenceStart> starts;  // new sequences
  // Prefill chunks in the ranks' work order: those of sequences already prefilling, then the new ones'.
  std::vector<PrefillChunk> prefills;
  std::vector<std::uint64_t> decodes;  // running sequences that take one more token (each on its own rank)
  // Speculative decoding: [i] is the most draft tokens decodes[i] may verify after its token this step (rank
  // 0 bounds it by the request's max_tokens and the context, so the KV blocks reserved at admission always
  // suffice); empty when speculation is off.
  std::vector<std::int32_t> max_drafts;

  // Whether the step runs a forward pass (anything to prefill or decode).
  [[nodiscard]] bool has_work() const { return !prefills.empty() || !decodes.empty(); }
};

// Why a sequence could not take a token (rank 0 ends its request with an error; the others go on).
// no_allowed_token: the request's controls (allowed tokens, min_tokens, logit_bias) ruled out every token.
// no_allowed_token: the request's sampling controls rule out every token; constraint: its rank could not
// apply the output constraint (compile it, or follow a drawn token: see that rank's log).
enum class SequenceFailure : std::int32_t { none, non_finite_logits, no_allowed_token, constraint };

// One sequence's outcome of the step on its rank.
struct SequenceResult {
  std::uint64_t id = 0;
  // The tokens it kept, in order: the next `tokens` entries of StepResult::tokens (one for a prefill or a
  // plain decode; up to 1 + drafted when verifying drafts).
  std::int32_t tokens = 0;
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
  SequenceFailure failure = SequenceFailure::none;  // no token could be drawn after the kept ones
  std::int32_t drafted = 0;                         // drafts verified this step
  std::int32_t accepted = 0;                        // of those, the ones kept (a prefix)
};

struct StepResult {
  bool ok = true;
  std::string error;  // when !ok: why this rank's step was refused (its sequences all failed)
  std::vector<SequenceResult> sequences;
  std::vector<std::int32_t> tokens;  // every sequence's kept tokens, in the order of `sequences`
  // The log-probabilities of the sequences that ask, in the order of `sequences` (a sequence's prompt
  // entries, then one per kept token), and their alternatives in the same order.
  std::vector<LogprobRecord> logprobs;
  std::vector<TopLogprob> top_logprobs;
};

std::vector<std::byte> serialize(const StepPlan& plan);
// Throws std::runtime_error on a malformed byte string (a bug or a version mismatch between ranks).
StepPlan deserialize_plan(const std::vector<std::byte>& bytes);
std::vector<std::byte> serialize(const StepResult& result);
StepResult deserialize_result(const std::vector<std::byte>& bytes);

}  // namespace capserve::server
