#pragma once
// A rank's StepResult read as one typed SequenceOutput per sequence: the result carries every sequence's kept
// tokens, log-probability records and alternatives back to back, in the order of its sequences.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "server/step_plan.h"

namespace capserve::server {

// One sequence's outcome of a step, typed: what the scheduler hands over after reading the ranks' results.
struct SequenceOutput {
  std::uint64_t id = 0;
  std::span<const std::int32_t> tokens;    // kept, in order (none for a prefill chunk that is not the last)
  std::span<const LogprobRecord> records;  // this sequence's scored tokens: prompt ones, then kept ones
  std::span<const TopLogprob> top;         // their alternatives, in the same order
  const SequenceResult* result = nullptr;  // MoE counts, drafts, failure
  bool prefill = false;                    // the step computed a chunk of its prompt (the scheduler's to set)
};

// Walks a result's sequences in order. A rank's result comes over the wire: counts that overrun what it holds
// are cut to what is there, so a malformed result never reads past its vectors.
class SequenceOutputReader {
 public:
  explicit SequenceOutputReader(const StepResult& result) : result_(result) {}
  // The next sequence's output; nullopt after the last.
  std::optional<SequenceOutput> next();

 private:
  const StepResult& result_;
  std::size_t sequence_ = 0, token_ = 0, record_ = 0, top_ = 0;
};

}  // namespace capserve::server
