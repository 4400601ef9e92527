#pragma once
// What one engine step computes on each rank, read from the step plans alone: tokens through the dense
// layers, decodes, and attention work (query-key pairs: each new token attends to every earlier token of its
// sequence and itself). The step trace (--step-trace) records it beside the step's time, and the trace-driven
// planner (tools/planner) prices its simulated steps with the same shape, so that a cost model fitted on the
// one applies to the other.
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "server/step_plan.h"

namespace capserve::server {

struct RankWork {
  std::int64_t tokens = 0;           // prefill chunk tokens and decode tokens (drafts included)
  std::int64_t decodes = 0;          // sequences decoding
  std::int64_t attention_pairs = 0;  // query-key pairs over the step's tokens, per attention layer
  std::int64_t decode_pairs = 0;     // of those, the decodes' (each reads its whole cache: memory-bound)
};

class StepShape {
 public:
  explicit StepShape(int ranks) : work_(static_cast<std::size_t>(ranks)) {}

  // Follows one plan (every plan, in order: frees, starts, chunks, decodes) and returns each rank's work in
  // it. A decode counts its token and the most drafts the plan lets it verify (each verified draft is a token
  // of the step); the sequences' lengths grow by the decode's token only (rejected drafts leave the cache).
  std::span<const RankWork> apply(const StepPlan& plan);

 private:
  struct Sequence {
    std::int32_t rank = 0;
    std::int64_t length = 0;  // tokens in its cache
  };
  std::vector<RankWork> work_;
  std::unordered_map<std::uint64_t, Sequence> sequences_;
};

}  // namespace capserve::server
