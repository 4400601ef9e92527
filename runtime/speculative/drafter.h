#pragma once
// Speculative decoding's draft side: a drafter proposes, for each decoding sequence of a step, up to k tokens
// that the target model then verifies in one forward pass (runtime/speculative/verify.h, runtime/README.md
// "Speculative decoding").
#include <cstdint>
#include <span>

#include "runtime/kv_block_manager.h"

namespace capserve::runtime {

// One decoding sequence's request for drafts.
struct DraftSlot {
  SequenceId seq = 0;
  std::span<const std::int32_t> history;  // every token of the sequence so far: prompt, then generated ones
  std::span<std::int32_t> drafts;         // room for at most this many drafts (may be empty)
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // The most drafts a slot may ask for (k, the server's --num-speculative-tokens).
  [[nodiscard]] virtual std::int64_t max_drafts() const = 0;
  // True when propose is a collective under expert parallelism (it runs the model): then every rank calls
  // it once after every engine step, with no slots if it has none, and never skips it.
  [[nodiscard]] virtual bool collective() const { return false; }
  // Writes each slot's drafts to the front of slot.drafts and their number to counts[i] (0: no proposal).
  // One call per step for all of a rank's decoding sequences, made before the step that verifies them.
  virtual void propose(std::span<const DraftSlot> slots, std::span<std::int64_t> counts) = 0;
};

}  // namespace capserve::runtime
