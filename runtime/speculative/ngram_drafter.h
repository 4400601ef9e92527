#pragma once
// Prompt-lookup (n-gram) drafting, for every architecture: the sequence's last n tokens are looked up earlier
// in its own history (prompt and generated tokens), longest n first, and the tokens that followed the most
// recent match are proposed. A match whose continuation runs into the present repeats the proposal itself, so
// a sequence looping with a period shorter than k still gets k drafts. No model, no device work.
#include <cstdint>
#include <span>

#include "runtime/speculative/drafter.h"

namespace capserve::runtime {

class NgramDrafter final : public Drafter {
 public:
  // std::invalid_argument unless 1 <= min_n <= max_n and k >= 1.
  NgramDrafter(std::int64_t k, std::int64_t min_n, std::int64_t max_n);

  [[nodiscard]] std::int64_t max_drafts() const override { return k_; }
  void propose(std::span<const DraftSlot> slots, std::span<std::int64_t> counts) override;

  // One history's proposal into `drafts` (at most drafts.size() tokens); returns how many.
  [[nodiscard]] std::int64_t propose_one(std::span<const std::int32_t> history,
                                         std::span<std::int32_t> drafts) const;

 private:
  std::int64_t k_;
  std::int64_t min_n_;
  std::int64_t max_n_;
};

}  // namespace capserve::runtime
