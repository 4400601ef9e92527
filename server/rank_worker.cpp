#include "server/rank_worker.h"

#include <algorithm>

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
    sequences_.insert_or_assign(s.id, Sequence{params, 0, 0});
    // Prompt log-probabilities are scored on the logits of every prompt position.
    work_.push_back({s.id, s.prompt, params.prompt_logprobs});
    work_ids_.push_back(s.id);
  }
  for (const std::uint64_t id : plan.decodes) {
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;  // another rank's
    work_.push_back({id, std::span<const std::int32_t>(&it->second.last, 1), false});
    work_ids_.push_back(id);
  }

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
  // Logits rows: one per work item, or one per prompt token with prompt_logprobs; each item's token is drawn
  // from its last row (the other rows get greedy draws nobody reads).
  controls_.clear();
  std::int64_t top_k = 0;
  bool scoring = false;
  for (std::size_t i = 0; i < work_ids_.size(); ++i) {
    Sequence& seq = sequences_.at(work_ids_[i]);
    controls_.insert(controls_.end(), rows_of(i) - 1, kernels::SampleControls{});
    controls_.push_back(runtime::sample_controls(seq.params, seq.drawn++));
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
    Sequence& seq = sequences_.at(work_ids_[i]);
    const std::size_t first_row = row;
    row += rows_of(i);
    const std::int32_t token = tokens_[row - 1];
    // A failed sequence stays until rank 0 frees it with the request it ends.
    const bool failed = kernels::is_non_finite_token(token);
    if (!failed) seq.last = token;
    result.sequences.push_back({work_ids_[i], seq.last, counts[i].dropped, counts[i].rerouted,
                                failed ? SequenceFailure::non_finite_logits : SequenceFailure::none});
    if (!scoring) continue;
    if (seq.params.prompt_logprobs) {
      for (std::size_t r = first_row; r + 1 < row; ++r)
        report(work_ids_[i], seq.params.top_logprobs, r, true, result);
    }
    if (seq.params.logprobs && !failed) report(work_ids_[i], seq.params.top_logprobs, row - 1, false, result);
  }
  return result;
}

std::size_t RankWorker::rows_of(std::size_t item) const {
  return work_[item].all_logits ? work_[item].tokens.size() : 1;
}

void RankWorker::score(std::int64_t top_k) {
  // Each row's next token: the prompt's own, then the token drawn from the item's last row.
  targets_.clear();
  std::size_t row = 0;
  for (std::size_t i = 0; i < work_.size(); ++i) {
    const std::size_t rows = rows_of(i);
    if (rows > 1) targets_.insert(targets_.end(), work_[i].tokens.begin() + 1, work_[i].tokens.end());
    row += rows;
    targets_.push_back(tokens_[row - 1]);
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
