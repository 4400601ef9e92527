#pragma once
// Multi-token-prediction drafting (DeepSeek-V3's MTP module as the draft, as vLLM and SGLang run it): each
// step the model's MTP layer first catches up on the positions the last step kept (its state at position t
// is the decoder's final hidden state there, its input the token at t + 1), whose last row gives the first
// draft; then it chains, each further draft from its own previous output state and the draft before. Drafts
// are the MTP logits' greedy tokens (one-hot proposals: verify.h keeps the target distribution). The MTP K/V
// shares each sequence's block table in its own cache layer (Engine::draft_step).
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "runtime/engine.h"
#include "runtime/speculative/drafter.h"

namespace capserve::runtime {

class MtpDrafter final : public Drafter {
 public:
  // `engine`'s model must have its MTP layers loaded (ParallelOptions::mtp); std::invalid_argument if not,
  // or unless k >= 1. The engine must outlive the drafter.
  MtpDrafter(Engine& engine, std::int64_t k);

  [[nodiscard]] std::int64_t max_drafts() const override { return k_; }
  // Runs k MTP forwards (collectives) whatever the slots: every rank calls it after every engine step.
  [[nodiscard]] bool collective() const override { return true; }
  // A slot gets drafts only when its sequence was in the engine's last step (the rows it kept are caught
  // up on); its drafts stop at a non-finite MTP row.
  void propose(std::span<const DraftSlot> slots, std::span<std::int64_t> counts) override;

 private:
  Engine& engine_;
  std::int64_t k_;
  // Reused every step: the last step's item of each sequence, the draft step's work and the slot each item
  // drafts for, the drawn tokens, each slot's output row in the last draft step.
  std::vector<std::pair<SequenceId, std::size_t>> step_item_;
  std::vector<Engine::DraftWork> work_;
  std::vector<std::size_t> owner_;
  std::vector<std::int32_t> drawn_;
  std::vector<std::int64_t> out_row_;
};

}  // namespace capserve::runtime
