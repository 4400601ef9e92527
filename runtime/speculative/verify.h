#pragma once
// Speculative decoding's verification rule. The target model runs the sequence's last token and its k drafts
// in one forward; row j's logits are the distribution after the token fed at row j, and the runtime draws
// token j from row j exactly as a plain decode step would draw it (the same controls, draw number = the
// sequence's generated count + j; runtime/sampler.h). Draws are kept in order while each equals the draft fed
// at the next row; the first that differs is kept too and ends the step.
//
// Why this keeps the distribution: every kept token is a draw from the target model's own distribution given
// the tokens actually kept before it, with the draw number it would have had without speculation. So for a
// given seed the output is the same tokens as decoding without speculation (greedy included), whatever the
// drafts. For a drafter that proposes one token deterministically (n-gram, a greedy draft model) the chance
// that draft d is kept is p(d) and a rejection's token is distributed as p without d: exactly rejection
// sampling's acceptance, min(1, p(d) / q(d)) with q one-hot, and its residual distribution.
#include <cstdint>
#include <span>

namespace capserve::runtime {

// How many of `drawn` (one draw per verified row, drafts.size() + 1 rows) the step keeps: the first j with
// drawn[j] != drafts[j], plus one (all rows when every draft matched).
[[nodiscard]] constexpr std::size_t kept_draws(std::span<const std::int32_t> drafts,
                                               std::span<const std::int32_t> drawn) {
  std::size_t j = 0;
  while (j < drafts.size() && drawn[j] == drafts[j]) ++j;
  return j + 1;
}

}  // namespace capserve::runtime
