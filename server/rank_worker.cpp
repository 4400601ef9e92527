#include "server/rank_worker.h"

#include <algorithm>

#include "runtime/speculative/verify.h"

namespace capserve::server {

StepResult RankWorker::run(const StepPlan& plan) {
  for (const std::uint64_t id : plan.frees) {
    if (sequences_.erase(id) > 0) engine_.release(id);
  }
  work_.clear();
  work_ids_.clear();
  for (const SequenceStart& s : plan.starts) {
    if (s.rank != rank_) continue;
    runtime::SamplingParams params;
    params.temperature = s.temperature;
    params.top_k = s.top_k;
    params.top_p = s.top_p;
    params.seed = s.seed;
    params.logprobs = s.logprobs != 0;
    params.prompt_logprobs = s.prompt_logprobs != 0;
    params.top_logprobs = s.top_logprobs;
    Sequence seq{params, 0, 0, {}};
    if (drafter_ != nullptr) {
      // Room for as many generated tokens as the prompt has before the history grows (amortized).
      seq.history.reserve(2 * s.prompt.size());
      seq.history.assign(s.prompt.begin(), s.prompt.end());
    }
    sequences_.insert_or_assign(s.id, std::move(seq));
    // Prompt log-probabilities are scored on the logits of every prompt position.
    work_.push_back({s.id, s.prompt, params.prompt_logprobs});
    work_ids_.push_back(s.id);
  }
  prefills_ = work_.size();
  plan_decodes(plan);

  StepResult result;
  const runtime::Status status = engine_.step(work_);
  if (!status.ok()) {
    // The refused sequences are dropped here; rank 0 ends their requests with the error.
    for (std::size_t i = 0; i < work_ids_.size(); ++i) {
      if (sequences_.erase(work_ids_[i]) > 0) engine_.release(work_ids_[i]);
    }
    result.ok = false;
    result.error = status.message();
    return result;
  }
  // Logits rows: one per work item, one per prompt token with prompt_logprobs, one per fed token of a decode
  // verifying drafts. A prefill's token is drawn from its last row (the other rows get greedy draws nobody
  // reads); a decode's row j is draw drawn + j, as the same sequence would draw it without drafts.
  controls_.clear();
  std::int64_t top_k = 0;
  bool scoring = false;
  for (std::size_t i = 0; i < work_ids_.size(); ++i) {
    const Sequence& seq = sequences_.at(work_ids_[i]);
    const std::size_t draws = draws_of(i);
    controls_.insert(controls_.end(), rows_of(i) - draws, kernels::SampleControls{});
    for (std::size_t j = 0; j < draws; ++j)
      controls_.push_back(runtime::sample_controls(seq.params, seq.drawn + j));
    scoring = scoring || seq.params.logprobs || seq.params.prompt_logprobs;
    top_k = std::max<std::int64_t>(top_k, seq.params.top_logprobs);
  }
  tokens_.resize(controls_.size());
  engine_.sample(controls_, tokens_);
  if (scoring) score(top_k);
  const auto counts = engine_.moe_counts();
  result.sequences.reserve(work_ids_.size());
  std::size_t row = 0;
  for (std::size_t i = 0; i < work_ids_.size(); ++i) {
    const std::uint64_t id = work_ids_[i];
    Sequence& seq = sequences_.at(id);
    const std::size_t first_row = row;
    row += rows_of(i);
    const std::size_t draw_row = row - draws_of(i);
    const std::span<const std::int32_t> draws(tokens_.data() + draw_row, row - draw_row);
    // A decode's drafts are its fed tokens after the first (none for a prefill).
    const std::span<const std::int32_t> drafts =
        i < prefills_ ? std::span<const std::int32_t>() : work_[i].tokens.subspan(1);
    const std::size_t kept = runtime::kept_draws(drafts, draws);
    SequenceResult& out = result.sequences.emplace_back();
    out.id = id;
    out.dropped = counts[i].dropped;
    out.rerouted = counts[i].rerouted;
    out.drafted = static_cast<std::int32_t>(drafts.size());
    out.accepted = static_cast<std::int32_t>(kept - 1);
    // A prefill's rows before its last score the prompt (a verifying decode's rows score its draws, below).
    if (scoring && seq.params.prompt_logprobs && i < prefills_) {
      for (std::size_t r = first_row; r + 1 < row; ++r) report(id, seq.params.top_logprobs, r, true, result);
    }
    for (std::size_t j = 0; j < kept; ++j) {
      const std::int32_t token = draws[j];
      // A failed sequence stays until rank 0 frees it with the request it ends (after the tokens kept
      // before).
      if (kernels::is_non_finite_token(token)) {
        out.failure = SequenceFailure::non_finite_logits;
        break;
      }
      result.tokens.push_back(token);
      ++out.tokens;
      seq.last = token;
      ++seq.drawn;
      if (drafter_ != nullptr) seq.history.push_back(token);
      if (scoring && seq.params.logprobs) report(id, seq.params.top_logprobs, draw_row + j, false, result);
    }
    // The cache keeps the fed tokens whose draws were kept; the last kept draw is fed next step.
    if (!drafts.empty())
      engine_.truncate(id, engine_.length(id) - static_cast<std::int64_t>(drafts.size() + 1 - kept));
  }
  return result;
}

void RankWorker::plan_decodes(const StepPlan& plan) {
  const std::int64_t k = drafter_ != nullptr ? drafter_->max_drafts() : 0;
  const auto stride = static_cast<std::size_t>(k + 1);
  // Sized before any span into it is taken; indexed by the decode's position in the plan.
  feed_.resize(plan.decodes.size() * stride);
  slots_.clear();
  for (std::size_t d = 0; d < plan.decodes.size(); ++d) {
    const std::uint64_t id = plan.decodes[d];
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;  // another rank's
    std::int32_t* const fed = feed_.data() + d * stride;
    fed[0] = it->second.last;
    work_.push_back({id, std::span<const std::int32_t>(fed, 1), false, true});
    work_ids_.push_back(id);
    if (drafter_ == nullptr) continue;
    const std::int64_t room =
        plan.max_drafts.empty() ? 0 : std::clamp<std::int64_t>(plan.max_drafts[d], 0, k);
    slots_.push_back(
        {id, it->second.history, std::span<std::int32_t>(fed + 1, static_cast<std::size_t>(room))});
  }
  // A drafter that runs the model (a collective) drafts every step on every rank, with or without decodes.
  if (drafter_ == nullptr || (slots_.empty() && !drafter_->collective())) return;
  // One proposal for all of this rank's decodes; slot s is decode work item prefills_ + s.
  draft_counts_.assign(slots_.size(), 0);
  drafter_->propose(slots_, draft_counts_);
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    runtime::Engine::Work& w = work_[prefills_ + s];
    const auto count = static_cast<std::size_t>(
        std::clamp<std::int64_t>(draft_counts_[s], 0, static_cast<std::int64_t>(slots_[s].drafts.size())));
    w.tokens = std::span<const std::int32_t>(w.tokens.data(), 1 + count);
    w.all_logits = count > 0;
  }
}

