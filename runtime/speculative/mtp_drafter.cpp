#include "runtime/speculative/mtp_drafter.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/sampling.h"

namespace capserve::runtime {

MtpDrafter::MtpDrafter(Engine& engine, std::int64_t k) : engine_(engine), k_(k) {
  if (k < 1) throw std::invalid_argument("MtpDrafter: k must be at least 1, not " + std::to_string(k));
  if (engine.model().mtp_layers() == 0) {
    throw std::invalid_argument(
        "MTP speculation needs the model's multi-token-prediction layers loaded (ParallelOptions::mtp)");
  }
}

void MtpDrafter::propose(std::span<const DraftSlot> slots, std::span<std::int64_t> counts) {
  std::fill(counts.begin(), counts.end(), 0);
  out_row_.assign(slots.size(), -1);
  // Sorted by sequence (a reused vector: no allocation per step, as a hash map's nodes would be).
  step_item_.clear();
  const std::span<const SequenceId> seqs = engine_.last_step_seqs();
  const std::span<const kernels::SequenceSlice> slices = engine_.last_step_slices();
  for (std::size_t i = 0; i < seqs.size(); ++i) step_item_.emplace_back(seqs[i], i);
  std::sort(step_item_.begin(), step_item_.end());

  // Catch-up: each slot's rows of the last step whose next token is now known (the kept ones), one item.
  work_.clear();
  owner_.clear();
  for (std::size_t s = 0; s < slots.size(); ++s) {
    const DraftSlot& slot = slots[s];
    const auto it =
        std::lower_bound(step_item_.begin(), step_item_.end(), std::pair(slot.seq, std::size_t{0}));
    if (it == step_item_.end() || it->first != slot.seq) continue;
    const kernels::SequenceSlice& rows = slices[it->second];
    const auto known = static_cast<std::int64_t>(slot.history.size());
    const std::int64_t last = std::min(known - 2, rows.start_pos + rows.num_tokens - 1);
    if (last < rows.start_pos) continue;
    work_.push_back({slot.seq, rows.start_pos,
                     slot.history.subspan(static_cast<std::size_t>(rows.start_pos + 1),
                                          static_cast<std::size_t>(last - rows.start_pos + 1)),
                     rows.first_row});
    owner_.push_back(s);
  }
  Engine::DraftInput input = Engine::DraftInput::step_hidden;
  // Step c draws draft c; every rank runs all k steps, with whatever items it has left.
  for (std::int64_t c = 0; c < k_; ++c) {
    if (c > 0) {
      work_.clear();
      owner_.clear();
      for (std::size_t s = 0; s < slots.size(); ++s) {
        if (counts[s] != c || static_cast<std::int64_t>(slots[s].drafts.size()) <= c) continue;
        // Draft c - 1 sits at position history + c - 1; its row is one before, as every MTP row is.
        const auto position = static_cast<std::int64_t>(slots[s].history.size()) + c - 2;
        work_.push_back({slots[s].seq, position, slots[s].drafts.subspan(static_cast<std::size_t>(c - 1), 1),
                         out_row_[s]});
        owner_.push_back(s);
      }
    }
    const Status status = engine_.draft_step(0, input, work_);
    input = Engine::DraftInput::draft_hidden;
    // A refused step drafts nothing, so none goes further (the later steps still join the collectives).
    if (!status.ok() || work_.empty()) continue;
    drawn_.resize(work_.size());
    engine_.draft_argmax(drawn_);
    for (std::size_t w = 0; w < work_.size(); ++w) {
      const std::size_t s = owner_[w];
      out_row_[s] = static_cast<std::int64_t>(w);
      if (static_cast<std::int64_t>(slots[s].drafts.size()) <= c || kernels::is_non_finite_token(drawn_[w]))
        continue;
      slots[s].drafts[static_cast<std::size_t>(c)] = drawn_[w];
      counts[s] = c + 1;
    }
  }
  engine_.end_drafts();
}

}  // namespace capserve::runtime