std::size_t RankWorker::rows_of(std::size_t item) const {
  return work_[item].all_logits ? work_[item].tokens.size() : 1;
}

std::size_t RankWorker::draws_of(std::size_t item) const {
  return item < prefills_ ? 1 : rows_of(item);
}

void RankWorker::score(std::int64_t top_k) {
  // Each row's next token: a prompt's own, then the token drawn from the prefill's last row; each of a
  // decode's rows is scored on its own draw (the kept ones are reported).
  targets_.clear();
  std::size_t row = 0;
  for (std::size_t i = 0; i < work_.size(); ++i) {
    const std::size_t rows = rows_of(i);
    if (i < prefills_ && rows > 1)
      targets_.insert(targets_.end(), work_[i].tokens.begin() + 1, work_[i].tokens.end());
    const std::size_t draws = draws_of(i);
    targets_.insert(targets_.end(), tokens_.begin() + static_cast<std::ptrdiff_t>(row + rows - draws),
                    tokens_.begin() + static_cast<std::ptrdiff_t>(row + rows));
    row += rows;
  }
  engine_.score(targets_, top_k, scores_);
}
void RankWorker::report(std::uint64_t id, std::int32_t top_count, std::size_t row, bool prompt,
                        StepResult& result) const {
  const auto r = static_cast<std::int64_t>(row);
  result.logprobs.push_back(
      {id, targets_[row], scores_.logprob(r), top_count, prompt ? std::uint8_t{1} : std::uint8_t{0}});
  for (std::int64_t j = 0; j < top_count; ++j)
    result.top_logprobs.push_back({scores_.top_id(r, j), scores_.top_logprob(r, j)});
}

}  // namespace capserve::server
